"""PKM and PEER against loops over tokens, heads and rows (outputs and every gradient),
independent heads, exact parameter matching, sparse gradients and config errors."""

import math
import warnings

import pytest
import torch

import sparseffn
from sparseffn.ops.rows import row_sparse
from tests.conftest import native_or_torch
from tests.ops.reference import product_key_layer_reference
from sparseffn import (PEER, DenseMLPConfig, PEERConfig, PKMConfig, ProductKeyMemory,
                       compare_with_dense, config_from_dict, param_equal_dense)


@pytest.fixture(params=["native", "torch"])
def rows_path(request):
    """Run through the C kernels of rows_cpu.c and through their PyTorch fallback."""
    yield from native_or_torch(request)



PKM_CASES = [dict(), dict(score="relu"), dict(query="linear", key_dim=6),
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


@pytest.mark.slow
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


def test_pkm_sizes_of_csordas_et_al_appendix_a3():
    """Csordás et al. 2023's small models (d_model 412, d_ff 2053, 4 heads): 46 sub-keys (2116 values)
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
    with pytest.raises(ValueError, match="score"):
        PKMConfig(d_model=8, num_subkeys=8, score="gelu")
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


@pytest.mark.slow
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
    assert sparseffn.dense_grad_parameters(dense) == list(dense.parameters())
    assert {id(p) for p in sparseffn.dense_grad_parameters(sparse)} == \
        {id(p) for p in sparse.parameters()} - {id(t) for t in tables}
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


@pytest.mark.parametrize("kind", ["pkm", "peer"])
def test_a_backward_with_sparse_gradients_warns_nothing(kind):
    """PyTorch 2.11 warns that sparse invariant checks are "implicitly disabled" even where
    they are disabled explicitly (pytorch/pytorch#178274); its warning is once per process,
    so warn_always makes every step show it."""
    layer = (ProductKeyMemory(PKMConfig(d_model=8, num_subkeys=6, heads=2, k=3, sparse_grad=True))
             if kind == "pkm" else PEER(d_model=8, num_experts=36, heads=2, k=3, sparse_grad=True))
    was = torch.is_warn_always_enabled()
    torch.set_warn_always(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            layer(torch.randn(5, 8)).sum().backward()
    finally:
        torch.set_warn_always(was)
    assert all(t.grad.is_sparse for t in sparseffn.sparse_grad_parameters(layer))


def test_sparse_gradients_leave_the_programs_once_per_place_warnings_shown_once():
    """Filtering PyTorch's warning resets Python's record of the warnings already shown, so it
    is done only while PyTorch can still warn: not at every step."""
    layer = PEER(d_model=8, num_experts=36, heads=2, k=3, sparse_grad=True)
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")
        for _ in range(3):
            layer(torch.randn(5, 8)).sum().backward()
            _warn_as_a_training_loop_might()
    assert [str(w.message) for w in shown] == ["a warning of the training loop"]


def _warn_as_a_training_loop_might():
    warnings.warn("a warning of the training loop", UserWarning)


def test_row_sparse_puts_each_value_row_at_its_row_and_may_be_empty():
    values = torch.randn(3, 2, 4)
    got = row_sparse(torch.tensor([1, 4, 5]), values, 7)
    assert got.is_sparse and got.is_coalesced() and got.shape == (7, 2, 4)
    want = torch.zeros(7, 2, 4)
    want[[1, 4, 5]] = values
    assert torch.equal(got.to_dense(), want)
    empty = row_sparse(torch.zeros(0, dtype=torch.long), torch.zeros(0, 4), 7)
    assert empty.shape == (7, 4) and empty._nnz() == 0 and torch.equal(empty.to_dense(),
                                                                        torch.zeros(7, 4))
