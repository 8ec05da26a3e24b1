"""Product-key operators: exact top-k against full scoring (ties included), retrieval with its
gradients, and the gathered-row operators against plain indexing."""

import pytest
import torch

from tests.conftest import native_or_torch, require_native, torch_threads
from tests.ops.reference import product_key_reference
from sparseffn.ops import kernels, native, product_keys, rows


@pytest.fixture(params=["native", "torch"])
def rows_path(request):
    """Run through the C kernels of rows_cpu.c and through their PyTorch fallback."""
    yield from native_or_torch(request)



def _sorted_topk(values, k):
    """Reference: indices of the k largest by (value desc, index asc)."""
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


# --- top-k with deterministic ties ---------------------------------------------------------

@pytest.mark.parametrize("n,k", [(7, 3), (64, 16), (1000, 32), (1024, 16), (300, 300), (100, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_topk_lowest_index_matches_sorted_reference(rows_path, n, k, ties):
    scores = torch.randn(40, n)
    if ties:
        scores = (scores * 2).round() / 2          # few distinct values: many ties
    values, idx = product_keys.topk_lowest_index(scores, k)
    for r in range(scores.shape[0]):
        expect = _sorted_topk(scores[r].tolist(), k)
        assert idx[r].tolist() == expect
        assert torch.equal(values[r], scores[r, expect])


@pytest.mark.parametrize("n", [1, 15, 16, 17, 62, 127, 128, 129])
def test_topk_rows_counts_ranks_exactly_at_block_and_length_edges(rows_path, n):
    """Rows of at most 128 take the C kernel's rank count (16 lanes at a time), longer ones the
    scan: both give the sorted order, with ties (signed zeros equal) and infinities."""
    gen = torch.Generator().manual_seed(n)
    pool = torch.tensor([0.0, -0.0, 1.5, -2.0, float("inf"), float("-inf"), 3.0])
    scores = torch.cat([pool[torch.randint(0, 7, (20, n), generator=gen)],
                        torch.randn(20, n, generator=gen)])
    for k in sorted({1, max(1, n // 2), n}):
        values, idx = kernels.topk_rows(scores, k)
        for r in range(scores.shape[0]):
            expect = _sorted_topk(scores[r].tolist(), k)
            assert idx[r].tolist() == expect
            assert torch.equal(values[r], scores[r, expect])


def test_native_topk_rows_with_nan_still_writes_every_slot():
    """NaN has no rank: the operator refuses it, and the C kernel called directly leaves such a
    row to the scan, which still fills all k slots with entries of the row."""
    require_native()
    scores = torch.randn(3, 40)
    scores[1, 7] = float("nan")
    values, idx = native.topk_rows(scores, 10)
    assert bool(((idx >= 0) & (idx < 40)).all())
    torch.testing.assert_close(values, scores.gather(1, idx), rtol=0, atol=0, equal_nan=True)
    for r in (0, 2):
        assert idx[r].tolist() == _sorted_topk(scores[r].tolist(), 10)
    with pytest.raises(ValueError, match="NaN"):
        kernels.topk_rows(scores, 10)


def test_topk_lowest_index_all_equal_takes_the_first_k(rows_path):
    values, idx = product_keys.topk_lowest_index(torch.zeros(3, 50), 5)
    assert idx.tolist() == [[0, 1, 2, 3, 4]] * 3


@pytest.mark.parametrize("n_a,n_b,k", [(8, 8, 4), (16, 8, 16), (5, 7, 9), (3, 3, 9), (32, 32, 32),
                                       (1, 6, 2), (62, 62, 32), (50, 5, 40), (20, 20, 100),
                                       (40, 40, 200)])
@pytest.mark.parametrize("ties", [False, True])
def test_product_key_topk_is_exactly_the_top_k_of_all_sums(rows_path, n_a, n_b, k, ties):
    """The C kernel merges the two halves' top k by counting the ranks of the sums above a
    bound, or by inserts where sums tie or too many (more than 256) are above it: about 2k
    are for random scores, so the last two sizes take one path each."""
    s_a, s_b = torch.randn(30, n_a), torch.randn(30, n_b)
    if ties:
        s_a, s_b = s_a.round(), s_b.round()
    values, idx = product_keys.product_key_topk(s_a, s_b, k)
    full = (s_b[:, :, None] + s_a[:, None, :]).reshape(30, -1)       # Eq. 15: index i + n_a·j
    for r in range(30):
        expect = _sorted_topk(full[r].tolist(), k)
        assert idx[r].tolist() == expect
        assert torch.equal(values[r], full[r, expect])


def test_product_key_topk_of_no_rows(rows_path):
    """An empty batch: [0, k] values and indices on every path (the PyTorch path's reshape of
    the candidates to ``[0, -1]`` raised)."""
    values, idx = product_keys.product_key_topk(torch.randn(0, 7), torch.randn(0, 5), 4)
    assert values.shape == idx.shape == (0, 4) and idx.dtype == torch.int64


def _native_and_torch(fn, *args):
    """``fn(*args)`` through the C kernels, then through the PyTorch path."""
    got = fn(*args)
    native.set_native_enabled(False)
    try:
        return got, fn(*args)
    finally:
        native.set_native_enabled(True)


def test_native_and_torch_retrieval_agree_bitwise():
    require_native()
    s_a, s_b = torch.randn(500, 128).round(decimals=1), torch.randn(500, 128).round(decimals=1)
    got, want = _native_and_torch(product_keys.product_key_topk, s_a, s_b, 16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


@pytest.mark.parametrize("n", [9, 62, 200])
def test_native_product_key_topk_ranks_and_sums_non_finite_and_huge_scores_as_pytorch(n):
    """The C kernel maps scores as ``rankable`` does inside its loads (NaN and -inf lowest, +inf
    highest, finite scores beyond FLT_MAX/4 clamped, so they tie) and returns the sums of the
    original scores: the same bits as the PyTorch path, whose sums may overflow or be NaN."""
    require_native()
    gen = torch.Generator().manual_seed(n)
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 3e38, -3e38, 1e38])
    s_a, s_b = torch.randn(64, n, generator=gen), torch.randn(64, n, generator=gen)
    for s in (s_a, s_b):
        where = torch.rand(s.shape, generator=gen) < 0.15
        s[where] = special[torch.randint(0, 6, (int(where.sum()),), generator=gen)]
    got, want = _native_and_torch(product_keys.product_key_topk, s_a, s_b, 16)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=0, equal_nan=True)


def test_product_key_topk_ranks_non_finite_scores_the_same_on_every_path(rows_path):
    """The operator itself (the C kernel and the PyTorch path alike) ranks NaN and -inf last
    and +inf first, ties to the lower index, and returns the original sums."""
    s_a = torch.tensor([[1.0, float("nan"), 0.5], [float("inf"), 0.0, -1.0]])
    s_b = torch.tensor([[0.25, float("-inf")], [2.0, 1.0]])
    values, idx = kernels.product_key_topk(s_a, s_b, 4)      # key i + 3j
    assert idx.tolist() == [[0, 2, 1, 3], [0, 3, 1, 2]]
    assert values[0, :2].tolist() == [1.25, 0.75] and bool(values[0, 2].isnan())
    assert values[0, 3].item() == float("-inf")
    assert values[1].tolist() == [float("inf"), float("inf"), 2.0, 1.0]


def test_a_rounding_tie_outside_the_halves_top_k_is_not_taken(rows_path):
    """The documented edge of product-key exactness: s_a = [1e8], s_b = [-1, 0], k = 1. Both
    sums round to 1e8, so over all keys key 0 would come first (the lower index), but the
    result is the top 1 of the candidates of each half's top 1, key 1, on every path."""
    s_a, s_b = torch.tensor([[1e8]]), torch.tensor([[-1.0, 0.0]])
    assert (s_a[0, 0] + s_b[0, 0]).item() == (s_a[0, 0] + s_b[0, 1]).item()
    values, idx = kernels.product_key_topk(s_a, s_b, 1)
    assert idx.tolist() == [[1]] and values.tolist() == [[1e8]]


def test_product_key_topk_rejects_impossible_k():
    with pytest.raises(ValueError, match="k must lie in"):
        product_keys.product_key_topk(torch.randn(2, 3), torch.randn(2, 3), 10)


@pytest.mark.parametrize("backward", ["dense", "gathered"])
@pytest.mark.parametrize("shared", [False, True])
def test_retrieve_matches_full_scoring_with_gradients(rows_path, shared, backward, monkeypatch):
    """Both backwards: the full score GEMMs (small tables) and the selected rows (large)."""
    if backward == "gathered":
        monkeypatch.setattr(product_keys, "_DENSE_BACKWARD_ROWS", 0)
    T, H, n, d = 6, 3, 9, 10
    dtype = torch.float32 if rows_path == "native" else torch.float64
    keys_a = torch.randn(H, n, d // 2, dtype=dtype, requires_grad=True)
    keys_b = torch.randn(H, n, d // 2, dtype=dtype, requires_grad=True)
    q = torch.randn(T, d if shared else H * d, dtype=dtype, requires_grad=True)
    q3 = q.view(T, -1, d)
    scores, idx = product_keys.retrieve(q if shared else q3, keys_a, keys_b, k=5)
    assert (type(scores.grad_fn).__name__ == "_SelectedScoresBackward") == (backward == "dense")
    grad = torch.randn_like(scores)
    got = torch.autograd.grad((scores * grad).sum(), (q, keys_a, keys_b))
    qe = q3.expand(T, H, d)
    ref_scores, ref_idx = product_key_reference(qe[..., :d // 2], qe[..., d // 2:], keys_a,
                                                keys_b, 5)
    want = torch.autograd.grad((ref_scores * grad).sum(), (q, keys_a, keys_b))
    assert torch.equal(idx, ref_idx)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(scores, ref_scores, **tol)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)


@pytest.mark.parametrize("backward", ["dense", "gathered"])
@pytest.mark.parametrize("shared", [False, True])
def test_retrieve_splits_the_query_where_the_first_sub_keys_end(shared, backward, monkeypatch):
    """Halves of different widths: the first keys_a.shape[-1] units of the query score
    against keys_a, the rest against keys_b, and the query's gradient is one tensor."""
    if backward == "gathered":
        monkeypatch.setattr(product_keys, "_DENSE_BACKWARD_ROWS", 0)
    T, H, n_a, n_b, d_a, d_b = 5, 2, 7, 4, 3, 6
    keys_a = torch.randn(H, n_a, d_a, dtype=torch.float64, requires_grad=True)
    keys_b = torch.randn(H, n_b, d_b, dtype=torch.float64, requires_grad=True)
    q = torch.randn(T, d_a + d_b if shared else H * (d_a + d_b), dtype=torch.float64,
                    requires_grad=True)
    q3 = q.view(T, -1, d_a + d_b)
    scores, idx = product_keys.retrieve(q if shared else q3, keys_a, keys_b, k=6)
    grad = torch.randn_like(scores)
    got = torch.autograd.grad((scores * grad).sum(), (q, keys_a, keys_b))
    qe = q3.expand(T, H, d_a + d_b)
    ref_scores, ref_idx = product_key_reference(qe[..., :d_a], qe[..., d_a:], keys_a, keys_b, 6)
    want = torch.autograd.grad((ref_scores * grad).sum(), (q, keys_a, keys_b))
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(scores, ref_scores, rtol=1e-12, atol=1e-12)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shared", [False, True])
def test_retrieve_gives_a_bf16_query_its_gradient_in_bf16(shared):
    """A bf16 query (PEER's query network under autocast) is scored in float32; its gradient
    comes back in bf16, the float32 gradient rounded once."""
    T, H, n, d = 9, 3, 6, 8
    keys_a, keys_b = (torch.randn(H, n, d // 2, requires_grad=True) for _ in range(2))
    q = torch.randn(T, d if shared else H * d).to(torch.bfloat16).requires_grad_()
    q32 = q.detach().float().requires_grad_()
    grad = torch.randn(T, H, 4)

    def gradients(query):
        scores, _ = product_keys.retrieve(query if shared else query.view(T, H, d),
                                          keys_a, keys_b, 4)
        return torch.autograd.grad((scores * grad).sum(), (query, keys_a, keys_b))

    got, want = gradients(q), gradients(q32)
    assert got[0].dtype == torch.bfloat16
    assert torch.equal(got[0], want[0].to(torch.bfloat16))
    for g, w in zip(got[1:], want[1:]):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("shape", [(4, 7), (4, 3, 7), (4, 2, 8), (8,)])
def test_retrieve_names_a_query_that_does_not_fit_the_sub_keys(shape):
    keys_a, keys_b = torch.randn(3, 5, 4), torch.randn(3, 5, 4)
    with pytest.raises(ValueError, match=r"retrieve: the query must be \[tokens, 8\] or"):
        product_keys.retrieve(torch.randn(*shape), keys_a, keys_b, 2)


def test_retrieve_chunks_tokens_without_changing_results(monkeypatch):
    query = torch.randn(50, 2, 8)
    keys_a, keys_b = torch.randn(2, 16, 4), torch.randn(2, 16, 4)
    whole = product_keys.retrieve(query, keys_a, keys_b, 8)
    monkeypatch.setattr(product_keys, "_SCORE_CHUNK_ELEMENTS", 64)   # two tokens per chunk
    chunked = product_keys.retrieve(query, keys_a, keys_b, 8)
    assert torch.equal(whole[1], chunked[1])
    torch.testing.assert_close(whole[0], chunked[0])    # a GEMM's last bit depends on its size


# --- gathered rows --------------------------------------------------------------------------

def test_gather_dot_and_gather_sum_match_indexing_with_gradients(rows_path):
    dtype = torch.float32 if rows_path == "native" else torch.float64
    x = torch.randn(12, 7, dtype=dtype, requires_grad=True)
    table = torch.randn(20, 7, dtype=dtype, requires_grad=True)
    idx = torch.randint(0, 20, (12, 5))
    idx[0] = 3                                            # one row repeats a table row
    w = torch.randn(12, 5, dtype=dtype, requires_grad=True)
    g1, g2 = torch.randn(12, 5, dtype=dtype), torch.randn(12, 7, dtype=dtype)
    got = (rows.gather_dot(x, table, idx) * g1).sum() + (rows.gather_sum(idx, w, table) * g2).sum()
    want = ((table[idx] * x[:, None]).sum(-1) * g1).sum() \
        + (((w[..., None] * table[idx]).sum(1)) * g2).sum()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(got, want, **tol)
    for a, b in zip(torch.autograd.grad(got, (x, table, w)), torch.autograd.grad(want, (x, table, w))):
        torch.testing.assert_close(a, b, **tol)


def _bf16_round(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).double()


@pytest.mark.parametrize("tokens", [0, 1, 13])
def test_bf16_row_kernels_sum_in_float32_and_round_once(tokens):
    """The C row kernels read bf16 tables and write bf16 results (gather_sum's, scatter_rows'):
    every element is the float64 sum of the same bf16 operands rounded once, within one bf16
    rounding of it (the float32 partial sums), at an odd width, with table rows no pair reads
    (zero rows of the scatter) and an empty batch; NaN reaches only its token's outputs."""
    require_native()
    gen = torch.Generator().manual_seed(tokens)
    n, d, m = 23, 37, 5
    table = torch.randn(n, d, generator=gen).to(torch.bfloat16)
    x = torch.randn(tokens, d, generator=gen)
    w = torch.randn(tokens, m, generator=gen)
    src = torch.randn(tokens, d, generator=gen).to(torch.bfloat16)
    idx = torch.randint(0, n - 3, (tokens, m), generator=gen)      # rows n-3.. never read
    if tokens:
        x[0, 4] = float("nan")
        idx[-1, :2] = 7                                            # a repeated row
    t64, x64, w64, s64 = table.double(), x.double(), w.double(), src.double()
    dot = rows.gather_dot(x, table, idx)
    bag = rows.gather_sum(idx, w, table)
    scat = rows.scatter_rows(idx, w, src, n)
    assert (dot.dtype, bag.dtype, scat.dtype) == (torch.float32, torch.bfloat16, torch.bfloat16)
    want_dot = (t64[idx] * x64[:, None]).sum(-1)
    want_bag = (w64[..., None] * t64[idx]).sum(1)
    want_scat = torch.zeros(n, d, dtype=torch.float64).index_add_(
        0, idx.reshape(-1), (w64[..., None] * s64[:, None]).reshape(-1, d))
    torch.testing.assert_close(dot.double(), want_dot, rtol=1e-5, atol=1e-5, equal_nan=True)
    for got, want in ((bag, want_bag), (scat, want_scat)):
        assert torch.equal(got.isnan(), want.isnan())
        err = (got.double() - want).abs()
        assert bool((err <= (want.abs() * 2 ** -8 + 1e-30)).all()), err.max()   # one rounding
    assert torch.count_nonzero(scat[n - 3:]) == 0
    if tokens:
        assert bool(dot[0].isnan().all()) and not bool(dot[1:].isnan().any())
    assert torch.equal(bag.double(), _bf16_round(bag.float()))


def test_bf16_row_kernels_through_autograd_match_the_float32_products():
    """gather_dot and gather_sum on a bf16 table (as PKM and PEER read theirs under CPU bf16
    autocast): outputs and every gradient match the float64 products of the same bf16
    operands to bf16 precision, and the table's gradient comes back bf16."""
    require_native()
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(31, 19, generator=gen).to(torch.bfloat16).requires_grad_()
    x = torch.randn(9, 19, generator=gen, requires_grad=True)
    w = torch.randn(9, 4, generator=gen, requires_grad=True)
    idx = torch.randint(0, 31, (9, 4), generator=gen)
    g1, g2 = torch.randn(9, 4, generator=gen), torch.randn(9, 19, generator=gen)
    got = (rows.gather_dot(x, table, idx) * g1).sum() \
        + (rows.gather_sum(idx, w, table).float() * g2).sum()
    t64 = table.detach().double().requires_grad_()
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want = ((t64[idx] * x64[:, None]).sum(-1) * g1.double()).sum() \
        + (((w64[..., None] * t64[idx]).sum(1)) * g2.double()).sum()
    grads = torch.autograd.grad(got, (x, table, w))
    assert grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
    for a, b in zip(grads, torch.autograd.grad(want, (x64, t64, w64))):
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2)


def _scatter_in_pair_order(idx, w, src, num_rows):
    """scatter_rows' contract in float32 PyTorch ops: each output row is the sum of its pairs'
    ``w · src`` in pair order, every product and every sum rounded to float32."""
    flat, weights = idx.reshape(-1), w.reshape(-1)
    order = torch.argsort(flat, stable=True)                     # by row, then pair order
    rows_sorted = flat[order]
    rank = torch.arange(flat.numel()) - torch.searchsorted(rows_sorted, rows_sorted)
    out = torch.zeros(num_rows, src.shape[1])
    for r in range(int(rank.max()) + 1 if flat.numel() else 0):
        pairs = order[rank == r]                                 # each row at most once
        out[flat[pairs]] += weights[pairs, None] * src[pairs // idx.shape[1]].float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 15, 31, 32, 33, 64, 127, 128, 129, 200, 257])
def test_row_kernels_sum_each_column_in_pair_order_at_every_width(dtype, d):
    """The C row kernels hold blocks of columns in vector registers (steps of 2 vectors, a
    bf16 step split into even and odd columns, a scalar tail): at widths around every block
    edge, gather_sum and scatter_rows give the bits of a float32 sum in pair order (rounded
    once to bf16), and gather_dot the float64 dot product to float32 precision, for 9 pairs a
    token (groups of 4 and a remainder). 500 tokens give the scatter's sort several threads."""
    require_native()
    gen = torch.Generator().manual_seed(d)
    tokens, n, m = 500, 23, 9
    table = torch.randn(n, d, generator=gen).to(dtype)
    x, src = torch.randn(tokens, d, generator=gen), torch.randn(tokens, d, generator=gen).to(dtype)
    w = torch.randn(tokens, m, generator=gen)
    idx = torch.randint(0, n - 3, (tokens, m), generator=gen)   # rows n-3.. never read
    idx[0, :3] = 5                                              # a repeated row

    want_bag = torch.zeros(tokens, d)
    for j in range(m):                                          # pair order, float32
        want_bag += w[:, j, None] * table[idx[:, j]].float()
    assert torch.equal(rows.gather_sum(idx, w, table), want_bag.to(dtype))
    assert torch.equal(rows.scatter_rows(idx, w, src, n),
                       _scatter_in_pair_order(idx, w, src, n).to(dtype))
    want_dot = (table.double()[idx] * x.double()[:, None]).sum(-1)
    scale = (table.double()[idx].abs() * x.double().abs()[:, None]).sum(-1)
    err = (rows.gather_dot(x, table, idx).double() - want_dot).abs()
    assert bool((err <= 1e-6 * scale + 1e-30).all()), (err / scale).max()


def _native_scatter_rows_dot(monkeypatch):
    """kernels.scatter_rows_dot, failing the test unless the C kernel computes it."""
    calls = []
    fused = native.scatter_rows_dot
    monkeypatch.setattr(native, "scatter_rows_dot", lambda *a: calls.append(1) or fused(*a))

    def run(*args):
        before = len(calls)
        out = kernels.scatter_rows_dot(*args)
        assert len(calls) == before + 1, "the C kernel ran"
        return out
    return run


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [1, 15, 31, 32, 33, 64, 127, 128, 129, 200, 257])
def test_scatter_rows_dot_is_both_gradients_of_gather_sum_at_every_width(dtype, d, monkeypatch):
    """The C kernel's table gradient has the bits of scatter_rows (a float32 sum in pair
    order, rounded once), and each pair's dot with its table row is the float64 dot product to
    float32 precision (then rounded once to the dtype), at widths around every block edge
    (each block of columns adds its part of the dot), whatever the thread count."""
    require_native()
    run = _native_scatter_rows_dot(monkeypatch)
    gen = torch.Generator().manual_seed(d)
    tokens, n, m = 500, 23, 9
    table = torch.randn(n, d, generator=gen).to(dtype)
    src = torch.randn(tokens, d, generator=gen).to(dtype)
    w = torch.randn(tokens, m, generator=gen)
    idx = torch.randint(0, n - 3, (tokens, m), generator=gen)   # rows n-3.. never read
    idx[0, :3] = 5                                              # a repeated row
    # several threads, even where the test run gives each process one (tests/conftest.py)
    with torch_threads(max(2, torch.get_num_threads())):
        table_grad, dots = run(idx, w, src, table)
    assert table_grad.dtype == dots.dtype == dtype
    assert torch.equal(table_grad, _scatter_in_pair_order(idx, w, src, n).to(dtype))
    want = (table.double()[idx] * src.double()[:, None]).sum(-1)
    scale = (table.double()[idx].abs() * src.double().abs()[:, None]).sum(-1)
    rounding = 2 ** -8 if dtype == torch.bfloat16 else 0.0
    err = (dots.double() - want).abs()
    assert bool((err <= 1e-6 * scale + rounding * want.abs() + 1e-30).all()), (err / scale).max()
    with torch_threads(1):
        one = run(idx, w, src, table)
    assert torch.equal(one[0], table_grad) and torch.equal(one[1], dots)


def test_scatter_rows_dot_nan_empty_batch_and_mixed_dtypes(monkeypatch):
    """A NaN in a token's gradient reaches its pairs' dots and the table rows they land on, and
    nothing else; an empty batch gives zeros; a bf16 src with a float32 table (no C kernel
    takes it) gives the two operators' results."""
    require_native()
    run = _native_scatter_rows_dot(monkeypatch)
    gen = torch.Generator().manual_seed(0)
    idx = torch.randint(0, 30, (40, 6), generator=gen)
    w, src, table = (torch.randn(40, 6, generator=gen), torch.randn(40, 45, generator=gen),
                     torch.randn(30, 45, generator=gen))
    src[7, 44] = float("nan")
    table_grad, dots = run(idx, w, src, table)
    bad_rows = torch.isin(torch.arange(30), idx[7])
    assert bool(table_grad[bad_rows].isnan().any(1).all())
    assert bool(table_grad[~bad_rows].isfinite().all())
    assert bool(dots[7].isnan().all()) and bool(dots[torch.arange(40) != 7].isfinite().all())
    table_grad, dots = run(idx[:0], w[:0], src[:0], table)
    assert dots.shape == (0, 6) and torch.count_nonzero(table_grad) == 0
    half = src[:, :].nan_to_num().to(torch.bfloat16)
    mixed = kernels.scatter_rows_dot(idx, w, half, table)
    assert torch.equal(mixed[0], kernels.scatter_rows(idx, w, half, 30))
    assert torch.equal(mixed[1], kernels.gather_dot(half, table, idx))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_rows_is_independent_of_thread_count(dtype):
    require_native()
    idx = torch.randint(0, 50, (400, 16))
    w, src = torch.randn(400, 16), torch.randn(400, 33).to(dtype)
    with torch_threads(1):
        one = rows.scatter_rows(idx, w, src, 50)
    with torch_threads(max(2, torch.get_num_threads())):
        many = rows.scatter_rows(idx, w, src, 50)
    assert torch.equal(one, many)
    untouched = ~torch.isin(torch.arange(50), idx)
    assert torch.count_nonzero(one[untouched]) == 0


def test_gathered_rows_reject_bad_indices():
    with pytest.raises(IndexError, match=r"gather_dot: idx must lie in \[0, 4\), got values in "
                                         r"\[0, 4\]"):
        rows.gather_dot(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([[0], [4]]))
    with pytest.raises(IndexError, match=r"gather_sum: .* got values in \[-1, 2\]"):
        rows.gather_sum(torch.tensor([[-1], [2]]), torch.randn(2, 1), torch.randn(4, 3))
    with pytest.raises(ValueError, match="width"):
        rows.gather_dot(torch.randn(2, 5), torch.randn(4, 3), torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="must match idx"):
        rows.gather_sum(torch.tensor([[0], [1]]), torch.randn(2, 2), torch.randn(4, 3))


# --- the layers against loops ---------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("layer_type", ["PEER", "PKM"])
def test_nan_or_inf_in_a_product_key_layer_reaches_only_its_token(rows_path, bad, layer_type):
    """NaN and ±inf scores are ranked (NaN last) on every path, never left to the C top-k
    (which must not return indices it never wrote); the selected values are the original
    scores, so the bad token's output is non-finite and every other token's is unchanged."""
    import sparseffn
    torch.manual_seed(0)
    if layer_type == "PEER":
        layer = sparseffn.PEER(d_model=16, num_experts=64 * 64, heads=2, k=8, key_dim=16)
    else:
        layer = sparseffn.ProductKeyMemory(d_model=16, num_subkeys=64, heads=2, k=8, key_dim=16)
    layer.eval()                                # batch-statistics norms would mix tokens
    x = torch.randn(5, 16)
    clean = layer(x)
    x[2, 3] = bad
    out = layer(x)
    assert not bool(torch.isfinite(out[2]).all())
    others = [0, 1, 3, 4]
    torch.testing.assert_close(out[others], clean[others])


def test_unchecked_nan_ranks_first_with_indices_in_range(monkeypatch):
    """Off the CPU, outside debug mode, the scores are not read on the host: the PyTorch
    top-k (what CUDA runs) ranks NaN above every number and returns indices in range."""
    from sparseffn.ops import native
    monkeypatch.setattr(kernels, "checks_enabled", lambda tensor: False)
    native.set_native_enabled(False)
    try:
        scores = torch.tensor([[1.0, float("nan"), 0.5, 2.0], [0.0, 0.0, -1.0, 0.0]])
        values, idx = kernels.topk_rows(scores, 3)
        a, b = scores[:, :2].contiguous(), scores[:, 2:].contiguous()
        pk_values, pk_idx = kernels.product_key_topk(a, b, 3)
    finally:
        native.set_native_enabled(True)
    assert idx.tolist() == [[1, 3, 0], [0, 1, 3]]      # NaN first, then ties by index
    assert bool(values[0, 0].isnan()) and values[0, 1:].tolist() == [2.0, 1.0]
    # the product-key top-k ranks NaN last on every path: sums a[i] + b[j] at index i + 2j,
    # row 0: 3 at 2, 1.5 at 0, then the NaN sums (ties to the lower index); row 1: 0 at 2
    # and 3, then -1 at 0
    assert pk_idx.tolist() == [[2, 0, 1], [2, 3, 0]]
    assert pk_values[0, :2].tolist() == [3.0, 1.5] and bool(pk_values[0, 2].isnan())
    assert pk_values[1].tolist() == [0.0, 0.0, -1.0]


def test_the_top_k_operators_still_reject_nan_given_directly(rows_path):
    with pytest.raises(ValueError, match="NaN"):
        kernels.topk_rows(torch.tensor([[1.0, float("nan"), 0.5] * 30]), 4)
