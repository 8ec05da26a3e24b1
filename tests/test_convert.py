"""Dense → sparse conversion: MoEfication (Zhang et al. 2022, arXiv:2110.01786) and sparse
upcycling (Komatsuzaki et al. 2022, arXiv:2212.05055)."""

import pytest
import torch
from torch.nn import functional as F

import sparseffn
from sparseffn import DenseMLP
from sparseffn.convert import (DenseWeights, balanced_kmeans, distill, expert_importance,
                               fit_router, moefy, split_hidden_units, upcycle)


def _dense(d_model=12, d_ff=30, activation="gelu", bias=True, seed=0):
    torch.manual_seed(seed)
    mlp = DenseMLP(d_model=d_model, d_ff=d_ff, activation=activation, bias=bias)
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 0.5)
    return mlp


@pytest.mark.parametrize("activation,bias", [("relu", False), ("gelu", True), ("gelu_tanh", True)])
@pytest.mark.parametrize("method", ["weights", "activations"])
def test_with_every_expert_active_the_converted_layer_is_the_dense_mlp(activation, bias, method):
    dense = _dense(activation=activation, bias=bias)
    layer = moefy(dense, num_experts=5, k=5, method=method, samples=torch.randn(200, 12))
    x = torch.randn(4, 7, 12)
    for mode in (False, True):
        layer.train(mode)
        torch.testing.assert_close(layer(x), dense(x), atol=1e-5, rtol=1e-5)
    assert layer.config.bias == bias and layer.config.router.gate == "hard"


def test_the_experts_hold_the_dense_units_they_were_given():
    dense = _dense(d_ff=6)
    groups = torch.tensor([[4, 0, 2], [1, 5, 3]])
    layer = moefy(dense, 2, 1, groups=groups)
    torch.testing.assert_close(layer.store.w1[0], dense.up.weight[[4, 0, 2]])
    torch.testing.assert_close(layer.store.w2[1], dense.down.weight[:, [1, 5, 3]].t())
    torch.testing.assert_close(layer.store.b1[1], dense.up.bias[[1, 5, 3]])
    torch.testing.assert_close(layer.store.b_out, dense.down.bias)


