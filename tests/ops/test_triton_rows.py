"""The Triton kernels of the gathered-row operators and the product-key top-k (ops/triton_rows)
against the operators' PyTorch implementation and plain indexing: on the GPU when there is
one, else in Triton's CPU interpreter (fp32 and fp16; the interpreter has no bf16)."""

import copy

import pytest
import torch

from tests.ops.triton_cases import skip_without_usable_triton

skip_without_usable_triton()

import sparseffn   # noqa: E402
from sparseffn.ops import kernels, product_keys, rows, triton_cvmm, triton_rows   # noqa: E402
from tests.ops.triton_cases import DEVICE, DTYPES, close, torch_path as _torch_path   # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_on_cpu")


def _pairs(tokens=37, m=5, num_rows=23, d=19, dtype=torch.float32, seed=0):
    """Odd sizes; table rows 0 and num_rows - 1 are read by no pair, row 3 by many (a token
    that reads it in every slot)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(1, num_rows - 1, (tokens, m), generator=gen)
    if tokens and num_rows > 4:
        idx[0] = 3
    to = lambda t: t.to(DEVICE)   # noqa: E731
    return (to(idx), to(torch.randn(tokens, m, generator=gen).to(dtype)),
            to(torch.randn(num_rows, d, generator=gen).to(dtype)),
            to(torch.randn(tokens, d, generator=gen).to(dtype)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 5, 23, 19), (1, 1, 5, 1), (64, 40, 130, 130)])
def test_operators_match_the_torch_implementation(dtype, shape):
    idx, w, table, x = _pairs(*shape, dtype=dtype)
    num_rows = table.shape[0]
    got = [kernels.gather_sum(idx, w, table), kernels.gather_dot(x, table, idx),
           kernels.scatter_rows(idx, w, x, num_rows)]
    want = _torch_path(lambda: [kernels.gather_sum(idx, w.float(), table.float()),
                                kernels.gather_dot(x.float(), table.float(), idx),
                                kernels.scatter_rows(idx, w.float(), x.float(), num_rows)])
    for g, ref in zip(got, want):
        assert g.dtype == dtype
        close(g, ref, dtype)
    unread = ~torch.isin(torch.arange(num_rows, device=DEVICE), idx)
    assert bool(unread.any()) and bool((got[2][unread] == 0).all()), \
        "rows no pair lands on are written as zeros"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradients_match_plain_indexing(dtype):
    idx, w, table, x = _pairs(dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (x, table, w)]
    ref = [t.detach().float().requires_grad_() for t in (x, table, w)]
    g1 = torch.randn(idx.shape, device=DEVICE)
    g2 = torch.randn(x.shape, device=DEVICE)
    got = (rows.gather_dot(leaves[0], leaves[1], idx).float() * g1).sum() \
        + (rows.gather_sum(idx, leaves[2], leaves[1]).float() * g2).sum()
    rx, rt, rw = ref
    want = ((rt[idx] * rx[:, None]).sum(-1) * g1).sum() + ((rw[..., None] * rt[idx]).sum(1) * g2).sum()
    got.backward()
    want.backward()
    for leaf, r in zip(leaves, ref):
        close(leaf.grad, r.grad, dtype)


def test_scatter_rows_splits_the_long_segments_of_a_small_table(monkeypatch,
                                                                kept_arrival_counts):
    """Few rows with many pairs each (product sub-keys): each row's segment is summed in
    pieces by several programs, added by the last of them to finish; the result is still the
    PyTorch one, deterministic, bit for bit the pieces added in a second launch, and the
    arrival counts are back at zero."""
    idx, w, _, x = _pairs(tokens=900, m=4, num_rows=5, d=21)
    kept = kept_arrival_counts
    got = kernels.scatter_rows(idx, w, x, 5)
    assert len(kept) == 1 and kept[0].numel() == 5 and bool((kept[0] == 0).all())
    close(got, _torch_path(kernels.scatter_rows, idx, w, x, 5), torch.float32)
    assert torch.equal(got, kernels.scatter_rows(idx, w, x, 5))
    monkeypatch.setattr(triton_cvmm, "ADD_PARTS_IN_KERNEL", False)
    assert torch.equal(got, kernels.scatter_rows(idx, w, x, 5))
    assert len(kept) == 2, "pieces added in a second launch count no arrivals"


def test_scatter_rows_is_deterministic_and_the_reverse_index_is_exact():
    idx, w, _, x = _pairs(tokens=300, m=16, num_rows=50, d=33)
    first = kernels.scatter_rows(idx, w, x, 50)
    assert torch.equal(first, kernels.scatter_rows(idx, w, x, 50))
    order, offsets = triton_rows.sorted_reverse_index(idx, 50)
    flat = idx.reshape(-1)
    for row in (0, 3, 17, 49):
        mine = order[offsets[row]:offsets[row + 1]]
        assert torch.equal(mine.cpu(), torch.nonzero(flat == row).flatten().cpu()), \
            "a row's pairs, in (token, slot) order"


@pytest.mark.parametrize("num_rows", [126, 127, 128, 32767])
def test_the_reverse_index_is_exact_at_every_key_width(num_rows):
    """Rows are sorted as the narrowest integers that hold [-1, num_rows]; out-of-range
    indices (clamped to -1 or num_rows) belong to no row."""
    torch.manual_seed(num_rows)
    idx = torch.randint(0, num_rows, (200, 5))
    idx[0] = torch.tensor([num_rows - 1, -7, num_rows, num_rows + 300, 0])
    order, offsets = triton_rows.sorted_reverse_index(idx.to(DEVICE), num_rows)
    flat = idx.reshape(-1)
    assert (offsets[-1] - offsets[0]).item() == int(((flat >= 0) & (flat < num_rows)).sum())
    for row in (0, 1, num_rows // 2, num_rows - 1):
        mine = order[offsets[row]:offsets[row + 1]].long()
        assert torch.equal(mine.cpu(), torch.nonzero(flat == row).flatten())


def test_a_given_row_index_gives_the_same_table_gradient():
    idx, w, _, x = _pairs(tokens=300, m=16, num_rows=50, d=33)
    order, offsets = kernels.row_index(idx, 50)
    assert order.dtype == offsets.dtype == torch.int32
    want_order, want_offsets = triton_rows.sorted_reverse_index(idx, 50)
    assert torch.equal(order, want_order) and torch.equal(offsets, want_offsets)
    assert torch.equal(kernels.scatter_rows(idx, w, x, 50, order, offsets),
                       kernels.scatter_rows(idx, w, x, 50))
    torch.library.opcheck(torch.ops.sparseffn.row_index.default, (idx, 50))
    torch.library.opcheck(torch.ops.sparseffn.scatter_rows.default,
                          (idx, w, x, 50, order, offsets))


def test_shared_row_index_only_where_the_triton_table_gradient_uses_it():
    idx, _, table, x = _pairs()
    table.requires_grad_()
    assert rows.shared_row_index(idx, table.shape[0], table, x) is not None
    assert rows.shared_row_index(idx, table.shape[0], table, x, sparse_grad=True) is None
    with torch.no_grad():
        assert rows.shared_row_index(idx, table.shape[0], table, x) is None
    assert rows.shared_row_index(idx, table.shape[0], table.detach(), x) is None
    assert rows.shared_row_index(idx, table.shape[0], table.double(), x) is None


@pytest.mark.parametrize("tokens", [37, 0])
def test_row_usage_from_the_row_index_is_the_summed_usage(tokens):
    """Each row's pair count (exact) and weight sum from the row index, as the layers' usage
    statistics sum them pair by pair; rows no pair reads get zeros, a given mass is kept."""
    from sparseffn.routing import expert_usage
    idx, w, table, _ = _pairs(tokens=tokens)
    table.requires_grad_()
    num_rows = table.shape[0]
    row_index = rows.shared_row_index(idx, num_rows, table)
    counts, mass = rows.row_usage(idx, w.requires_grad_(), num_rows, row_index)
    want_counts, want_mass = expert_usage(idx, w, num_rows)
    assert counts.dtype == mass.dtype == torch.float32 and not mass.requires_grad
    assert torch.equal(counts, want_counts) and counts.sum() == idx.numel()
    close(mass, want_mass, torch.float32)
    if tokens:
        assert counts[0] == mass[0] == 0 and counts[3] >= idx.shape[1]
    given = torch.arange(num_rows, dtype=torch.float32, device=DEVICE)
    assert torch.equal(rows.row_usage(idx, w, num_rows, row_index, given)[1], given)


def test_empty_batch_and_no_slots():
    idx, w, table, x = _pairs(tokens=0)
    assert kernels.gather_sum(idx, w, table).shape == (0, table.shape[1])
    assert kernels.gather_dot(x, table, idx).shape == (0, idx.shape[1])
    empty_grad = kernels.scatter_rows(idx, w, x, table.shape[0])
    assert empty_grad.shape == table.shape and bool((empty_grad == 0).all())
    idx, w, table, x = _pairs(m=0)
    assert bool((kernels.gather_sum(idx, w, table) == 0).all())
    assert kernels.gather_dot(x, table, idx).shape == (x.shape[0], 0)
    assert bool((kernels.scatter_rows(idx, w, x, table.shape[0]) == 0).all())


def test_nan_reaches_only_the_rows_that_read_it():
    idx, w, table, x = _pairs()
    x[5, 2] = float("nan")
    table[idx[9, 1]] = float("nan")
    out = kernels.gather_sum(idx, w, table)
    bad_tokens = (idx == idx[9, 1]).any(1)
    assert bool(out[bad_tokens].isnan().any(1).all()) and bool(out[~bad_tokens].isfinite().all())
    grad = kernels.scatter_rows(idx, w, x, table.shape[0])
    bad_rows = torch.zeros(table.shape[0], dtype=torch.bool, device=DEVICE)
    bad_rows[idx[5]] = True
    assert bool(grad[bad_rows].isnan().any(1).all()) and bool(grad[~bad_rows].isfinite().all())


def test_out_of_range_indices_read_zero_rows_and_land_nowhere():
    """Unchecked (GPU, outside debug mode) bad indices never read or write outside the
    tensors: they read as zero rows and their pairs reach no row of the gradient."""
    idx, w, table, x = _pairs()
    bad = idx.clone()
    bad[4, 0], bad[7, 2] = -1, table.shape[0] + 5
    out = triton_rows.gather_sum(bad, w, table)
    ok = bad.clamp(0, table.shape[0] - 1)
    keep = ((bad >= 0) & (bad < table.shape[0])).to(w.dtype)
    close(out, kernels.gather_sum(ok, w * keep, table), torch.float32)
    dots = triton_rows.gather_dot(x, table, bad)
    assert dots[4, 0] == 0 and dots[7, 2] == 0
    close(triton_rows.scatter_rows(bad, w, x, table.shape[0]),
           kernels.scatter_rows(ok, w * keep, x, table.shape[0]), torch.float32)


def _scatter_rows_dot_reference(idx, w, src, table):
    """The two gradients of gather_sum from the two operators, through the PyTorch path."""
    return _torch_path(lambda: (kernels.scatter_rows(idx, w.float(), src.float(), table.shape[0]),
                                kernels.gather_dot(src.float(), table.float(), idx)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 5, 23, 19), (1, 1, 5, 1), (64, 40, 130, 130),
                                   (900, 4, 5, 21), (6, 3, 7, 1030)])
def test_scatter_rows_dot_is_the_table_gradient_and_the_dots(dtype, shape):
    """Odd sizes, one pair, many rows, few rows with long segments (split into pieces), a row
    wider than one program's usual tile (BLOCK_D 2048, two pairs at a time)."""
    idx, w, table, src = _pairs(*shape, dtype=dtype)
    table_grad, dots = kernels.scatter_rows_dot(idx, w, src, table)
    want_grad, want_dots = _scatter_rows_dot_reference(idx, w, src, table)
    assert table_grad.dtype == dots.dtype == dtype
    close(table_grad, want_grad, dtype)
    close(dots, want_dots, dtype)
    unread = ~torch.isin(torch.arange(table.shape[0], device=DEVICE), idx)
    assert bool((table_grad[unread] == 0).all())
    again = kernels.scatter_rows_dot(idx, w, src, table)
    assert torch.equal(again[0], table_grad) and torch.equal(again[1], dots), "deterministic"


