"""expert_mlp (both layers of a mixture of MLP experts) against the per-token Eq. 25 loop."""

import importlib

import pytest
import torch
from torch.nn import functional as F

from tests.ops.reference import expert_mlp_reference
from sparseffn.ops import DispatchPlan, expert_mlp, native

expert_mlp_module = importlib.import_module("sparseffn.ops.expert_mlp")


def _problem(T=23, k=3, E=5, d=12, G=7, d_out=10):
    indices = torch.randint(0, E, (T, k))
    indices[:, 0] = 0   # expert 4 may be empty; expert 0 is never
    x = torch.randn(T, d, requires_grad=True)
    w1 = torch.randn(E, G, d, requires_grad=True)
    w2 = torch.randn(E, G, d_out, requires_grad=True)
    gates = torch.rand(T, k, requires_grad=True)
    return indices, [x, w1, w2, gates]


@pytest.mark.parametrize("with_dropped", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_expert_mlp_matches_reference(matmul_path, activation, with_dropped):
    """Against Eq. 25's loop; dropped pairs (capacity) are skipped, so they count as gate 0."""
    indices, (x, w1, w2, gates) = _problem()
    dispatched = torch.rand(indices.shape) < 0.5 if with_dropped else None
    act = F.relu if activation == "relu" else F.gelu
    plan = DispatchPlan.build(indices, 5, dispatched=dispatched)
    y = expert_mlp(x, plan, w1, w2, gates, activation=activation)
    ref_gates = gates * dispatched if with_dropped else gates
    want = expert_mlp_reference(x, indices, ref_gates, w1.transpose(1, 2), w2, act)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    grad = torch.randn_like(y)
    got_grads = torch.autograd.grad(y, [x, w1, w2, gates], grad)
    want_grads = torch.autograd.grad(want, [x, w1, w2, gates], grad)
    for got, want_grad in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want_grad, atol=1e-3, rtol=1e-3)
    if with_dropped:
        assert torch.all(got_grads[3][~dispatched] == 0)


def test_fused_relu_path_is_taken_for_float32_cpu(monkeypatch):
    if not native.available():
        pytest.skip(f"fused kernels unavailable: {native.unavailable_reason()}")
    calls = []
    original = native.cvmm_rows
    monkeypatch.setattr(native, "cvmm_rows",
                        lambda *a, **kw: calls.append(kw.get("relu", False)) or original(*a, **kw))
    indices, (x, w1, w2, gates) = _problem()
    expert_mlp(x, DispatchPlan.build(indices, 5), w1, w2, gates).sum().backward()
    assert calls[0] is True and len(calls) == 4   # relu fused into the first layer


@pytest.mark.parametrize("dtype, gate_dtype", [(torch.bfloat16, torch.float32),
                                               (torch.float64, torch.float64)])
@pytest.mark.parametrize("activation", ["relu", "gelu"])   # the fused path and cvmm's
def test_the_weight_gradient_reads_bf16_gates_in_float32_with_their_own_values(
        monkeypatch, activation, dtype, gate_dtype):
    """The backward hands the expert weight gradient bf16 gates in float32 (a GPU kernel
    pipelines no 2-byte load), holding exactly their values; float64 gates stay float64."""
    from sparseffn.ops import kernels
    scales = []
    original = kernels.expert_weight_grad

    def recording(a_src, b_src, counts, a_idx, b_idx, scale, *rows_and_dtype):
        scales.append(scale)
        return original(a_src, b_src, counts, a_idx, b_idx, scale, *rows_and_dtype)
    monkeypatch.setattr(kernels, "expert_weight_grad", recording)
    indices, tensors = _problem()
    x, w1, w2, gates = (t.detach().to(dtype).requires_grad_() for t in tensors)
    plan = DispatchPlan.build(indices, 5)
    expert_mlp(x, plan, w1, w2, gates, activation=activation).float().sum().backward()
    gated = [s for s in scales if s is not None]
    assert len(scales) == 2 and len(gated) == 1   # W2's gradient is gate-scaled, W1's not
    assert gated[0].dtype == gate_dtype
    assert torch.equal(gated[0], gates.detach().reshape(-1)[plan.order].to(gate_dtype))


def test_hidden_dropout_is_applied_to_the_hidden_units():
    indices, (x, w1, w2, gates) = _problem()
    plan = DispatchPlan.build(indices, 5)
    dropped = expert_mlp(x, plan, w1, w2, gates, hidden_dropout=lambda h: torch.zeros_like(h))
    assert torch.all(dropped == 0)
    kept = expert_mlp(x, plan, w1, w2, gates, hidden_dropout=lambda h: h)
    torch.testing.assert_close(kept, expert_mlp(x, plan, w1, w2, gates))