def test_one_of_several_experts_gives_exactly_that_experts_units():
    dense = _dense(d_ff=6, activation="relu")
    groups = torch.tensor([[0, 1, 2], [3, 4, 5]])
    layer = moefy(dense, 2, 1, groups=groups).eval()
    x = torch.randn(9, 12)
    chosen = layer.router.logits(x).argmax(1)                                   # [9]
    hidden = F.relu(F.linear(x, dense.up.weight, dense.up.bias))
    keep = torch.stack([(torch.arange(6) // 3) == c for c in chosen])
    want = F.linear(hidden * keep, dense.down.weight, dense.down.bias)
    torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)


def test_bad_groups_and_sizes_are_named():
    dense = _dense(d_ff=6)
    with pytest.raises(ValueError, match="partition"):
        moefy(dense, 2, 1, groups=torch.tensor([[0, 1, 2], [3, 4, 4]]))
    with pytest.raises(ValueError, match="divid"):
        moefy(dense, 4, 1)
    with pytest.raises(ValueError, match="samples"):
        split_hidden_units(dense, 2, method="activations")
    with pytest.raises(ValueError, match="method"):
        split_hidden_units(dense, 2, method="random")
    with pytest.raises(ValueError, match="w2"):
        DenseWeights(torch.zeros(6, 4), None, torch.zeros(6, 4), None, "relu")
    with pytest.raises(ValueError, match="activation"):
        DenseWeights(torch.zeros(6, 4), None, torch.zeros(4, 6), None, "swish")
    with pytest.raises(TypeError, match="DenseWeights"):
        moefy(torch.nn.Linear(3, 3), 1, 1)


def test_balanced_kmeans_gives_equal_clusters_and_finds_separated_groups():
    torch.manual_seed(0)
    centres = torch.randn(4, 8) * 10
    truth = torch.arange(4).repeat_interleave(6)
    points = centres[truth] + 0.1 * torch.randn(24, 8)
    found = balanced_kmeans(points, 4, seed=1)
    assert torch.bincount(found, minlength=4).tolist() == [6, 6, 6, 6]
    # the same partition up to the clusters' names
    pairs = {(int(t), int(f)) for t, f in zip(truth, found)}
    assert len(pairs) == 4


def test_activation_split_groups_units_that_fire_together():
    """Units built to fire on disjoint halves of the input space end up in separate experts."""
    d_model, d_ff = 4, 8
    w1 = torch.zeros(d_ff, d_model)
    w1[:4, 0] = 1.0 + torch.rand(4)      # fire when x0 > 0
    w1[4:, 0] = -1.0 - torch.rand(4)     # fire when x0 < 0
    dense = DenseWeights(w1, None, torch.randn(d_model, d_ff), None, "relu")
    groups = split_hidden_units(dense, 2, method="activations", samples=torch.randn(400, d_model))
    assert sorted(map(sorted, groups.tolist())) == [[0, 1, 2, 3], [4, 5, 6, 7]]



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_activation_split_of_a_half_precision_mlp(dtype):
    """A bf16 / fp16 model's MLP is split like its float32 copy (samples stay float32)."""
    torch.manual_seed(0)
    d_model, d_ff = 6, 12
    full = DenseWeights(torch.randn(d_ff, d_model), torch.randn(d_ff),
                        torch.randn(d_model, d_ff), None, "relu")
    half = DenseWeights(full.w1.to(dtype), full.b1.to(dtype), full.w2.to(dtype), None, "relu")
    samples = torch.randn(300, d_model)
    rounded = DenseWeights(half.w1.float(), half.b1.float(), half.w2.float(), None, "relu")
    groups = split_hidden_units(half, 3, method="activations", samples=samples)
    assert torch.equal(groups, split_hidden_units(rounded, 3, method="activations",
                                                  samples=samples))
    assert sorted(groups.flatten().tolist()) == list(range(d_ff))


def test_expert_importance_is_the_norm_of_each_experts_output():
    dense = _dense(d_ff=6)
    layer = moefy(dense, 3, 1, groups=torch.arange(6).view(3, 2))
    x = torch.randn(5, 12)
    hidden = F.gelu(F.linear(x, dense.up.weight, dense.up.bias))
    want = torch.stack([(hidden[:, 2 * e:2 * e + 2] @ dense.down.weight[:, 2 * e:2 * e + 2].t()
                         ).norm(dim=1) for e in range(3)], 1)
    torch.testing.assert_close(expert_importance(layer, x, chunk=2), want, atol=1e-5, rtol=1e-5)
    assert expert_importance(layer, x[:0]).shape == (0, 3)


def test_fit_router_learns_which_experts_matter_and_touches_only_the_router():
    """Each expert answers to one input direction; a fitted router finds the right one."""
    torch.manual_seed(0)
    d_model, experts, size = 8, 4, 3
    w1 = torch.zeros(experts * size, d_model)
    for e in range(experts):
        w1[e * size:(e + 1) * size, e] = 3.0
    # equal output weights: the best expert is the one whose input coordinate is largest
    dense = DenseWeights(w1, None, torch.ones(d_model, experts * size), None, "relu")
    layer = moefy(dense, experts, 1, groups=torch.arange(experts * size).view(experts, size))
    with torch.no_grad():
        layer.router.weight.normal_()      # forget the similarity start
    stores = {k: v.clone() for k, v in layer.store.state_dict().items()}
    x = torch.randn(3000, d_model)
    x[:, :experts] += 3.0            # some expert always fires, so the best one is well defined
    fit = fit_router(layer, x, steps=300, lr=0.05)
    assert fit["recall"] > 0.95 and fit["recall_before"] < 0.6
    assert 0 < fit["oracle_share"] <= 1
    assert all(torch.equal(v, layer.store.state_dict()[k]) for k, v in stores.items())
    assert layer.router.weight.grad is None
    with pytest.raises(ValueError, match="samples"):
        fit_router(layer, torch.randn(10, d_model + 1))


def test_distill_brings_the_student_towards_the_teacher():
    teacher = _dense(activation="relu", bias=True)
    student = moefy(teacher, 5, 2)
    batches = [torch.randn(64, 12) for _ in range(4)]
    before = sum(F.mse_loss(student(b), teacher(b)).item() for b in batches)
    losses = distill(student, teacher, batches, output=lambda m, b: m(b), steps=60, lr=1e-2)
    after = sum(F.mse_loss(student(b), teacher(b)).item() for b in batches)
    assert len(losses) == 60 and after < 0.7 * before
    with pytest.raises(ValueError, match="batches"):
        distill(student, teacher, [], output=lambda m, b: m(b), steps=1)


# --- gated (GLU) MLPs: Llama's down(act(gate(x)) * up(x)) -----------------------------------

def _gated(d_model=12, d_ff=30, activation="silu", bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.5
    return DenseWeights(rand(d_ff, d_model), rand(d_ff) if bias else None, rand(d_model, d_ff),
                        rand(d_model) if bias else None, activation, w_gate=rand(d_ff, d_model))


def _gated_reference(dense, x):
    gate = F.linear(x, dense.w_gate)
    act = {"silu": F.silu, "gelu_tanh": lambda h: F.gelu(h, approximate="tanh")}[dense.activation]
    return F.linear(act(gate) * F.linear(x, dense.w1, dense.b1), dense.w2, dense.b2)


@pytest.mark.parametrize("activation,bias", [("silu", False), ("gelu_tanh", True)])
@pytest.mark.parametrize("method", ["weights", "activations"])
def test_a_gated_mlp_with_every_expert_active_is_reproduced(activation, bias, method):
    dense = _gated(activation=activation, bias=bias)
    x = torch.randn(4, 7, 12)
    torch.testing.assert_close(dense(x.view(-1, 12)), _gated_reference(dense, x.view(-1, 12)))
    layer = moefy(dense, num_experts=5, k=5, method=method, samples=torch.randn(200, 12))
    assert layer.config.gated and layer.store.w_gate is not None
    for mode in (False, True):
        layer.train(mode)
        torch.testing.assert_close(layer(x), _gated_reference(dense, x), atol=1e-5, rtol=1e-5)


def test_gated_experts_hold_their_units_gate_rows_and_the_router_starts_at_the_gates():
    dense = _gated(d_ff=6)
    groups = torch.tensor([[4, 0, 2], [1, 5, 3]])
    layer = moefy(dense, 2, 1, groups=groups)
    torch.testing.assert_close(layer.store.w_gate[0], dense.w_gate[[4, 0, 2]])
    torch.testing.assert_close(layer.store.w1[1], dense.w1[[1, 5, 3]])
    torch.testing.assert_close(layer.store.w2[1], dense.w2[:, [1, 5, 3]].t())
    torch.testing.assert_close(layer.router.weight[1], dense.w_gate[[1, 5, 3]].mean(0))
    x = torch.randn(5, 12)
    hidden = F.silu(F.linear(x, dense.w_gate)) * F.linear(x, dense.w1)
    want = torch.stack([(hidden[:, groups[e]] @ dense.w2[:, groups[e]].t()).norm(dim=1)
                        for e in range(2)], 1)
    torch.testing.assert_close(expert_importance(layer, x), want, atol=1e-5, rtol=1e-5)


def test_weight_split_of_a_gated_mlp_groups_units_by_their_gates():
    """Units whose gate rows point the same way share an expert although their up rows are
    random."""
    d_model, d_ff = 6, 8
    w_gate = torch.zeros(d_ff, d_model)
    w_gate[[0, 2, 5, 7], 0] = 1.0
    w_gate[[1, 3, 4, 6], 1] = 1.0
    dense = DenseWeights(torch.randn(d_ff, d_model) * 0.1, None, torch.randn(d_model, d_ff),
                         None, "silu", w_gate=w_gate)
    groups = split_hidden_units(dense, 2, method="weights")
    assert sorted(map(sorted, groups.tolist())) == [[0, 2, 5, 7], [1, 3, 4, 6]]
    with pytest.raises(ValueError, match="w_gate"):
        DenseWeights(dense.w1, None, dense.w2, None, "silu", w_gate=torch.zeros(3, 3))


@pytest.mark.parametrize("dense", ["relu", "gelu with biases", "gated silu with biases"])
def test_an_upcycled_layer_is_the_dense_mlp_until_it_trains(dense):
    dense = {"relu": lambda: _dense(activation="relu", bias=False),
             "gelu with biases": lambda: _dense(activation="gelu"),
             "gated silu with biases": lambda: _gated(bias=True)}[dense]()
    layer = upcycle(dense, num_experts=4, k=2)
    weights = DenseWeights.of(dense) if isinstance(dense, DenseMLP) else dense
    assert layer.store.w1.shape == (4, weights.d_ff, weights.d_model)
    assert layer.config.router.renormalize
    x = torch.randn(3, 7, 12)
    want = dense(x) if isinstance(dense, DenseMLP) else _gated_reference(dense, x)
    for mode in (False, True):
        layer.train(mode)
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    # one training step on a task loss and the aux loss: the experts start to differ
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.5)
    layer.train()
    (layer(x).square().mean() + sparseffn.aux_loss(layer)).backward()
    optimizer.step()
    assert not torch.allclose(layer.store.w1[0], layer.store.w1[1])


def test_upcycling_takes_any_router_and_keeps_the_dense_dtype():
    dense = _dense().to(torch.bfloat16)
    layer = upcycle(dense, 8, 1, router={"type": "switch", "capacity_factor": 2.0})
    assert isinstance(layer.config.router, sparseffn.SwitchRouterConfig)
    assert layer.store.w1.dtype == torch.bfloat16
    assert sum(p.numel() for p in layer.store.parameters()) == 8 * sum(
        p.numel() for p in dense.parameters()) - 7 * dense.down.bias.numel()