def test_scatter_rows_dot_takes_a_given_row_index_and_traces():
    idx, w, table, src = _pairs(tokens=100, m=16, num_rows=50, d=33)
    order, offsets = kernels.row_index(idx, 50)
    given = kernels.scatter_rows_dot(idx, w, src, table, order, offsets)
    for got, want in zip(given, kernels.scatter_rows_dot(idx, w, src, table)):
        assert torch.equal(got, want)
    torch.library.opcheck(torch.ops.sparseffn.scatter_rows_dot.default,
                          (idx, w, src, table, order, offsets))


def test_scatter_rows_dot_of_an_empty_batch_no_slots_and_an_empty_table():
    for tokens, m, num_rows in ((0, 5, 23), (37, 0, 23)):
        idx, w, table, src = _pairs(tokens=tokens, m=m, num_rows=num_rows)
        table_grad, dots = kernels.scatter_rows_dot(idx, w, src, table)
        assert table_grad.shape == table.shape and bool((table_grad == 0).all())
        assert dots.shape == idx.shape
    idx, w, table, src = _pairs()
    table_grad, dots = triton_rows.scatter_rows_dot(idx[:, :0], w[:, :0], src, table[:0])
    assert table_grad.shape == (0, table.shape[1]) and dots.shape == (idx.shape[0], 0)


