"""A few tokens' MLP experts without a dispatch plan (``sparseffn::expert_mlp_pairs``: the C
kernel of pairs_cpu.c and its PyTorch twin) against the per-token loop of Eq. 25, and where
the expert store takes it."""

import importlib

import pytest
import torch

from sparseffn.activations import activation_fn
from sparseffn.ops import kernels, native
from sparseffn.ops.expert_mlp import FEW_PAIRS_MACS, expert_mlp_few, expert_mlp_few_ok
from sparseffn.stores import MLPExperts
from sparseffn.routing import Routing
from tests.conftest import require_native, torch_threads
from tests.ops.reference import expert_mlp_reference

expert_mlp_module = importlib.import_module("sparseffn.ops.expert_mlp")

IMPLEMENTATIONS = ["c", "torch"]


def _run(impl, *args, **kwargs):
    if impl == "c":
        require_native()
        return native.mlp_pairs(*args, **kwargs)
    return kernels.expert_mlp_pairs_torch(*args, **kwargs)


def _problem(T=5, k=3, E=7, m=13, G=70, n=11, gated=False, biases=False, seed=0):
    """Odd sizes; G = 70 is a full block of 64 hidden units and a partial one. Indices may
    repeat within a token; expert E - 1 is never used."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.randint(0, E - 1, (T, k), generator=gen)
    tensors = dict(
        x=torch.randn(T, m, generator=gen), gates=torch.rand(T, k, generator=gen),
        w1=torch.randn(E, G, m, generator=gen) / m ** 0.5,
        w2=torch.randn(E, G, n, generator=gen) / G ** 0.5,
        w_gate=torch.randn(E, G, m, generator=gen) / m ** 0.5 if gated else None,
        b1=torch.randn(E, G, generator=gen) if biases else None,
        b2=torch.randn(E, n, generator=gen) if biases else None)
    return indices, tensors


def _reference(indices, t, activation, keep=None):
    """The loop of Eq. 25 in float64; a pair not kept counts as gate 0."""
    f64 = {name: None if v is None else v.double() for name, v in t.items()}
    gates = f64["gates"] if keep is None else f64["gates"] * keep
    return expert_mlp_reference(
        f64["x"], indices, gates, f64["w1"].transpose(1, 2), f64["w2"], activation_fn(activation),
        w_gate=None if f64["w_gate"] is None else f64["w_gate"].transpose(1, 2),
        b1=f64["b1"], b2=f64["b2"]).float()


def _call(impl, indices, t, activation, keep=None):
    return _run(impl, t["x"], indices, t["gates"], t["w1"], t["w2"], activation, b1=t["b1"],
                b2=t["b2"], w_gate=t["w_gate"], keep=keep)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "quick_gelu"])
@pytest.mark.parametrize("gated,biases", [(False, False), (False, True), (True, True)])
def test_matches_the_loop(impl, activation, gated, biases):
    indices, t = _problem(gated=gated, biases=biases)
    got = _call(impl, indices, t, activation)
    assert got.shape == (5, 11) and got.dtype == torch.float32
    torch.testing.assert_close(got, _reference(indices, t, activation), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_pairs_not_kept_add_exactly_zero_even_from_nan(impl):
    indices, t = _problem(biases=True)
    keep = torch.rand(indices.shape, generator=torch.Generator().manual_seed(1)) < 0.5
    keep[0] = False                            # token 0: nothing computed
    t["x"][0] = float("nan")
    got = _call(impl, indices, t, "relu", keep=keep)
    assert torch.equal(got[0], torch.zeros(11))
    torch.testing.assert_close(got[1:], _reference(indices, t, "relu", keep)[1:],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_nan_stays_in_its_token_and_unused_experts_are_never_read(impl):
    indices, t = _problem()
    t["x"][2, 4] = float("nan")
    t["w1"][-1] = float("nan")                  # expert E - 1: no pair uses it
    t["w2"][-1] = float("nan")
    got = _call(impl, indices, t, "relu")
    assert torch.isnan(got[2]).all()
    others = [0, 1, 3, 4]
    assert torch.isfinite(got[others]).all()
    torch.testing.assert_close(got[others], _reference(indices, t, "relu")[others],
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_an_empty_batch_gives_an_empty_output(impl):
    indices, t = _problem(T=0)
    got = _call(impl, indices, t, "relu")
    assert got.shape == (0, 11)


def test_the_c_kernel_gives_the_same_bits_on_any_thread_count():
    require_native()
    indices, t = _problem(T=9, k=4, G=200, biases=True)
    with torch_threads(1):
        one = _call("c", indices, t, "gelu")
    with torch_threads(2):
        two = _call("c", indices, t, "gelu")
    assert torch.equal(one, two)


def test_weights_are_read_in_place_at_any_row_stride():
    """A weight whose rows are a slice of wider rows (row stride > width) is read in place."""
    require_native()
    indices, t = _problem(biases=True)
    wide = {name: torch.cat([v, torch.full_like(v, float("nan"))], dim=-1)
            for name, v in t.items() if name in ("w1", "w2", "b1", "b2")}
    sliced = dict(t, **{name: v[..., :v.shape[-1] // 2] for name, v in wide.items()})
    assert sliced["w1"].stride(1) == 2 * 13
    torch.testing.assert_close(_call("c", indices, sliced, "relu"),
                               _call("c", indices, t, "relu"), atol=0, rtol=0)


def test_the_operator_checks_its_indices_and_its_fake():
    indices, t = _problem()
    with pytest.raises(ValueError, match=r"expert indices must lie in \[0, 7\)"):
        expert_mlp_few(t["x"], indices + 3, t["gates"], t["w1"], t["w2"])
    torch.library.opcheck(torch.ops.sparseffn.expert_mlp_pairs.default,
                          (t["x"], indices, t["gates"], t["w1"], t["w2"], "relu", None, None,
                           None, None))


def _store_and_routing(T, k=2, E=8, d=16, G=24, bias=False, gated=False, seed=0):
    torch.manual_seed(seed)
    store = MLPExperts(E, d, G, bias=bias, gated=gated, init="fff")
    scores = torch.rand(T, E)
    weights, indices = scores.topk(k, dim=-1)
    return store, torch.randn(T, d), Routing(indices, weights)


@pytest.mark.parametrize("bias,gated", [(False, False), (True, False), (False, True)])
def test_the_store_takes_it_without_gradients_and_agrees_with_the_plan(monkeypatch, bias, gated):
    require_native()
    store, x, routing = _store_and_routing(T=3, bias=bias, gated=gated)
    with_grad = store(x, routing)                     # gradients wanted: the plan's path
    assert routing.built_plan(8) is not None
    calls = []
    original = native.mlp_pairs
    monkeypatch.setattr(native, "mlp_pairs", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    fresh = Routing(routing.indices, routing.weights)
    with torch.no_grad():
        without = store(x, fresh)
    assert calls and fresh.built_plan(8) is None       # no plan built
    torch.testing.assert_close(without, with_grad.detach(), atol=1e-6, rtol=1e-5)


def test_the_store_keeps_the_plan_where_the_few_path_does_not_pay(monkeypatch):
    require_native()
    monkeypatch.setattr(native, "mlp_pairs", lambda *a, **kw: pytest.fail("few path taken"))
    store, x, routing = _store_and_routing(T=3)
    macs = routing.indices.numel() * 24 * (16 + 16)
    assert macs <= FEW_PAIRS_MACS
    monkeypatch.setattr(expert_mlp_module, "FEW_PAIRS_MACS", macs - 1)   # too many pairs
    with torch.no_grad():
        store(x, routing)
    monkeypatch.undo()
    monkeypatch.setattr(native, "mlp_pairs", lambda *a, **kw: pytest.fail("few path taken"))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):       # bf16 weights
        store.to(torch.bfloat16)(x, Routing(routing.indices, routing.weights))
    store.float()
    store.train()
    store.hidden_dropout.p = 0.5                                             # dropout
    with torch.no_grad():
        store(x, Routing(routing.indices, routing.weights))


def test_under_cpu_autocast_the_few_path_runs_in_float32_on_the_weights(monkeypatch):
    """Decoding under CPU bf16 autocast reads the float32 weights in place (no cast of every
    expert's weights): the result is the float32 one rounded once to bf16, and within bf16
    precision of the plan's path, whose products run in bf16."""
    require_native()
    store, x, routing = _store_and_routing(T=3, bias=True)
    seen = []
    original = native.mlp_pairs
    monkeypatch.setattr(native, "mlp_pairs",
                        lambda x, *a, **kw: seen.append(x.dtype) or original(x, *a, **kw))
    with torch.no_grad():
        want = store(x, Routing(routing.indices, routing.weights))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = store(x.bfloat16(), Routing(routing.indices, routing.weights))
    assert seen == [torch.float32, torch.float32] and got.dtype == torch.bfloat16
    with torch.no_grad():
        exact = store(x.bfloat16().float(), Routing(routing.indices, routing.weights))
    assert torch.equal(got, exact.to(torch.bfloat16))
    with torch.autocast("cpu", dtype=torch.bfloat16):     # gradients wanted: the plan, in bf16
        planned = store(x, Routing(routing.indices, routing.weights))
    assert planned.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), planned.detach().float(), rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_the_choice_follows_the_gradient_and_the_tensors():
    store, x, routing = _store_and_routing(T=3)
    args = (x, routing.indices, routing.weights, store.w1, store.w2)
    with torch.no_grad():
        assert expert_mlp_few_ok(*args) == native.available()
        assert not expert_mlp_few_ok(x, routing.indices, routing.weights, store.w1.double(),
                                     store.w2.double())
        assert not expert_mlp_few_ok(*args, activation="tanh")
    assert not expert_mlp_few_ok(*args)                 # the weights require grad
    frozen = [t.detach() for t in args]
    assert expert_mlp_few_ok(*frozen) == native.available()


def test_compiles_in_one_graph_at_inference():
    require_native()
    store, x, routing = _store_and_routing(T=2, bias=True)
    compiled = torch.compile(lambda x, i, w: store(x, Routing(i, w)), fullgraph=True,
                             backend="aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        want = store(x, Routing(routing.indices, routing.weights))
        got = compiled(x, routing.indices, routing.weights)
    torch._dynamo.reset()
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
