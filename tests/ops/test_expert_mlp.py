"""expert_mlp (both layers of a mixture of MLP experts) against the per-token Eq. 25 loop."""

import pytest
import torch
from torch.nn import functional as F

from tests.ops.reference import expert_mlp_reference
from sparseffn.ops import DispatchPlan, expert_mlp, native


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


def test_hidden_dropout_is_applied_to_the_hidden_units():
    indices, (x, w1, w2, gates) = _problem()
    plan = DispatchPlan.build(indices, 5)
    dropped = expert_mlp(x, plan, w1, w2, gates, hidden_dropout=lambda h: torch.zeros_like(h))
    assert torch.all(dropped == 0)
    kept = expert_mlp(x, plan, w1, w2, gates, hidden_dropout=lambda h: h)
    torch.testing.assert_close(kept, expert_mlp(x, plan, w1, w2, gates))