def test_scatter_rows_dot_nan_reaches_only_the_pairs_that_read_it():
    idx, w, table, src = _pairs()
    src[5, 2] = float("nan")
    table[idx[9, 1]] = float("nan")
    table_grad, dots = kernels.scatter_rows_dot(idx, w, src, table)
    bad_rows = torch.zeros(table.shape[0], dtype=torch.bool, device=DEVICE)
    bad_rows[idx[5]] = True
    assert bool(table_grad[bad_rows].isnan().any(1).all())
    assert bool(table_grad[~bad_rows].isfinite().all())
    bad_pairs = (idx == idx[9, 1])
    bad_pairs[5] = True
    assert bool(dots[bad_pairs].isnan().all()) and bool(dots[~bad_pairs].isfinite().all())


def test_scatter_rows_dot_out_of_range_pairs_land_nowhere_and_dot_zero():
    idx, w, table, src = _pairs()
    bad = idx.clone()
    bad[4, 0], bad[7, 2] = -1, table.shape[0] + 5
    ok = bad.clamp(0, table.shape[0] - 1)
    keep = ((bad >= 0) & (bad < table.shape[0])).to(w.dtype)
    table_grad, dots = triton_rows.scatter_rows_dot(bad, w, src, table)
    close(table_grad, kernels.scatter_rows(ok, w * keep, src, table.shape[0]), torch.float32)
    assert dots[4, 0] == 0 and dots[7, 2] == 0
    close(dots, triton_rows.gather_dot(src, table, bad), torch.float32)


