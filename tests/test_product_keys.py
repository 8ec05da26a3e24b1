"""Product keys: exact top-k against full scoring (ties included), the gathered-row ops against
plain indexing, PKM and PEER against loops over tokens, heads and rows (outputs and every
gradient), independent heads, exact parameter matching, and config errors."""

import math

import pytest
import torch

import sparseffn
from conftest import native_or_torch, require_native
from reference import product_key_layer_reference, product_key_reference
from sparseffn import (PEER, DenseMLPConfig, PEERConfig, PKMConfig, ProductKeyMemory,
                       compare_with_dense, config_from_dict, param_equal_dense)
from sparseffn.ops import native, product_keys, rows


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


def test_topk_lowest_index_all_equal_takes_the_first_k(rows_path):
    values, idx = product_keys.topk_lowest_index(torch.zeros(3, 50), 5)
    assert idx.tolist() == [[0, 1, 2, 3, 4]] * 3


@pytest.mark.parametrize("n_a,n_b,k", [(8, 8, 4), (16, 8, 16), (5, 7, 9), (3, 3, 9), (32, 32, 32),
                                       (1, 6, 2)])
@pytest.mark.parametrize("ties", [False, True])
def test_product_key_topk_is_exactly_the_top_k_of_all_sums(rows_path, n_a, n_b, k, ties):
    s_a, s_b = torch.randn(30, n_a), torch.randn(30, n_b)
    if ties:
        s_a, s_b = s_a.round(), s_b.round()
    values, idx = product_keys.product_key_topk(s_a, s_b, k)
    full = (s_b[:, :, None] + s_a[:, None, :]).reshape(30, -1)       # Eq. 15: index i + n_a·j
    for r in range(30):
        expect = _sorted_topk(full[r].tolist(), k)
        assert idx[r].tolist() == expect
        assert torch.equal(values[r], full[r, expect])


def test_native_and_torch_retrieval_agree_bitwise():
    require_native()
    s_a, s_b = torch.randn(500, 128).round(decimals=1), torch.randn(500, 128).round(decimals=1)
    got = product_keys.product_key_topk(s_a, s_b, 16)
    native.set_native_enabled(False)
    try:
        want = product_keys.product_key_topk(s_a, s_b, 16)
    finally:
        native.set_native_enabled(True)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_product_key_topk_rejects_impossible_k():
    with pytest.raises(ValueError, match="k must lie in"):
        product_keys.product_key_topk(torch.randn(2, 3), torch.randn(2, 3), 10)


