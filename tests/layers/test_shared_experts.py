"""DeepSeekMoE's shared experts (Dai et al. 2024, arXiv:2401.06066, §3.2): ``MoEConfig``'s
``shared_experts``, a dense MLP every token goes through beside its routed experts."""

import pytest
import torch

from sparseffn import DenseMLP, DenseMLPConfig, MoE, MoEConfig, config_from_dict
from sparseffn.models import ffn_preset

BASE = dict(d_model=10, num_experts=6, expert_size=4, k=2)


def _pair(**fields):
    """The layer with two shared experts and the same layer without, from one seed."""
    torch.manual_seed(0)
    plain = MoE(MoEConfig(**BASE, **fields))
    torch.manual_seed(0)
    shared = MoE(MoEConfig(**BASE, shared_experts=2, **fields))
    return plain, shared


def test_the_shared_experts_add_a_dense_mlp_of_their_width_to_the_routed_output():
    plain, layer = _pair()
    for name, p in plain.named_parameters():    # drawn last: the routed part is the same
        assert torch.equal(p, layer.get_parameter(name)), name
    dense = DenseMLP(DenseMLPConfig(d_model=10, d_ff=8))
    with torch.no_grad():
        dense.up.weight.copy_(layer.shared.w1.reshape(8, 10))
        dense.down.weight.copy_(layer.shared.w2.reshape(8, 10).t())
    x = torch.randn(3, 5, 10)
    torch.testing.assert_close(layer(x), plain(x) + dense(x), rtol=1e-5, atol=1e-6)
    # they take no part in the routing: the same counts, the same aux losses
    assert torch.equal(layer.routing_stats["counts"], plain.routing_stats["counts"])
    assert layer.aux_losses.keys() == plain.aux_losses.keys()


def test_a_token_every_router_drops_still_gets_the_shared_experts():
    torch.manual_seed(0)
    layer = MoE(MoEConfig(**{**BASE, "k": 1}, shared_experts=1,
                          router={"type": "switch", "capacity_factor": 0.2})).train()
    x = torch.randn(30, 10)
    y = layer(x)
    dropped = ~layer.router(x).dispatched.squeeze(1)
    assert dropped.any()
    torch.testing.assert_close(y[dropped], layer.shared.dense_output(x[dropped], None))


def test_gated_shared_experts_train_under_bf16_autocast():
    _, layer = _pair(activation="silu", gated=True)
    x = torch.randn(16, 10)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    for p in (layer.shared.w1, layer.shared.w2, layer.shared.w_gate):
        assert p.grad is not None and p.grad.dtype == torch.float32 and p.grad.abs().sum() > 0


def test_cost_config_and_bad_values():
    config = MoEConfig(**BASE, shared_experts=3, gated=True)
    layer = MoE(config)
    cost = config.cost()
    assert cost.total_params == sum(p.numel() for p in layer.parameters())
    plain = MoEConfig(**BASE, gated=True).cost()
    assert cost.active_params - plain.active_params == 3 * 3 * 10 * 4   # every token's
    assert config_from_dict(config.to_dict()) == config
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="shared_experts must be a non-negative integer"):
            MoEConfig(**BASE, shared_experts=bad)


def test_a_preset_with_shared_experts_keeps_the_dense_budget():
    budget = DenseMLPConfig(d_model=64, d_ff=256).cost().total_params
    layout = ffn_preset("softmax_moe", 64, 256, 2, shared_experts=2)
    assert layout.ffn.shared_experts == 2
    assert layout.ffn.cost().total_params <= budget
    assert layout.ffn.expert_size < ffn_preset("softmax_moe", 64, 256, 2).ffn.expert_size


def test_reset_parameters_draws_the_shared_experts_too():
    layer = MoE(MoEConfig(**BASE, shared_experts=1, gated=True))
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(float("nan"))
    layer.reset_parameters()
    for name, p in layer.named_parameters():
        assert torch.isfinite(p).all(), name