def test_rows_wider_than_the_fused_kernel_take_the_two_kernels(monkeypatch):
    idx, w, table, src = _pairs(tokens=3, m=2, num_rows=4, d=21)
    assert triton_rows.scatter_rows_dot_usable(w, src, table)
    monkeypatch.setattr(triton_rows, "MAX_DOT_WIDTH", 16)
    assert not triton_rows.scatter_rows_dot_usable(w, src, table)
    fused = []
    monkeypatch.setattr(triton_rows, "scatter_rows_dot", lambda *a: fused.append(1))
    table_grad, dots = kernels.scatter_rows_dot(idx, w, src, table)
    want_grad, want_dots = _scatter_rows_dot_reference(idx, w, src, table)
    assert not fused
    close(table_grad, want_grad, torch.float32)
    close(dots, want_dots, torch.float32)


def _sorted_topk(values, k):
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


@pytest.mark.parametrize("n_a,n_b,k", [(8, 8, 4), (16, 8, 16), (5, 7, 9), (3, 3, 9), (62, 62, 32),
                                       (1, 6, 2), (100, 37, 64)])
@pytest.mark.parametrize("ties", [False, True])
def test_product_key_topk_is_exactly_the_top_k_of_all_sums(n_a, n_b, k, ties):
    # one interpreted program a row: fewer rows of random scores at the largest grid
    rows = 21 if n_a * n_b < 1000 else 7
    gen = torch.Generator().manual_seed(n_a * 100 + k)
    s_a, s_b = torch.randn(rows, n_a, generator=gen), torch.randn(rows, n_b, generator=gen)
    if ties:
        s_a, s_b = s_a.round(), s_b.round()
    s_a, s_b = s_a.to(DEVICE), s_b.to(DEVICE)
    assert triton_rows.product_key_topk_usable(s_a, s_b, k)
    values, idx = kernels.product_key_topk(s_a, s_b, k)
    want_values, want_idx = _torch_path(kernels.product_key_topk, s_a, s_b, k)
    assert torch.equal(idx, want_idx) and torch.equal(values, want_values)
    full = (s_b[:, :, None] + s_a[:, None, :]).reshape(rows, -1).cpu()     # index i + n_a·j
    for r in range(rows):
        assert idx[r].tolist() == _sorted_topk(full[r].tolist(), k)


