"""The gathered-row products of a small table as dense products (``ops/dense_products.py``,
opt-in): the same values and gradients as plain indexing and as the row kernels, their
differences (NaN reaching every output through zero weights) as documented, and the choice of
when they run."""

import pytest
import torch

import sparseffn
from sparseffn.config import PEERConfig, PKMConfig
from sparseffn.ops import dense_products, kernels, rows
from tests.ops.triton_cases import DEVICE     # where the Triton kernels run (on a GPU: CUDA)


@pytest.fixture
def dense():
    dense_products.set_dense_products_enabled(True)
    yield
    dense_products.set_dense_products_enabled(False)


@pytest.fixture
def counted(monkeypatch):
    """How many times the dense form built an S (each dense product builds one)."""
    calls = []
    spread = dense_products.spread
    monkeypatch.setattr(dense_products, "spread", lambda *a: calls.append(1) or spread(*a))
    return calls


def _pairs(tokens=37, n=23, m=5, d=13, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n - 3, (tokens, m), generator=gen)      # rows n-3.. never read
    if tokens:
        idx[0, 1] = idx[0, 0]                                      # a row read twice by a token
    w = torch.randn(tokens, m, generator=gen, dtype=dtype)
    table = torch.randn(n, d, generator=gen, dtype=dtype)
    x = torch.randn(tokens, d, generator=gen, dtype=dtype)
    return idx, w, table, x


def test_dense_products_give_indexing_values_and_every_gradient(dense, counted):
    idx, w, table, x = _pairs()
    for t in (w, table, x):
        t.requires_grad_()
    g1, g2 = torch.randn(idx.shape, dtype=x.dtype), torch.randn(x.shape, dtype=x.dtype)
    got = (rows.gather_dot(x, table, idx) * g1).sum() + (rows.gather_sum(idx, w, table) * g2).sum()
    assert len(counted) == 1           # the forward's gather_sum; gather_dot builds no S
    want = ((table[idx] * x[:, None]).sum(-1) * g1).sum() \
        + ((w[..., None] * table[idx]).sum(1) * g2).sum()
    torch.testing.assert_close(got, want)
    grads = torch.autograd.grad(got, (x, table, w))
    assert len(counted) == 3           # gather_dot's two gradients, gather_sum's two: one each
    for a, b in zip(grads, torch.autograd.grad(want, (x, table, w))):
        torch.testing.assert_close(a, b)
    assert torch.count_nonzero(grads[1][-3:]) == 0      # rows no pair read: zero gradient


def test_each_operator_matches_the_row_kernels_in_float32(dense):
    idx, w, table, x = _pairs(dtype=torch.float32)
    n = table.shape[0]
    calls = lambda: [kernels.gather_dot(x, table, idx), kernels.gather_sum(idx, w, table),  # noqa
                     kernels.scatter_rows(idx, w, x, n), *kernels.scatter_rows_dot(idx, w, x, table)]
    got = calls()
    dense_products.set_dense_products_enabled(False)
    for a, b in zip(got, calls()):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [37, 0])
def test_gather_dots_two_gradients_are_the_two_operators_from_one_s(dense, counted, tokens):
    """``gather_sum_scatter_rows``: gather_sum and scatter_rows of the same pairs, one S in
    the dense form (two when src and table differ in dtype, none for an empty batch); the
    same as the row kernels; an operator that traces (opcheck)."""
    idx, w, table, x = _pairs(tokens=tokens, dtype=torch.float32)
    n = table.shape[0]
    got = kernels.gather_sum_scatter_rows(idx, w, table, x)
    assert len(counted) == (1 if tokens else 0)
    mixed = kernels.gather_sum_scatter_rows(idx, w, table, x.double())
    assert mixed[1].dtype == torch.float64 and len(counted) == (3 if tokens else 0)
    dense_products.set_dense_products_enabled(False)
    want = kernels.gather_sum(idx, w, table), kernels.scatter_rows(idx, w, x, n)
    for a, b, c in zip(got, want, mixed):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(c.float(), b, rtol=1e-5, atol=1e-5)
    dense_products.set_dense_products_enabled(True)
    torch.library.opcheck(torch.ops.sparseffn.gather_sum_scatter_rows.default,
                          (idx, w, table, x))


def test_out_of_range_pairs_read_zero_rows_and_land_nowhere(dense):
    idx, w, table, x = _pairs()
    n = table.shape[0]
    bad = idx.clone()
    bad[4, 0], bad[7, 2] = -1, n + 5
    keep = ((bad >= 0) & (bad < n)).to(w.dtype)
    ok = bad.clamp(0, n - 1)
    torch.testing.assert_close(kernels.gather_sum(bad, w, table),
                               kernels.gather_sum(ok, w * keep, table))
    torch.testing.assert_close(kernels.gather_dot(x, table, bad),
                               kernels.gather_dot(x, table, ok) * keep)
    torch.testing.assert_close(kernels.scatter_rows(bad, w, x, n),
                               kernels.scatter_rows(ok, w * keep, x, n))


