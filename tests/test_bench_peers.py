"""The peers `bench fig2 --peers` times beside the σ-MoE, checked against slow references
where they run on CPU (``torch._grouped_mm`` used plainly; Liger-Kernel's Triton fused MoE in
Triton's interpreter)."""

import os

import pytest
import torch
import torch.nn.functional as F

# One kernel configuration each: the autotuner would time every one in the interpreter.
os.environ.setdefault("LIGER_FUSED_MOE_AUTOTUNE", "0")

from sparseffn import SigmaMoEConfig  # noqa: E402
from sparseffn.bench import fig2  # noqa: E402
from sparseffn.bench.peers import GroupedMMMoE, grouped_mm_missing_on  # noqa: E402
from tests.ops.reference import expert_mlp_reference  # noqa: E402
from tests.ops.triton_cases import skip_without_usable_triton  # noqa: E402

needs_grouped_mm = pytest.mark.skipif(grouped_mm_missing_on("cpu") is not None,
                                      reason=str(grouped_mm_missing_on("cpu")))


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


def _assert_same_output_and_gradients(out, want, inputs, copies):
    """``out`` equals ``want``, and one random output gradient gives every one of ``inputs``
    the gradient its twin in ``copies`` gets."""
    torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    grad = torch.randn_like(out)
    out.backward(grad)
    want.backward(grad)
    for got, ref in zip(inputs, copies):
        torch.testing.assert_close(got.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_liger_peer_is_a_swiglu_moe_behind_the_sigmoid_top_k_router():
    """The adapter hands Liger's kernels the layouts they expect (gate rows first in
    gate_up, int32 experts): output and every gradient equal the loop's, at odd sizes."""
    skip_without_usable_triton()   # Liger's kernels are Triton's: import raises there
    liger = pytest.importorskip("liger_kernel.ops.fused_moe",
                                reason="liger-kernel is an optional peer (the test extra)")
    torch.manual_seed(0)
    module = fig2._LigerMoE(liger.LigerFusedMoEFunction.apply, d_model=24, num_experts=5,
                            intermediate=10)
    x = torch.randn(37, 24)
    params = [module.router.weight, module.gate_up, module.down]
    copies = [p.detach().clone().requires_grad_() for p in params]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    _assert_same_output_and_gradients(module(x1), _swiglu_moe_loop(x2, *copies, k=fig2.K),
                                      [x1, *params], [x2, *copies])


def test_liger_peer_is_built_where_it_imports_with_the_sigma_moe_parameters(tmp_path):
    skip_without_usable_triton()   # Liger's kernels are Triton's: import raises there
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


def _grouped_mm_peer_and_reference(tokens, starve_expert=None):
    """The grouped_mm peer at odd sizes and the per-token σ-MoE sum of the same parameters
    (Csordás et al. 2023 Eq. 25: y = Σ_e σ(W_s x)_e · relu(x W1_e) W2_e over the top k)."""
    torch.manual_seed(0)
    peer = GroupedMMMoE(SigmaMoEConfig(d_model=20, num_experts=7, expert_size=12, k=3))
    x = torch.randn(tokens, 20)
    if starve_expert is not None:   # an expert no token selects: an empty group
        x[:, 0] = x[:, 0].abs() + 1
        with torch.no_grad():
            peer.router.weight[starve_expert] = 0
            peer.router.weight[starve_expert, 0] = -50
    params = [peer.router.weight, peer.w1, peer.w2]
    copies = [p.detach().clone().requires_grad_() for p in params]
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()

    def reference():
        router, w1, w2 = copies
        scores, experts = torch.sigmoid(x2 @ router.t()).topk(3, dim=-1)
        return experts, expert_mlp_reference(x2, experts, scores, w1.transpose(1, 2),
                                             w2.transpose(1, 2), torch.relu)
    return peer(x1), reference, [x1, *params], [x2, *copies]


@needs_grouped_mm
@pytest.mark.parametrize("starve_expert", [None, 4])
def test_grouped_mm_peer_is_the_sigma_moe_with_every_gradient(starve_expert):
    out, reference, inputs, copies = _grouped_mm_peer_and_reference(29, starve_expert)
    experts, want = reference()
    if starve_expert is not None:
        assert not (experts == starve_expert).any()
    _assert_same_output_and_gradients(out, want, inputs, copies)
    if starve_expert is not None:   # an empty group's weights get an exact zero gradient
        assert inputs[2].grad[starve_expert].eq(0).all()


@needs_grouped_mm
def test_grouped_mm_peer_takes_an_empty_batch():
    out, _, inputs, _ = _grouped_mm_peer_and_reference(0)
    assert out.shape == (0, 20)
    out.backward(torch.randn_like(out))
    assert inputs[0].grad.shape == (0, 20) and inputs[1].grad.eq(0).all()


def test_portable_peers_are_built_in_the_benchmark_dtype_and_cast_their_input():
    builders = fig2.portable_peer_builders(torch.bfloat16)
    assert "mixtral_loop" in builders
    assert ("grouped_mm" in builders) == (grouped_mm_missing_on("cpu") is None)
    for name, build in builders.items():
        module = build(128, 4)
        assert {p.dtype for p in module.parameters()} == {torch.bfloat16}, name
        out = module(torch.randn(5, 128))    # float32 in, computed in bf16
        assert out.dtype == torch.bfloat16 and out.shape == (5, 128), name
    experts = sum(p.numel() for n, p in builders["mixtral_loop"](128, 4).named_parameters()
                  if "experts" in n)
    assert experts == 4 * 2 * fig2.EXPERT_SIZE * 128, "the σ-MoE experts' parameters"