@pytest.mark.parametrize("n_a,n_b,k", [(8, 8, 4), (62, 62, 32), (5, 7, 9), (100, 37, 64)])
def test_product_key_topk_selects_over_the_whole_grid_only_where_the_kth_sum_ties(n_a, n_b, k):
    """The kernel keys (log2 K + 1)·K candidate cells, not K²: a block of rows goes to the
    exact selection over the whole grid only where the candidate after the k-th ties its sum.
    Rows 0-7 have distinct sums. Rows 8-15 have two equal best sub-keys in half a, far above
    the rest, so the top sums come in equal pairs (0, j), (1, j): ties among the taken, which
    the keys order by index, and at the k-th only for odd k. Row 16 (every score equal), in
    a block of its own that the last row ends, ties everywhere. (A program takes a block of
    at most 8 rows; each is interpreted slowly on the CPU, so 17 rows hold every kind.) All
    agree with the PyTorch path."""
    gen = torch.Generator().manual_seed(n_a + k)
    s_a, s_b = torch.randn(17, n_a, generator=gen), torch.randn(17, n_b, generator=gen)
    s_a[8:16, :2] = 100.0
    s_a[16], s_b[16] = 0.0, 0.0
    s_a, s_b = s_a.to(DEVICE), s_b.to(DEVICE)
    idx, from_cells = triton_rows.product_key_topk_indices(s_a, s_b, k)
    _, want_idx = _torch_path(kernels.product_key_topk, s_a, s_b, k)
    assert torch.equal(idx, want_idx)
    assert bool(from_cells[:8].all()), "distinct sums"
    assert bool(from_cells[8:16].all()) == (k % 2 == 0), "pairs of equal sums: a tie at odd k"
    if k % 2 == 0:      # the pairs taken in index order, (0, j) before (1, j)
        best_b = int(s_b[8].argmax())
        assert idx[8, :2].tolist() == [n_a * best_b, 1 + n_a * best_b]
    assert not bool(from_cells[16]), "every sum ties the k-th"


# fl(1e8 + 1.5) = fl(1e8 + 1.0) = 1e8 (fp32 spacing 8 there): among equal sums the lower key
# index comes first, though the higher score of a half made one of them.
_ROUNDED_TIES = [
    # (s_a, s_b, k, top k, from the candidate cells): keys i + n_a·j
    ([1e8, -5.0], [1.0, 1.5, -3.0], 2, [0, 2], True),            # a tie between two taken
    ([1e8, 1e8 - 16], [1.0, 64.0, 1.5, -1e3], 3, [2, 3, 0], False),   # the next one ties
    ([1e8, 1e8 - 16], [1.0, 64.0, 1.5, -1e3], 2, [2, 3], True),   # no tie at the k-th
    ([1e8], [-1.0, 0.0], 1, [1], True),     # key 0 ties but is no candidate (b's best is 1)
]


@pytest.mark.parametrize("s_a,s_b,k,want,from_cells", _ROUNDED_TIES)
def test_product_key_topk_orders_rounded_ties_by_index(s_a, s_b, k, want, from_cells):
    s_a, s_b = torch.tensor([s_a], device=DEVICE), torch.tensor([s_b], device=DEVICE)
    idx, got_from_cells = triton_rows.product_key_topk_indices(s_a, s_b, k)
    assert idx[0].tolist() == want and bool(got_from_cells[0]) == from_cells
    assert torch.equal(idx, _torch_path(kernels.product_key_topk, s_a, s_b, k)[1])