@pytest.mark.parametrize("shared", [False, True])
def test_retrieve_matches_full_scoring_with_gradients(rows_path, shared):
    T, H, n, d = 6, 3, 9, 10
    dtype = torch.float32 if rows_path == "native" else torch.float64
    keys_a = torch.randn(H, n, d // 2, dtype=dtype, requires_grad=True)
    keys_b = torch.randn(H, n, d // 2, dtype=dtype, requires_grad=True)
    q = torch.randn(T, d if shared else H * d, dtype=dtype, requires_grad=True)
    q3 = q.view(T, -1, d)
    scores, idx = product_keys.retrieve(q[:, :d // 2] if shared else q3[..., :d // 2],
                                        q[:, d // 2:] if shared else q3[..., d // 2:],
                                        keys_a, keys_b, k=5)
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


def test_retrieve_chunks_tokens_without_changing_results(monkeypatch):
    q_a, q_b = torch.randn(50, 2, 4), torch.randn(50, 2, 4)
    keys_a, keys_b = torch.randn(2, 16, 4), torch.randn(2, 16, 4)
    whole = product_keys.retrieve(q_a, q_b, keys_a, keys_b, 8)
    monkeypatch.setattr(product_keys, "_SCORE_CHUNK_ELEMENTS", 64)   # two tokens per chunk
    chunked = product_keys.retrieve(q_a, q_b, keys_a, keys_b, 8)
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


def test_scatter_rows_is_independent_of_thread_count():
    require_native()
    idx = torch.randint(0, 50, (400, 16))
    w, src = torch.randn(400, 16), torch.randn(400, 33)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = rows.scatter_rows(idx, w, src, 50)
        torch.set_num_threads(max(2, threads))
        many = rows.scatter_rows(idx, w, src, 50)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    untouched = ~torch.isin(torch.arange(50), idx)
    assert torch.count_nonzero(one[untouched]) == 0


def test_gathered_rows_reject_bad_indices():
    with pytest.raises(IndexError, match=r"\[0, 4\)"):
        rows.gather_dot(torch.randn(2, 3), torch.randn(4, 3), torch.tensor([[0], [4]]))
    with pytest.raises(ValueError, match="width"):
        rows.gather_dot(torch.randn(2, 5), torch.randn(4, 3), torch.tensor([[0], [1]]))
    with pytest.raises(ValueError, match="must match idx"):
        rows.gather_sum(torch.tensor([[0], [1]]), torch.randn(2, 2), torch.randn(4, 3))


# --- the layers against loops ---------------------------------------------------------------

PKM_CASES = [dict(), dict(activation="relu"), dict(query="linear", key_dim=6),
             dict(query="linear", key_dim=8, query_norm="layernorm"),
             dict(query_norm="batchnorm"), dict(init="dense", heads=1)]
PEER_CASES = [dict(), dict(score="sigmoid", activation="relu"), dict(query_norm="batchnorm"),
              dict(query_norm="layernorm", key_dim=6, heads=1)]


def _params(layer):
    return [p for p in layer.parameters()]


def _check_layer_against_reference(layer, dtype, tokens=5):
    layer = layer.to(dtype)
    x = torch.randn(tokens, layer.d_model, dtype=dtype, requires_grad=True)
    y = layer(x)
    ref, ref_idx = product_key_layer_reference(layer, x)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(y, ref, **tol)
    grad = torch.randn_like(y)
    inputs = [x, *_params(layer)]
    got = torch.autograd.grad((y * grad).sum(), inputs)
    want = torch.autograd.grad((ref * grad).sum(), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, **tol)
    counts = layer.routing_stats["counts"]
    assert counts.sum() == tokens * layer.config.heads * layer.config.k
    assert torch.equal(counts, torch.bincount(ref_idx.reshape(-1), minlength=counts.shape[0]).float())


@pytest.mark.parametrize("fields", PKM_CASES)
def test_pkm_matches_loop_reference(rows_path, fields):
    dtype = torch.float32 if rows_path == "native" else torch.float64
    layer = ProductKeyMemory(PKMConfig(**{"d_model": 8, "num_subkeys": 5, "heads": 2, "k": 4,
                                          **fields}))
    _check_layer_against_reference(layer, dtype)


@pytest.mark.parametrize("fields", PEER_CASES)
def test_peer_matches_loop_reference(rows_path, fields):
    dtype = torch.float32 if rows_path == "native" else torch.float64
    layer = PEER(PEERConfig(**{"d_model": 8, "num_experts": 36, "heads": 3, "k": 4, **fields}))
    _check_layer_against_reference(layer, dtype)


@pytest.mark.parametrize("kind", ["pkm", "peer"])
def test_heads_are_independent(kind):
    """A 3-head layer equals the sum of three 1-head layers holding each head's query rows and
    sub-keys (and the shared values / experts)."""
    if kind == "pkm":
        cfg = PKMConfig(d_model=8, num_subkeys=4, heads=3, k=3, query="linear", key_dim=6)
        make = ProductKeyMemory
    else:
        cfg = PEERConfig(d_model=8, num_experts=16, heads=3, k=3, key_dim=6)
        make = PEER
    layer = make(cfg)
    x = torch.randn(10, 8)
    total = torch.zeros(10, 8)
    for h in range(3):
        single = make(cfg.replace(heads=1))
        with torch.no_grad():
            single.router.query.weight.copy_(layer.router.query.weight[h * 6:(h + 1) * 6])
            single.router.keys_a.copy_(layer.router.keys_a[h:h + 1])
            single.router.keys_b.copy_(layer.router.keys_b[h:h + 1])
            for name in ("values", "w_in", "w_out"):
                if hasattr(layer.store, name):
                    getattr(single.store, name).copy_(getattr(layer.store, name))
        total += single(x)          # the score activation is per head (softmax over its k)
    torch.testing.assert_close(layer(x), total, rtol=1e-5, atol=1e-6)


def test_layers_accept_any_leading_shape_and_reject_bad_width():
    layer = PEER(PEERConfig(d_model=8, num_experts=16, heads=2, k=2))
    assert layer(torch.randn(2, 3, 8)).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="d_model=8"):
        layer(torch.randn(3, 7))


def test_usage_accumulates_over_forwards():
    layer = ProductKeyMemory(PKMConfig(d_model=8, num_subkeys=4, heads=2, k=3))
    layer(torch.randn(5, 8))
    layer(torch.randn(7, 8))
    assert layer.usage_counts.shape == (16,)
    assert layer.usage_counts.sum() == 12 * 2 * 3
    assert layer.routing_stats["counts"].sum() == 7 * 2 * 3


def test_peer_learns_a_small_regression():
    torch.manual_seed(1)
    teacher = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16))
    layer = PEER(PEERConfig(d_model=16, num_experts=256, heads=4, k=4))
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x = torch.randn(512, 16)
    with torch.no_grad():
        target = teacher(x)
    first = None
    for _ in range(150):
        loss = torch.nn.functional.mse_loss(layer(x), target)
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.3 * first


# --- sizes and parameter matching -----------------------------------------------------------

@pytest.mark.parametrize("config", [
    PKMConfig(d_model=8, num_subkeys=5, heads=2, k=4),
    PKMConfig(d_model=8, num_subkeys=5, heads=3, k=4, query="linear", key_dim=6,
              query_norm="layernorm"),
    PKMConfig(d_model=8, num_subkeys=3, query_norm="batchnorm", k=2),
    PEERConfig(d_model=8, num_experts=49, heads=2, k=3),
    PEERConfig(d_model=8, num_experts=16, heads=2, k=3, query_norm="batchnorm", key_dim=4),
])
def test_cost_counts_every_parameter(config):
    layer = sparseffn.build_layer(config)
    assert config.cost().total_params == sum(p.numel() for p in layer.parameters())


def test_pkm_sizes_of_seed_001_appendix_a3():
    """Seed 001's small models (d_model 412, d_ff 2053, 4 heads): 46 sub-keys (2116 values)
    match the values, 62 (3844) the parameters."""
    assert PKMConfig.from_dense(412, 2053, match="values").num_subkeys == 46
    matched = PKMConfig.from_dense(412, 2053, match="params")
    assert matched.num_subkeys == 62 and matched.num_values == 3844


@pytest.mark.parametrize("d_model,d_ff,fields", [(412, 2053, {}), (64, 1000, {"heads": 1}),
                                                 (128, 5000, {"query": "linear", "key_dim": 64}),
                                                 (96, 333, {"query_norm": "batchnorm", "k": 4})])
def test_pkm_parameter_matching_is_the_largest_that_fits(d_model, d_ff, fields):
    dense = DenseMLPConfig(d_model=d_model, d_ff=d_ff).cost().total_params
    cfg = PKMConfig.from_dense(d_model, d_ff, **fields)
    assert cfg.cost().total_params <= dense
    assert cfg.replace(num_subkeys=cfg.num_subkeys + 1).cost().total_params > dense
    values = PKMConfig.from_dense(d_model, d_ff, match="values", **fields)
    assert values.num_values >= d_ff > (values.num_subkeys - 1) ** 2


@pytest.mark.parametrize("d_model,d_ff", [(256, 16384), (64, 300), (32, 4096)])
def test_peer_parameter_matching_is_the_largest_that_fits(d_model, d_ff):
    dense = DenseMLPConfig(d_model=d_model, d_ff=d_ff).cost().total_params
    cfg = PEERConfig.from_dense(d_model, d_ff, heads=2, k=2)
    bigger = cfg.replace(num_experts=(cfg.num_subkeys + 1) ** 2)
    assert cfg.cost().total_params <= dense < bigger.cost().total_params


def test_param_equal_dense_of_a_pkm():
    cfg = PKMConfig(d_model=16, num_subkeys=8, heads=2, k=4)
    dense = param_equal_dense(cfg)
    assert dense.activation == "relu"                        # softmax is no MLP activation
    assert abs(dense.cost().total_params - cfg.cost().total_params) <= cfg.d_model
    report = compare_with_dense(cfg)
    assert report.sparse.active_params < report.dense.active_params


def test_configs_round_trip_and_validate():
    for cfg in (PKMConfig(d_model=8, num_subkeys=4, k=3, query_norm="layernorm"),
                PEERConfig(d_model=8, num_experts=16, k=3, score="sigmoid")):
        assert config_from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="perfect square.*1024 and 1089"):
        PEERConfig(d_model=8, num_experts=1030)
    with pytest.raises(ValueError, match="must be even"):
        PEERConfig(d_model=8, num_experts=16, key_dim=5)
    with pytest.raises(ValueError, match=r"k must be an integer in \[1, num_values=16\]"):
        PKMConfig(d_model=8, num_subkeys=4, k=17)
    with pytest.raises(ValueError, match="key_dim must be d_model"):
        PKMConfig(d_model=8, num_subkeys=8, key_dim=4)
    with pytest.raises(ValueError, match="activation"):
        PKMConfig(d_model=8, num_subkeys=8, activation="gelu")
    with pytest.raises(ValueError, match="query_norm"):
        PEERConfig(d_model=8, num_experts=16, query_norm="rmsnorm")
    with pytest.raises(ValueError, match="match must be"):
        PKMConfig.from_dense(8, 64, match="flops")


