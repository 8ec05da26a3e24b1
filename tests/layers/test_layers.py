import pytest
import torch
from torch import nn
from torch.nn import functional as F

import sparseffn
from tests.ops.reference import expert_mlp_reference
from sparseffn import (DenseMLP, DenseMLPConfig, SigmaMoE, SigmaMoEConfig, TopKMLP,
                       TopKMLPConfig)

ACT = {"relu": F.relu, "gelu": F.gelu}


def _grads(module, x, out, grad):
    params = [p for p in module.parameters()]
    return torch.autograd.grad(out, [x, *params], grad)


def sigma_moe_reference(layer: SigmaMoE, x):
    """Per-token loop implementing Csordás et al. 2023 Eq. 25 with the router's own rule, from the
    layer's parameters (no CVMM, no dispatch plan)."""
    cfg = layer.config
    logits = x @ layer.router.weight.t()
    indices = torch.topk(logits, cfg.k, dim=-1).indices
    chosen = logits.gather(1, indices)
    if cfg.router.gate == "sigmoid":
        weights = torch.sigmoid(chosen)
    elif cfg.router.gate == "softmax":
        weights = torch.softmax(logits, -1).gather(1, indices)
    else:
        weights = torch.softmax(chosen, -1)
    return expert_mlp_reference(x, indices, weights, layer.store.w1.transpose(1, 2), layer.store.w2,
                                ACT[cfg.activation])


