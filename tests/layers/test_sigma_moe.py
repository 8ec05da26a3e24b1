"""σ-MoE's regulariser, expert dropout, initialisation and statistics (Csordás et al. 2023 §5)."""

import math

import pytest
import torch
from torch import nn

import sparseffn
from sparseffn import SigmaMoE
from sparseffn.losses import batch_entropy_loss


def test_entropy_regulariser_equals_hand_computation():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    # softmax rows: [.5, .5] and [.75, .25]; p = [.625, .375]     (Eq. 34)
    p = torch.tensor([0.625, 0.375])
    expected = (p * p.log()).sum()                                # (Eq. 35)
    torch.testing.assert_close(batch_entropy_loss(logits), expected)


def test_entropy_regulariser_is_lowest_for_uniform_usage():
    uniform = batch_entropy_loss(torch.zeros(10, 4))
    collapsed = batch_entropy_loss(torch.tensor([[5.0, 0, 0, 0]]).repeat(10, 1))
    torch.testing.assert_close(uniform, torch.tensor(-math.log(4.0)))
    assert collapsed > uniform


@pytest.mark.parametrize("scale", [1.0, 30.0, 1e4])
def test_entropy_regulariser_and_its_gradient_match_float64_at_any_logit_scale(scale):
    """Eq. 34-35 against a float64 evaluation, for ordinary, peaked and saturated logits (some
    mean probabilities then underflow in float32: their p log p counts as 0, gradient finite)."""
    torch.manual_seed(0)
    logits = (scale * torch.randn(37, 9)).requires_grad_()
    loss = batch_entropy_loss(logits)
    (grad,) = torch.autograd.grad(loss, logits)
    z = logits.detach().double().requires_grad_()
    p = torch.softmax(z, -1).mean(0)
    ref = torch.where(p > 0, p * p.clamp_min(1e-300).log(), torch.zeros_like(p)).sum()
    (ref_grad,) = torch.autograd.grad(ref, z)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-4, atol=1e-6)
    assert batch_entropy_loss(torch.zeros(0, 9)).item() == 0.0


def test_entropy_loss_is_recorded_and_weighted():
    layer = SigmaMoE(d_model=8, num_experts=4, expert_size=4, k=2, router={"entropy_weight": 0.5})
    x = torch.randn(6, 8)
    layer(x)
    expected = batch_entropy_loss(x @ layer.router.weight.t())
    torch.testing.assert_close(layer.aux_losses["entropy"], expected)
    torch.testing.assert_close(sparseffn.aux_loss(layer), 0.5 * expected)
    assert sparseffn.aux_loss_terms(layer) == {"<root>/entropy": layer.aux_losses["entropy"]}


def test_aux_loss_collects_from_nested_layers():
    model = nn.Sequential(nn.Linear(8, 8),
                          nn.ModuleDict({"a": SigmaMoE(d_model=8, num_experts=4, expert_size=2, k=1),
                                         "b": SigmaMoE(d_model=8, num_experts=4, expert_size=2, k=1)}))
    x = torch.randn(5, 8)
    x = model[1]["b"](model[1]["a"](model[0](x)))
    total = sparseffn.aux_loss(model)
    terms = sparseffn.aux_loss_terms(model)
    assert set(terms) == {"1.a/entropy", "1.b/entropy"}
    torch.testing.assert_close(total, 0.001 * (terms["1.a/entropy"] + terms["1.b/entropy"]))
    assert sparseffn.aux_loss(nn.Linear(2, 2)).item() == 0.0


def test_expert_dropout_never_selects_dropped_experts_and_does_not_rescale(monkeypatch):
    layer = SigmaMoE(d_model=8, num_experts=6, expert_size=4, k=2, router={"expert_dropout": 0.5}).train()
    x = torch.randn(200, 8)
    drawn = {}
    real_rand_like = torch.rand_like

    def spy(t, *args, **kwargs):
        out = real_rand_like(t, *args, **kwargs)
        drawn["mask"] = out < 0.5
        return out

    monkeypatch.setattr(torch, "rand_like", spy)
    routing = layer.router(x)
    dropped = drawn["mask"]
    logits = x @ layer.router.weight.t()
    selected_dropped = dropped.gather(1, routing.indices)
    enough = (~dropped).sum(1) >= 2
    assert not selected_dropped[enough].any()                  # dropped experts are never chosen
    kept_scores = torch.sigmoid(logits).gather(1, routing.indices)
    torch.testing.assert_close(routing.weights[enough], kept_scores[enough])  # no rescaling
    assert torch.all(routing.weights[selected_dropped] == 0)   # a forced pick contributes nothing
    # The choice is the top-k of the surviving experts.
    masked = logits.masked_fill(dropped, float("-inf"))
    want = masked.topk(2, dim=-1).indices.sort(-1).values
    assert torch.equal(routing.indices.sort(-1).values[enough], want[enough])


