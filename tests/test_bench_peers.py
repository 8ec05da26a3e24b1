"""The peers `bench fig2 --peers` times beside the σ-MoE, checked against slow references
where they run on CPU (Liger-Kernel's Triton fused MoE in Triton's interpreter)."""

import os

import pytest
import torch
import torch.nn.functional as F

# One kernel configuration each: the autotuner would time every one in the interpreter.
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

from sparseffn.bench import fig2  # noqa: E402


def _swiglu_moe_loop(x, router, gate_up, down, k):
    """A SwiGLU mixture of experts token by token: the k experts of the highest sigmoid
    router scores, each output ``down_e (silu(G_e x) * (U_e x))`` weighted by its score."""
    scores = torch.sigmoid(x @ router.t())
    gates, experts = scores.topk(k, dim=-1)
    intermediate = down.shape[2]
    rows = []
    for t in range(x.shape[0]):
        y = torch.zeros(x.shape[1])
        for j in range(k):
            e = int(experts[t, j])
            pre = gate_up[e] @ x[t]
            y = y + gates[t, j] * (down[e] @ (F.silu(pre[:intermediate]) * pre[intermediate:]))
        rows.append(y)
    return torch.stack(rows)


def test_liger_peer_is_a_swiglu_moe_behind_the_sigmoid_top_k_router():
    """The adapter hands Liger's kernels the layouts they expect (gate rows first in
    gate_up, int32 experts): output and every gradient equal the loop's, at odd sizes."""
    liger = pytest.importorskip("liger_kernel.ops.fused_moe",
                                reason="liger-kernel is an optional peer (the test extra)")
    torch.manual_seed(0)
    module = fig2._LigerMoE(liger.LigerFusedMoEFunction.apply, d_model=24, num_experts=5,
                            intermediate=10)
    x = torch.randn(37, 24)
    params = [module.router.weight, module.gate_up, module.down]
    copies = [p.detach().clone().requires_grad_() for p in params]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out = module(x1)
    want = _swiglu_moe_loop(x2, *copies, k=fig2.K)
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    for got, ref in [(x1.grad, x2.grad)] + [(p.grad, c.grad) for p, c in zip(params, copies)]:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)


def test_liger_peer_is_built_where_it_imports_with_the_sigma_moe_parameters(tmp_path):
    pytest.importorskip("liger_kernel.ops.fused_moe",
                        reason="liger-kernel is an optional peer (the test extra)")
    builders = fig2.peer_builders(str(tmp_path), torch.float16)
    module = builders["liger_fused_moe"](256, 8)
    assert module.gate_up.dtype == torch.float16
    assert module.gate_up.shape == (8, 2 * fig2.LIGER_INTERMEDIATE, 256)
    assert module.down.shape == (8, 256, fig2.LIGER_INTERMEDIATE)
    experts = module.gate_up.numel() + module.down.numel()
    assert abs(experts / (8 * 2 * fig2.EXPERT_SIZE * 256) - 1) < 0.05, \
        "about the σ-MoE experts' parameters"