def test_product_key_topk_ranks_nan_and_inf_as_the_pytorch_path_and_sums_the_originals():
    """The kernel ranks NaN and -inf below every number and +inf above (``kernels.rankable``)
    and writes the sums of the original scores, with no host read: the PyTorch path's
    indices and values, bit for bit, NaN included, and indices always in range."""
    gen = torch.Generator().manual_seed(5)
    s_a, s_b = torch.randn(6, 10, generator=gen), torch.randn(6, 9, generator=gen)
    s_a[2, 4] = float("nan")          # keys i = 4 of row 2 rank last
    s_b[3] = float("-inf")            # every sum of row 3 is -inf
    s_a[4, 1] = float("inf")          # keys i = 1 of row 4 rank first
    s_a[5] = float("nan")             # every sum of row 5 is NaN
    s_a, s_b = s_a.to(DEVICE), s_b.to(DEVICE)
    values, idx = kernels.product_key_topk(s_a, s_b, 7)
    want_values, want_idx = _torch_path(kernels.product_key_topk, s_a, s_b, 7)
    assert torch.equal(idx, want_idx)
    torch.testing.assert_close(values, want_values, rtol=0, atol=0, equal_nan=True)
    assert bool(((idx >= 0) & (idx < 90)).all())
    assert not bool((idx[2] % 10 == 4).any()) and bool(values[2].isfinite().all())
    assert len(set(idx[3].tolist())) == 7 and bool((values[3] == float("-inf")).all())
    assert idx[4].tolist() == [1 + 10 * j for j in range(7)], "+inf first, ties by index"
    assert bool((values[4] == float("inf")).all())
    assert idx[5].tolist() == list(range(7)) and bool(values[5].isnan().all())


@pytest.mark.parametrize("layer", ["pkm", "peer"])
def test_layers_train_the_same_through_the_kernels(layer, monkeypatch):
    """A training forward+backward of PKM and PEER through the kernels gives the output, every
    gradient and the usage statistics of the PyTorch path, every kernel runs, and the pairs are
    grouped by row once (the table gradients and the usage statistics share it)."""
    calls, sorts = set(), []
    for fn in ("gather_dot", "gather_sum", "scatter_rows", "scatter_rows_dot", "product_key_topk",
               "dense_rows"):
        original = getattr(triton_rows, fn)
        monkeypatch.setattr(triton_rows, fn, lambda *a, _f=original, _n=fn: calls.add(_n) or _f(*a))
    sort = triton_rows.sorted_reverse_index
    monkeypatch.setattr(triton_rows, "sorted_reverse_index", lambda *a: sorts.append(1) or sort(*a))
    torch.manual_seed(0)
    if layer == "pkm":
        module = sparseffn.ProductKeyMemory(d_model=24, num_subkeys=9, heads=2, k=5)
    else:
        module = sparseffn.PEER(d_model=24, num_experts=100, heads=3, k=4, key_dim=12)
    module = module.to(DEVICE).train()
    x = torch.randn(2, 7, 24, device=DEVICE)

    def step(m):
        m.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_()
        y = m(xx)
        (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
        return [y, xx.grad, m.usage_counts.clone(), m.usage_mass.clone()] + \
            [p.grad for _, p in sorted(m.named_parameters())]

    want = _torch_path(step, copy.deepcopy(module))
    assert not calls
    got = step(module)
    # PKM's value gradients come from the fused kernel; PEER's v_i too, its u_i's from the
    # two kernels (the gradient of a gather_dot); the usage mass is a scatter_rows
    fused = {"gather_sum", "scatter_rows_dot", "product_key_topk", "dense_rows", "scatter_rows"}
    assert calls == (fused if layer == "pkm" else fused | {"gather_dot"})
    # PKM's value table and PEER's two tables (u_i and v_i, read with the same pairs), and the
    # usage statistics: the pairs are grouped by row once a step
    assert len(sorts) == 1
    assert torch.equal(got[2], want[2]) and got[2].sum() == module.routing_stats["counts"].sum()
    assert 0 < got[2].sum() == x.shape[0] * x.shape[1] * module.config.heads * module.config.k
    for g, w in zip(got, want):
        close(g, w, torch.float32)


def test_dense_rows_sums_each_tokens_pairs_in_place():
    idx = torch.tensor([[0, 2, 2, 4], [1, 1, 1, 1], [3, 0, 4, 2]], device=DEVICE)
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.5, 0.25, 0.125, 1.0], [float("nan"), 1, 1, 1]],
                     device=DEVICE)
    got = kernels.dense_rows(idx, w, 6)
    want = torch.zeros(3, 6, device=DEVICE).scatter_add_(1, idx, w)
    torch.testing.assert_close(got, want, equal_nan=True)
    assert got[2].isnan().tolist() == [False, False, False, True, False, False], \
        "a NaN weight reaches only its own entry"
    assert kernels.dense_rows(idx[:0], w[:0], 6).shape == (0, 6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,m,num_rows", [(37, 5, 11), (33, 32, 62), (9, 45, 130),
                                                (1, 1, 1)])