def test_nan_reaches_every_output_through_the_zero_weights_as_documented(dense):
    """Unlike the row kernels (NaN only where a pair reads it), a dense product multiplies
    every row: a NaN in a table row no pair reads reaches that column of every output, and a
    NaN in one token's gradient reaches that column of every row of the table gradient. A
    NaN in x still reaches only its token's dots."""
    idx, w, table, x = _pairs()
    n = table.shape[0]
    table[n - 1, 2] = float("nan")                  # a row no pair reads
    out = kernels.gather_sum(idx, w, table)
    assert bool(out[:, 2].isnan().all()) and bool(out[:, [0, 1, 3]].isfinite().all())
    x[5, 4] = float("nan")
    grad = kernels.scatter_rows(idx, w, x, n)
    assert bool(grad[:, 4].isnan().all()) and bool(grad[:, [0, 1, 2, 5]].isfinite().all())
    table[n - 1, 2] = 0.0
    dots = kernels.gather_dot(x, table, idx)
    assert bool(dots[5].isnan().all()) and bool(dots[torch.arange(len(dots)) != 5].isfinite().all())


def test_when_the_dense_form_runs(dense, monkeypatch):
    idx, w, table, x = _pairs(m=2)
    assert dense_products.pays(idx, 128) and not dense_products.pays(idx, 129)   # 64 a pair
    assert not dense_products.pays(idx[:0], 10) and not dense_products.pays(idx, 0)
    monkeypatch.setattr(dense_products, "MAX_ELEMENTS", idx.shape[0] * 10 - 1)
    assert not dense_products.pays(idx, 10) and dense_products.pays(idx, 9)
    dense_products.set_dense_products_enabled(False)
    assert not dense_products.pays(idx, 9)


def test_an_empty_batch_takes_the_row_path(dense, counted):
    idx, w, table, x = _pairs(tokens=0)
    assert kernels.gather_sum(idx, w, table).shape == (0, table.shape[1])
    assert kernels.gather_dot(x, table, idx).shape == (0, idx.shape[1])
    assert torch.count_nonzero(kernels.scatter_rows(idx, w, x, table.shape[0])) == 0
    assert counted == []


def test_peer_shares_no_row_index_when_the_dense_form_runs(dense, triton_on_cpu):
    idx, _, table, x = (t.to(DEVICE) for t in _pairs(dtype=torch.float32))
    table.requires_grad_()
    assert rows.shared_row_index(idx, table.shape[0], table, x) is None
    dense_products.set_dense_products_enabled(False)
    assert rows.shared_row_index(idx, table.shape[0], table, x) is not None


@pytest.mark.parametrize("config", [
    PKMConfig(d_model=24, num_subkeys=6, heads=2, k=4, query="linear"),
    PEERConfig(d_model=24, num_experts=49, heads=2, k=4, key_dim=8)], ids=["pkm", "peer"])
@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16_autocast"])
def test_pkm_and_peer_train_the_same_with_dense_products(config, autocast, counted):
    torch.manual_seed(0)
    layer = sparseffn.build_layer(config).train()
    x = torch.randn(19, 24, requires_grad=True)

    def step():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            y = layer(x)
        y.float().square().sum().backward()
        return [y.detach().float(), x.grad] + [p.grad for p in layer.parameters()]

    want = step()
    assert counted == []
    dense_products.set_dense_products_enabled(True)
    try:
        got = step()
    finally:
        dense_products.set_dense_products_enabled(False)
    assert len(counted) >= 2
    tol = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_spread_rows_writes_each_rows_summed_weights_without_atomics(dtype, triton_on_cpu,
                                                                     monkeypatch):
    """The Triton S of the dense form: a token's repeats of a row summed, out-of-range pairs
    nowhere, every other element zero, the same bits on every run, and the same values as the
    scatter the dense form takes where the kernel does not."""
    from sparseffn.ops import triton_rows
    idx, w, _, _ = _pairs(tokens=37, n=41, m=6, dtype=torch.float32)
    idx[3, 2:5] = idx[3, 1]                                   # one row four times
    idx[4, 0], idx[5, 3] = -2, 41                             # out of range
    idx, w = idx.to(DEVICE), w.to(DEVICE)
    inside = ((idx >= 0) & (idx < 41)).double()
    want = torch.zeros(37, 41, dtype=torch.float64, device=DEVICE).scatter_add_(
        1, idx.clamp(0, 40), w.double() * inside)
    got = triton_rows.spread_rows(idx, w, 41, dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, rtol=1e-3 if dtype == torch.float16 else 1e-6,
                               atol=1e-3 if dtype == torch.float16 else 1e-6)
    assert torch.equal(got, triton_rows.spread_rows(idx, w, 41, dtype))
    assert torch.count_nonzero(got) == torch.count_nonzero(want)
    monkeypatch.setattr(triton_rows, "MAX_SPREAD_PAIRS", 5)    # 6 pairs: the scatter instead
    torch.testing.assert_close(dense_products.spread(idx, w, 41, dtype), got)
    assert triton_rows.spread_rows(idx[:0], w[:0], 41, dtype).shape == (0, 41)