def test_expert_dropout_is_off_in_eval():
    layer = SigmaMoE(d_model=8, num_experts=6, expert_size=4, k=2, router={"expert_dropout": 0.9}).eval()
    x = torch.randn(50, 8)
    routing = layer.router(x)
    logits = x @ layer.router.weight.t()
    assert torch.equal(routing.indices.sort(-1).values, logits.topk(2).indices.sort(-1).values)
    torch.testing.assert_close(routing.weights, torch.sigmoid(logits.gather(1, routing.indices)))


def test_sigma_moe_init_matches_the_dense_layer_it_replaces():
    layer = SigmaMoE(d_model=256, num_experts=16, expert_size=64, k=4, init_depth=4)
    d_ff = 16 * 64
    assert abs(layer.store.w1.std().item() - math.sqrt(2 / (256 * 4))) < 0.02 * math.sqrt(2 / (256 * 4))
    assert abs(layer.store.w2.std().item() - math.sqrt(2 / (d_ff * 4))) < 0.02 * math.sqrt(2 / (d_ff * 4))
    norms = layer.router.weight.norm(dim=1)
    torch.testing.assert_close(norms, norms[0].expand_as(norms))   # equal row norms
    rms = layer.router.weight.square().mean().sqrt().item()
    assert abs(rms - math.sqrt(2 / (256 * 4))) < 1e-6


def test_standard_init_uses_the_expert_width():
    layer = SigmaMoE(d_model=256, num_experts=16, expert_size=64, k=4, init="standard")
    want = math.sqrt(2 / 64)
    assert abs(layer.store.w2.std().item() - want) < 0.02 * want
    norms = layer.router.weight.norm(dim=1)
    assert norms.max() - norms.min() > 1e-3


def test_usage_statistics_count_every_selection():
    layer = SigmaMoE(d_model=8, num_experts=5, expert_size=4, k=3)
    x = torch.randn(7, 8)
    layer(x)
    stats = sparseffn.routing_stats(layer)["<root>"]
    assert stats["counts"].sum().item() == 7 * 3
    routing = layer.router(x)
    want = torch.zeros(5).index_add_(0, routing.indices.reshape(-1), routing.weights.reshape(-1))
    torch.testing.assert_close(stats["mass"], want)
    layer(x)
    assert stats["usage_counts"].sum().item() == 2 * 7 * 3
    sparseffn.reset_usage(layer)
    assert sparseffn.routing_stats(layer)["<root>"]["usage_counts"].sum().item() == 0


def test_router_scores_in_fp32_under_bf16_autocast():
    layer = SigmaMoE(d_model=8, num_experts=4, expert_size=4, k=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = layer.router(torch.randn(3, 8))
        y = layer(torch.randn(3, 8))
    assert routing.weights.dtype == torch.float32
    assert y.dtype == torch.bfloat16


def test_hidden_dropout_only_in_training():
    layer = SigmaMoE(d_model=8, num_experts=4, expert_size=16, k=2, hidden_dropout=0.5)
    x = torch.randn(10, 8)
    layer.eval()
    torch.testing.assert_close(layer(x), layer(x))
    layer.train()
    torch.manual_seed(1)
    a = layer(x)
    torch.manual_seed(2)
    assert not torch.allclose(a, layer(x))


@pytest.mark.parametrize("gate", ["softmax", "softmax_renorm"])
def test_softmax_gates_sum_as_the_rule_says(gate):
    layer = SigmaMoE(d_model=8, num_experts=6, expert_size=4, k=3, router={"gate": gate})
    weights = layer.router(torch.randn(20, 8)).weights
    assert torch.all(weights >= 0)
    if gate == "softmax_renorm":
        torch.testing.assert_close(weights.sum(-1), torch.ones(20))
    else:
        assert torch.all(weights.sum(-1) < 1)