def test_dense_rows_adds_in_slot_order_whatever_the_slots_a_load(tokens, m, num_rows, dtype,
                                                                monkeypatch):
    """The kernel's sums are the CPU ``scatter_add_``'s, bit for bit (float32 sums in slot
    order, rounded once), with the pairs loaded a tile of slots at a time or one slot at a
    time (DENSE_ROWS_SLOTS 1, as before): fewer slots than a tile, exactly a tile, more than
    one tile with a partial last one; columns over several blocks; repeated rows within a
    token (sub-keys shared by several selected product keys); a NaN weight that reaches only
    its own entry."""
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(0, num_rows, (tokens, m), generator=gen)
    idx[0, -1] = idx[0, 0]                      # a row named twice by one token
    w = torch.randn(tokens, m, generator=gen).to(dtype)
    if m > 2:
        w[-1, 1] = float("nan")
    want = torch.zeros(tokens, num_rows).scatter_add_(1, idx, w.float()).to(dtype)
    for slots in (triton_rows.DENSE_ROWS_SLOTS, 1):
        monkeypatch.setattr(triton_rows, "DENSE_ROWS_SLOTS", slots)
        got = kernels.dense_rows(idx.to(DEVICE), w.to(DEVICE), num_rows).cpu()
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    if m > 2:
        assert got[-1].isnan().sum() == 1, "a NaN weight reaches only its own entry"


@pytest.mark.parametrize("shared", [True, False])
def test_retrieval_dense_backward_matches_the_gathered_one(shared, monkeypatch):
    """Small sub-key tables take the dense backward (the Triton dense_rows, two GEMMs per
    half); it gives the gradients of the gathered-row backward."""
    gen = torch.Generator().manual_seed(3)
    heads, n, d, tokens, k = 3, 11, 6, 29, 5
    qshape = (tokens, 2 * d) if shared else (tokens, heads, 2 * d)
    leaves = [torch.randn(*qshape, generator=gen),
              torch.randn(heads, n, d, generator=gen), torch.randn(heads, n, d, generator=gen)]
    leaves = [t.to(DEVICE).requires_grad_() for t in leaves]
    grad = torch.randn(tokens, heads, k, device=DEVICE)

    def run():
        scores, idx = product_keys.retrieve(*leaves, k)
        return [scores, idx] + list(torch.autograd.grad((scores * grad).sum(), leaves))

    got = run()
    monkeypatch.setattr(product_keys, "_DENSE_BACKWARD_ROWS", 0)     # every table is large
    want = _torch_path(run)
    assert torch.equal(got[1], want[1])
    for g, w in zip(got[:1] + got[2:], want[:1] + want[2:]):
        close(g, w, torch.float32)


def test_reduced_precision_x_and_weights_read_a_float32_table():
    """PKM and PEER under autocast read a table in place, in float32, for a batch that reads
    each row fewer than ``CAST_READS_PER_ROW`` times (decoding): the kernels then get x and
    the weights in the reduced dtype and the table in float32, and return float32 (gather_dot:
    the promoted dtype; gather_sum: the table's), as the PyTorch implementation does."""
    low = DTYPES[-1]                       # bf16 on a GPU, fp16 in the interpreter
    idx, w, table, x = _pairs(37, 5, 23, 19)
    assert triton_rows.usable(x.to(low), w.to(low), table)          # the kernels run
    got = [kernels.gather_dot(x.to(low), table, idx), kernels.gather_sum(idx, w.to(low), table)]
    want = _torch_path(lambda: [kernels.gather_dot(x.to(low).float(), table, idx),
                                kernels.gather_sum(idx, w.to(low).float(), table)])
    for g, ref in zip(got, want):
        assert g.dtype == torch.float32
        close(g, ref, torch.float32)