@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_a_nan_token_stays_in_its_own_rows_and_dropped_nan_pairs_get_zero_gate_gradient(
        matmul_path, activation):
    """NaN in one token's input: every other token's output and input gradient are what the
    loop gives; the NaN reaches only that token's output and the weight gradients of the
    experts it was dispatched to; a NaN token whose pairs were all dropped contributes nothing."""
    indices, (x, w1, w2, gates) = _problem(T=17)
    dispatched = torch.ones(indices.shape, dtype=torch.bool)
    dispatched[5] = False                                 # token 5: every pair dropped
    with torch.no_grad():
        x[3, 2] = float("nan")                           # token 3: dispatched, NaN
        x[5, 0] = float("nan")
    act = F.relu if activation == "relu" else F.gelu
    plan = DispatchPlan.build(indices, 5, dispatched=dispatched)
    y = expert_mlp(x, plan, w1, w2, gates, activation=activation)
    want = expert_mlp_reference(x, indices, gates * dispatched, w1.transpose(1, 2), w2, act)
    clean = torch.ones(17, dtype=torch.bool)
    clean[3] = False
    keep = clean.clone()
    keep[5] = False                  # the loop multiplies token 5's NaN output by its gate 0
    torch.testing.assert_close(y[keep], want[keep], atol=1e-4, rtol=1e-4)
    assert torch.isnan(y[3]).all() and torch.equal(y[5], torch.zeros_like(y[5]))
    grad = torch.randn_like(y)
    grad_x, grad_g = torch.autograd.grad(y, [x, gates], grad)
    assert torch.all(grad_g[5] == 0) and torch.isfinite(grad_g[clean]).all()
    want_x = torch.autograd.grad(want[keep], x, grad[keep])[0]
    torch.testing.assert_close(grad_x[keep], want_x[keep], atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("T", [23, 1, 0])
@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_gated_experts_match_the_reference_with_empty_experts_and_batches(matmul_path, activation,
                                                                          T):
    """GLU experts (act(x Wgᵀ) ⊙ x W1ᵀ) W2 against the loop: outputs and all five gradients, at
    odd sizes, with pairs dropped at capacity, experts that get no token and an empty batch."""
    indices, (x, w1, w2, gates) = _problem(T=T, E=6)          # expert 5 never chosen
    indices = indices.clamp(max=4)
    w_gate = torch.randn(6, 7, 12, requires_grad=True)
    dispatched = torch.rand(indices.shape) < 0.7
    plan = DispatchPlan.build(indices, 6, dispatched=dispatched)
    y = expert_mlp(x, plan, w1, w2, gates, activation=activation, w_gate=w_gate)
    act = {"silu": F.silu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}[activation]
    want = expert_mlp_reference(x, indices, gates * dispatched, w1.transpose(1, 2), w2, act,
                                w_gate.transpose(1, 2))
    assert y.shape == (T, 10)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    grad = torch.randn_like(y)
    inputs = [x, w1, w2, gates, w_gate]
    got_grads = torch.autograd.grad(y, inputs, grad, allow_unused=True)
    if T == 0:   # no token: every gradient is zero (or absent), none is garbage
        assert all(g is None or (g.shape == p.shape and torch.all(g == 0))
                   for g, p in zip(got_grads, inputs))
        return
    want_grads = torch.autograd.grad(want, inputs, grad)
    for name, got, want_grad in zip(("x", "w1", "w2", "gates", "w_gate"), got_grads, want_grads):
        torch.testing.assert_close(got, want_grad, atol=1e-3, rtol=1e-3, msg=name)
    assert torch.all(got_grads[4][5] == 0) and torch.all(got_grads[3][~dispatched] == 0)


def test_a_nan_token_in_gated_experts_stays_in_its_own_rows(matmul_path):
    indices, (x, w1, w2, gates) = _problem(T=11)
    w_gate = torch.randn(5, 7, 12)
    with torch.no_grad():
        x[4, 1] = float("nan")
    y = expert_mlp(x, DispatchPlan.build(indices, 5), w1, w2, gates, activation="silu",
                   w_gate=w_gate)
    want = expert_mlp_reference(x, indices, gates, w1.transpose(1, 2), w2, F.silu,
                                w_gate.transpose(1, 2))
    clean = torch.arange(11) != 4
    assert torch.isnan(y[4]).all()
    torch.testing.assert_close(y[clean], want[clean], atol=1e-4, rtol=1e-4)


def _bias_case(S_per_expert=(5, 0, 7, 3), G=6, dropped=4):
    """Expert-sorted rows [S, G] of 4 experts (expert 1 empty) and ``dropped`` rows past
    them (pairs dropped at capacity), each with its expert id; a bias [4, G]."""
    counts = torch.tensor(S_per_expert)
    expert_of_row = torch.cat([torch.repeat_interleave(torch.arange(4), counts),
                               torch.randint(0, 4, (dropped,))])
    hidden = torch.randn(expert_of_row.shape[0], G, requires_grad=True)
    bias = torch.randn(4, G, requires_grad=True)
    return hidden, bias, expert_of_row, counts


def test_an_expert_bias_gradient_is_each_experts_sum_of_its_rows(matmul_path):
    """``add_expert_bias`` against ``index_select``: the same output and hidden gradient; the
    bias's gradient sums each expert's rows (the dropped rows past them add nothing, an
    empty expert gets an exact zero, a NaN row stays in its expert's gradient); no
    ``index_add_`` (atomics on CUDA) in the backward."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from sparseffn.ops.expert_mlp import add_expert_bias

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.names = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))
    hidden, bias, expert_of_row, counts = _bias_case()
    y = add_expert_bias(hidden, bias, expert_of_row, counts)
    torch.testing.assert_close(y, hidden + bias[expert_of_row])
    grad = torch.randn_like(y)
    grad[3, 2] = float("nan")                                   # a row of expert 0
    ops = Ops()
    with ops:
        grad_hidden, grad_bias = torch.autograd.grad(y, [hidden, bias], grad)
    assert "index_add_" not in ops.names and "index_add" not in ops.names
    assert torch.equal(grad_hidden.isnan(), grad.isnan())
    torch.testing.assert_close(grad_hidden.nan_to_num(), grad.nan_to_num())
    live = int(counts.sum())
    want = torch.zeros_like(bias).index_add_(0, expert_of_row[:live], grad[:live])
    assert bool(grad_bias[0, 2].isnan()) and int(grad_bias.isnan().sum()) == 1
    torch.testing.assert_close(grad_bias.nan_to_num(), want.nan_to_num(), atol=1e-5, rtol=1e-5)
    assert torch.equal(grad_bias[1], torch.zeros(6))            # expert 1 has no rows
    # no rows at all
    hidden, bias, expert_of_row, counts = _bias_case((0, 0, 0, 0), dropped=0)
    y = add_expert_bias(hidden, bias, expert_of_row, counts)
    assert y.shape == (0, 6)
    assert torch.equal(torch.autograd.grad(y.sum(), bias)[0], torch.zeros(4, 6))


def test_biased_experts_sum_the_bias_gradient_under_bf16_autocast():
    """Under autocast the hidden rows are bf16 and the float32 bias gets a float32 gradient,
    each expert's sum rounded once (to bf16, as a dense layer's bias gradient is there)."""
    from sparseffn.ops.expert_mlp import add_expert_bias
    hidden, bias, expert_of_row, counts = _bias_case((40, 0, 70, 30), G=16, dropped=0)
    hidden16 = hidden.detach().to(torch.bfloat16).requires_grad_()
    y = add_expert_bias(hidden16, bias, expert_of_row, counts)
    assert y.dtype == torch.bfloat16
    grad = torch.randn_like(y)
    (grad_bias,) = torch.autograd.grad(y, [bias], grad)
    assert grad_bias.dtype == torch.float32
    want = torch.zeros_like(bias).index_add_(0, expert_of_row, grad.float())
    torch.testing.assert_close(grad_bias, want, atol=0, rtol=2 ** -8)


@pytest.mark.parametrize("T", [23, 0])
@pytest.mark.parametrize("biases", ["b1 and b2", "b1", "b2"])
def test_biased_relu_experts_run_fused_and_match_the_loop(matmul_path, monkeypatch, biases, T):
    """ReLU experts with biases (FFF leaves) take the fused path, their biases as weights of
    a constant input: outputs and every gradient are the loop's, at odd sizes, with pairs
    dropped at capacity, an expert that gets no token and an empty batch; the unfused
    path's bias rows and ``b2``'s gather are not used."""
    fused = []
    original_apply = expert_mlp_module._ReluExpertMLP.apply
    monkeypatch.setattr(expert_mlp_module._ReluExpertMLP, "apply",
                        lambda *a: fused.append(a[1].shape) or original_apply(*a))
    monkeypatch.setattr(expert_mlp_module, "gather_sum", lambda *a, **kw: 1 / 0)
    monkeypatch.setattr(expert_mlp_module, "add_expert_bias", lambda *a, **kw: 1 / 0)
    indices, (x, w1, w2, gates) = _problem(T=T, E=6)          # expert 5 never chosen
    indices = indices.clamp(max=4)
    b1 = torch.randn(6, 7, requires_grad=True) if "b1" in biases else None
    b2 = torch.randn(6, 10, requires_grad=True) if "b2" in biases else None
    dispatched = torch.rand(indices.shape) < 0.7
    plan = DispatchPlan.build(indices, 6, dispatched=dispatched)
    y = expert_mlp(x, plan, w1, w2, gates * dispatched, b1=b1, b2=b2,   # as Routing gives them
                   indices=indices)
    assert fused == [(6, 7 + (b2 is not None), 12 + 1)]   # one more unit for b2, a ones column
    want = expert_mlp_reference(x, indices, gates * dispatched, w1.transpose(1, 2), w2, F.relu,
                                b1=b1, b2=b2)
    assert y.shape == (T, 10)
    torch.testing.assert_close(y, want, atol=1e-4, rtol=1e-4)
    inputs = [t for t in (x, w1, w2, gates, b1, b2) if t is not None]
    grad = torch.randn_like(y)
    got_grads = torch.autograd.grad(y, inputs, grad, allow_unused=True)
    if T == 0:
        assert all(g is None or (g.shape == p.shape and torch.all(g == 0))
                   for g, p in zip(got_grads, inputs))
        return
    want_grads = torch.autograd.grad(want, inputs, grad)
    for got, want_grad in zip(got_grads, want_grads):
        assert got.shape == want_grad.shape
        torch.testing.assert_close(got, want_grad, atol=1e-3, rtol=1e-3)
    for bias_grad in got_grads[4:]:           # the expert no token chose: zero bias gradient
        assert torch.all(bias_grad[5] == 0)
    assert torch.all(got_grads[3][~dispatched] == 0)


def test_a_nan_token_of_biased_relu_experts_stays_in_its_own_rows(matmul_path):
    """The constant input and the b2 unit multiply a token's NaN by zero weights: that token's
    output is NaN, every other token's is the loop's, and so are the other tokens' input and
    gate gradients."""
    indices, (x, w1, w2, gates) = _problem(T=13)
    b1, b2 = torch.randn(5, 7, requires_grad=True), torch.randn(5, 10, requires_grad=True)
    with torch.no_grad():
        x[6, 2] = float("nan")
    y = expert_mlp(x, DispatchPlan.build(indices, 5), w1, w2, gates, b1=b1, b2=b2,
                   indices=indices)
    want = expert_mlp_reference(x, indices, gates, w1.transpose(1, 2), w2, F.relu, b1=b1, b2=b2)
    clean = torch.arange(13) != 6
    assert torch.isnan(y[6]).all()
    torch.testing.assert_close(y[clean], want[clean], atol=1e-4, rtol=1e-4)
    grad = torch.randn_like(y)
    grad_x, grad_g = torch.autograd.grad(y[clean], [x, gates], grad[clean])
    want_x, want_g = torch.autograd.grad(want[clean], [x, gates], grad[clean])
    torch.testing.assert_close(grad_x, want_x, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(grad_g[clean], want_g[clean], atol=1e-3, rtol=1e-3)


def test_biased_relu_experts_under_bf16_autocast_round_their_biases_once(matmul_path):
    """Under CPU bf16 autocast the fused path's biases enter the products in bf16 (as
    ``nn.Linear``'s bias does) with float32 sums: the output is bf16 and within bf16 rounding
    of the float32 loop, and the float32 biases get float32 gradients within it too."""
    indices, (x, w1, w2, gates) = _problem(T=31)
    b1, b2 = torch.randn(5, 7, requires_grad=True), torch.randn(5, 10, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = expert_mlp(x, DispatchPlan.build(indices, 5), w1, w2, gates, b1=b1, b2=b2,
                       indices=indices)
    assert y.dtype == torch.bfloat16
    want = expert_mlp_reference(x, indices, gates, w1.transpose(1, 2), w2, F.relu, b1=b1, b2=b2)
    scale = float(want.abs().max())
    torch.testing.assert_close(y.float(), want, atol=3e-2 * scale, rtol=3e-2)
    grad = torch.randn_like(want)
    got = torch.autograd.grad(y.float(), [b1, b2], grad)
    ref = torch.autograd.grad(want, [b1, b2], grad)
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, atol=3e-2 * float(r.abs().max()), rtol=3e-2)