def test_peer_cost_counts_heads_times_k_experts():
    cfg = PEERConfig(d_model=256, num_experts=1024 ** 2, heads=8, k=16)
    cost = cfg.cost()
    assert cost.expert_flops == 2 * 8 * 16 * 2 * 256
    assert cost.total_params == 2 * 1024 ** 2 * 256 + 256 * 8 * 256 + 8 * 1024 * 256
    assert math.isclose(cost.active_params / cost.total_params, 0.0049, abs_tol=0.0005)


@pytest.mark.parametrize("kind", ["pkm", "peer"])
def test_sparse_grad_equals_dense_grad_and_trains_with_sparse_adam(rows_path, kind):
    if kind == "pkm":
        cfg = PKMConfig(d_model=8, num_subkeys=6, heads=2, k=3)
        make = ProductKeyMemory
    else:
        cfg = PEERConfig(d_model=8, num_experts=36, heads=2, k=3)
        make = PEER
    dense = make(cfg)
    sparse = make(cfg.replace(sparse_grad=True))
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(9, 8)
    dense(x).square().sum().backward()
    sparse(x).square().sum().backward()
    tables = sparseffn.sparse_grad_parameters(sparse)
    assert len(tables) == (1 if kind == "pkm" else 2)
    assert sparseffn.sparse_grad_parameters(dense) == []
    for (name, p), q in zip(sparse.named_parameters(), dense.parameters()):
        if any(p is t for t in tables):
            assert p.grad.is_sparse
            torch.testing.assert_close(p.grad.to_dense(), q.grad)
        else:
            torch.testing.assert_close(p.grad, q.grad)
    before = [t.detach().clone() for t in tables]
    torch.optim.SparseAdam(tables, lr=0.1).step()
    read = sparse.routing_stats["counts"] > 0
    for b, t in zip(before, tables):
        assert not torch.equal(b[read], t[read]) and torch.equal(b[~read], t[~read])