def _candidate_cells(K: int) -> set[tuple[int, int]]:
    """The cells of the product-key top-k kernel's candidate blocks, as its docstring
    defines them: row 0, then rows [2^a, 2^(a+1)) by columns [0, K / 2^a)."""
    cells = {(0, j) for j in range(K)}
    a = 0
    while 1 << a < K:
        cells |= {(i, j) for i in range(1 << a, 2 << a) for j in range(K >> a)}
        a += 1
    return cells


@pytest.mark.parametrize("k", list(range(1, 65)))
def test_the_candidate_cells_hold_the_top_k_and_reveal_every_tie_they_leave_out(k):
    """What the kernel's exactness rests on, for every k it takes. The cells hold every
    (i, j) with (i+1)(j+1) <= k (the only ones that can be among the top k but by a tie), at
    least k of those whose halves exist (n_a·n_b >= k), and each cell left out has at least k+1
    cells in its box [0, i] × [0, j], each summing to at least its sum: so if it ties the k-th
    sum, the candidate after the k-th ties it too, and the block takes the exact selection."""
    K = 1 << (k - 1).bit_length()
    cells = _candidate_cells(K)
    assert len(cells) == K * (K.bit_length())
    for i in range(K):
        for j in range(K):
            if (i, j) in cells:
                continue
            assert (i + 1) * (j + 1) > k
            assert sum(1 for a, b in cells if a <= i and b <= j) >= k + 1
    for n_a in range(1, k + 1):
        for n_b in range(-(-k // n_a), k + 1):
            assert sum(1 for a, b in cells if a < n_a and b < n_b) >= k


@pytest.mark.parametrize("n_a,n_b,k", [(62, 62, 32), (40, 9, 17), (12, 12, 64)])
def test_product_key_topk_at_the_edge_of_the_candidate_cells(n_a, n_b, k):
    """Scores whose sums order the grid by (i+1)(j+1), the edge of the candidate cells:
    s_a[i] = -log(i+1) at a random place of each half (so indices do not follow ranks), with
    the rounding ties of logs of equal products. The kernel agrees with the PyTorch path."""
    gen = torch.Generator().manual_seed(k)
    rank_a, rank_b = torch.arange(1, n_a + 1.0).log(), torch.arange(1, n_b + 1.0).log()
    s_a = torch.stack([-rank_a[torch.randperm(n_a, generator=gen)] for _ in range(9)])
    s_b = torch.stack([-rank_b[torch.randperm(n_b, generator=gen)] for _ in range(9)])
    s_a, s_b = s_a.to(DEVICE), s_b.to(DEVICE)
    values, idx = kernels.product_key_topk(s_a, s_b, k)
    want_values, want_idx = _torch_path(kernels.product_key_topk, s_a, s_b, k)
    assert torch.equal(idx, want_idx) and torch.equal(values, want_values)


@pytest.mark.skipif(not triton_rows._TL_TOPK, reason="tl.topk needs Triton 3.4 or later")
@pytest.mark.parametrize("n_a,n_b,k", [(8, 8, 4), (5, 7, 9), (3, 40, 20)])
def test_product_key_topk_sorts_the_same_with_tl_topk(n_a, n_b, k, monkeypatch):
    """On a GPU the kernel sorts with Triton's ``tl.topk``; the interpreter with the same
    network built of min/max swaps. Both, at small sizes (``tl.topk`` is slow to interpret),
    ties included, give the PyTorch path's result."""
    gen = torch.Generator().manual_seed(k)
    s_a, s_b = torch.randn(6, n_a, generator=gen), torch.randn(6, n_b, generator=gen)
    s_a[1], s_b[1] = s_a[1].round(), s_b[1].round()
    s_a, s_b = s_a.to(DEVICE), s_b.to(DEVICE)
    want = _torch_path(kernels.product_key_topk, s_a, s_b, k)[1]
    for tl_topk in (False, True):
        monkeypatch.setattr(triton_rows, "_use_tl_topk", lambda use=tl_topk: use)
        assert torch.equal(triton_rows.product_key_topk_indices(s_a, s_b, k)[0], want)