@pytest.mark.parametrize("gate", ["sigmoid", "softmax", "softmax_renorm"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_sigma_moe_matches_per_token_reference(matmul_path, gate, activation, k):
    layer = SigmaMoE(d_model=12, num_experts=7, expert_size=5, k=k, router={"gate": gate},
                     activation=activation)
    x = torch.randn(19, 12, requires_grad=True)
    out = layer(x)
    ref = sigma_moe_reference(layer, x)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    for got, want in zip(_grads(layer, x, out, grad), _grads(layer, x, ref, grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_sigma_moe_with_experts_left_idle_gives_zero_grads():
    layer = SigmaMoE(d_model=8, num_experts=6, expert_size=4, k=1)
    with torch.no_grad():   # make experts 0 and 1 win for every token
        layer.router.weight[2:] = -10 * layer.router.weight[:1].abs().sum()
        layer.router.weight[:2] = 0.0
    x = torch.randn(5, 8)
    x[:, :] = x.abs()
    layer(x).sum().backward()
    assert layer.store.w1.grad is not None
    assert torch.all(layer.store.w1.grad[2:] == 0) and torch.all(layer.store.w2.grad[2:] == 0)


def test_sigma_moe_bf16_close_to_fp32():
    layer = SigmaMoE(d_model=32, num_experts=8, expert_size=16, k=2)
    x = torch.randn(4, 9, 32)
    ref = layer(x)
    out = layer.to(torch.bfloat16)(x.to(torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


def test_sigma_moe_is_drop_in_for_any_leading_shape_and_empty_batch():
    layer = SigmaMoE(d_model=16, num_experts=4, expert_size=8, k=2)
    for shape in [(16,), (3, 16), (2, 5, 16), (2, 0, 16), (0, 16)]:
        x = torch.randn(*shape, requires_grad=True)
        y = layer(x)
        assert y.shape == x.shape
        (y.sum() + sparseffn.aux_loss(layer)).backward()


def test_dense_mlp_is_the_two_layer_mlp():
    layer = DenseMLP(d_model=6, d_ff=10, activation="gelu", bias=True)
    x = torch.randn(3, 6)
    ref = F.gelu(x @ layer.up.weight.t() + layer.up.bias) @ layer.down.weight.t() + layer.down.bias
    torch.testing.assert_close(layer(x), ref)


def test_topk_mlp_matches_masked_dense_reference():
    layer = TopKMLP(d_model=10, d_ff=24, k=5)
    x = torch.randn(2, 7, 10, requires_grad=True)
    out = layer(x)
    u = F.relu(x @ layer.router.keys.t())
    mask = torch.zeros_like(u).scatter(-1, u.topk(5, dim=-1).indices, 1.0)
    ref = (u * mask) @ layer.store.values       # Eq. 13-14
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(out)
    for got, want in zip(_grads(layer, x, out, grad), _grads(layer, x, ref, grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_topk_with_k_equal_d_ff_is_the_dense_mlp():
    layer = TopKMLP(d_model=8, d_ff=12, k=12)
    x = torch.randn(5, 8)
    torch.testing.assert_close(layer(x), F.relu(x @ layer.router.keys.t()) @ layer.store.values)


@pytest.mark.parametrize("layer", [
    DenseMLP(d_model=8, d_ff=16), TopKMLP(d_model=8, d_ff=16, k=4),
    SigmaMoE(d_model=8, num_experts=4, expert_size=4, k=2)])
def test_wrong_input_shape_is_a_clear_error(layer):
    with pytest.raises(ValueError, match=r"expects input of shape \[\.\.\., d_model=8\], got \(3, 7\)"):
        layer(torch.randn(3, 7))
    with pytest.raises(TypeError, match="floating-point"):
        layer(torch.ones(3, 8, dtype=torch.long))


@pytest.mark.parametrize("make", [
    lambda: DenseMLP(d_model=8, d_ff=16), lambda: TopKMLP(d_model=8, d_ff=16, k=4),
    lambda: SigmaMoE(d_model=8, num_experts=4, expert_size=4, k=2),
    lambda: sparseffn.FastFeedForward(d_model=8, depth=2, leaf_width=3),
    lambda: sparseffn.ProductKeyMemory(d_model=8, num_subkeys=4, heads=2, k=3)])
def test_input_dtype_against_parameter_dtype_is_a_clear_error(make):
    """The parameter dtype the input check compares with is the first floating parameter's
    (found without walking every submodule), after ``.to`` and after a parameter is replaced."""
    layer = make()
    assert layer._parameter_dtype(torch.float16) == next(layer.parameters()).dtype
    layer.to(torch.bfloat16)
    with pytest.raises(TypeError, match="holds torch.bfloat16 parameters and got torch.float32"):
        layer(torch.randn(3, 8))
    assert layer(torch.randn(3, 8, dtype=torch.bfloat16)).dtype == torch.bfloat16
    layer.float()
    name, first = next(layer.named_parameters())
    owner = layer.get_submodule(name.rpartition(".")[0])
    setattr(owner, name.rpartition(".")[2], nn.Parameter(first.detach().double()))
    assert layer._parameter_dtype(torch.float16) == torch.float64
    with pytest.raises(TypeError, match="holds torch.float64 parameters"):
        layer(torch.randn(3, 8))


@pytest.mark.slow
def test_layers_replace_the_mlp_of_a_model_and_train():
    """A sparse layer drops into a small network and reduces a regression loss."""
    torch.manual_seed(0)
    x = torch.randn(256, 16)
    target = torch.sin(x @ torch.randn(16, 16))
    for ffn in [DenseMLP(d_model=16, d_ff=64), TopKMLP(d_model=16, d_ff=64, k=16),
                SigmaMoE(d_model=16, num_experts=8, expert_size=8, k=2)]:
        model = nn.Sequential(nn.LayerNorm(16), ffn)
        opt = torch.optim.Adam(model.parameters(), lr=3e-3)
        first = None
        for _ in range(150):
            loss = F.mse_loss(model(x), target)
            first = first if first is not None else loss.item()
            opt.zero_grad()
            (loss + sparseffn.aux_loss(model)).backward()
            opt.step()
        assert loss.item() < 0.5 * first, type(ffn).__name__


def test_build_layer_from_config():
    for cfg, cls in [(DenseMLPConfig(d_model=4, d_ff=8), DenseMLP),
                     (TopKMLPConfig(d_model=4, d_ff=8, k=2), TopKMLP),
                     (SigmaMoEConfig(d_model=4, num_experts=2, expert_size=4, k=1), SigmaMoE)]:
        layer = sparseffn.build_layer(cfg)
        assert isinstance(layer, cls) and layer.config == cfg


@pytest.mark.parametrize("config,renames", [
    (SigmaMoEConfig(d_model=8, num_experts=4, expert_size=3, k=2),
     {"store.w1": "w1", "store.w2": "w2"}),
    (TopKMLPConfig(d_model=8, d_ff=12, k=3), {"router.keys": "keys", "store.values": "values"}),
    (sparseffn.FFFConfig(d_model=8, depth=2, leaf_width=3),
     {"store.w1": "w1", "store.b1": "b1", "store.w2": "w2", "store.b2": "b2"}),
    (sparseffn.PKMConfig(d_model=8, num_subkeys=3, heads=1, k=2), {"store.values": "values"}),
    (sparseffn.PEERConfig(d_model=8, num_experts=9, heads=1, k=2, key_dim=4),
     {"store.w_in": "w_in", "store.w_out": "w_out"}),
])
def test_state_dicts_from_before_the_stores_still_load(config, renames):
    """Expert parameters moved from the layer into its store (and the top-K keys into its
    router); a state dict saved with the old names loads into today's layer."""
    layer = sparseffn.build_layer(config).eval()
    old = {renames.get(key, key): value for key, value in layer.state_dict().items()}
    assert set(renames.values()) <= set(old)
    fresh = sparseffn.build_layer(config).eval()
    fresh.load_state_dict(old)
    x = torch.randn(5, 8)
    torch.testing.assert_close(fresh(x), layer(x))


def test_usage_statistics_stay_float32_when_the_layer_is_cast():
    layer = SigmaMoE(d_model=8, num_experts=4, expert_size=4, k=2).to(torch.bfloat16)
    assert layer.store.w1.dtype == torch.bfloat16
    assert layer.usage_counts.dtype == layer.usage_mass.dtype == torch.float32
    for _ in range(3):
        layer(torch.randn(200, 8, dtype=torch.bfloat16))
    assert layer.usage_counts.sum().item() == 3 * 200 * 2       # exact beyond bf16's 256
