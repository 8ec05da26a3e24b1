"""The classic mixtures of the classic mixtures against their formulas, and they learn."""

import math

import pytest
import torch
from torch.nn import functional as F

import sparseffn
from sparseffn import (DeepMixtureOfExperts, HierarchicalMixtureOfExperts, MixtureOfExperts,
                       MoE, MoEConfig)
from sparseffn.router_config import DenseGateRouterConfig, HierarchicalRouterConfig
from sparseffn.routers import build_router
from tests.layers.test_conformance import assert_gradients_equal_finite_differences


def _clusters(n=600, classes=3, dim=2, seed=0):
    """Gaussian clusters, two per class, so a single linear classifier is not enough."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(2 * classes, dim, generator=generator) * 3
    labels = torch.arange(n) % (2 * classes)
    x = centres[labels] + 0.5 * torch.randn(n, dim, generator=generator)
    return x, labels % classes


def test_gate_is_a_softmax_on_x_and_one():
    router = build_router(DenseGateRouterConfig(), 3, 4, 4)
    x = torch.randn(5, 3)
    with torch.no_grad():
        router.bias.copy_(torch.randn(4))
    v = torch.cat([router.weight, router.bias.unsqueeze(1)], 1)          # v_i of [x, 1]
    want = torch.softmax(torch.cat([x, torch.ones(5, 1)], 1) @ v.t(), -1)
    routing = router(x)
    torch.testing.assert_close(routing.weights, want)
    assert torch.equal(routing.indices, torch.arange(4).expand(5, 4))


def test_classification_mixture_is_the_gated_sum_of_softmax_experts():
    model = MixtureOfExperts(4, 3, num_experts=5)
    x = torch.randn(7, 4)
    log_probs = model(x)
    gates = model.router(x).weights
    expert_probs = torch.softmax(model.experts(x), -1)                    # ŷ_ik
    want = torch.einsum("te,tek->tk", gates, expert_probs)               # ŷ_k = Σ g_i ŷ_ik
    torch.testing.assert_close(log_probs.exp(), want)
    target = torch.randint(0, 3, (7,))
    torch.testing.assert_close(model.loss(x, target), -want[torch.arange(7), target].log().mean())


def test_regression_loss_is_the_gaussian_mixture_likelihood():
    model = MixtureOfExperts(3, 2, num_experts=4, task="regression", expert_hidden=5)
    x, y = torch.randn(6, 3), torch.randn(6, 2)
    gates = model.router(x).weights
    means = model.experts(x)
    want = 0.0
    for t in range(6):   # -log Σ_i g_i exp(-|y - μ_i|² / 2)
        want -= math.log(sum(gates[t, i].item() * math.exp(-0.5 * (y[t] - means[t, i]).square().sum().item())
                             for i in range(4)))
    assert model.loss(x, y).item() == pytest.approx(want / 6, rel=1e-5)
    torch.testing.assert_close(model(x), torch.einsum("te,teo->to", gates, means))


@pytest.mark.parametrize("branching,depth", [(2, 1), (2, 3), (3, 2), (4, 2)])
def test_hierarchical_weights_are_products_of_gates_along_the_path(branching, depth):
    router = build_router(HierarchicalRouterConfig(branching=branching), 5,
                          branching ** depth, branching ** depth)
    with torch.no_grad():
        router.bias.normal_()
    x = torch.randn(4, 5)
    node_gates = torch.softmax((x @ router.weight.t() + router.bias).view(4, -1, branching), -1)

    def leaf_weights(node, level):   # recursion over the tree: g_i · g_(j|i) · ...
        if level == depth:
            return [torch.ones(4)]
        out = []
        for child in range(branching):
            below = leaf_weights(node * branching + child + 1, level + 1)
            out += [node_gates[:, node, child] * w for w in below]
        return out

    want = torch.stack(leaf_weights(0, 0), 1)
    weights = router(x).weights
    torch.testing.assert_close(weights, want)
    torch.testing.assert_close(weights.sum(-1), torch.ones(4))


def test_margin_rule_matches_the_per_example_definition():
    margin = 0.3
    router = build_router(DenseGateRouterConfig(margin=margin), 3, 4, 4).train()
    with torch.no_grad():
        router.bias.copy_(torch.tensor([2.0, 0.0, 0.0, -1.0]))   # expert 0 over-used
    xs = torch.randn(30, 3)
    totals = torch.zeros(4)
    zeroed_any = False
    for x in xs:   # one example per step: Eigen et al.'s rule, written out
        gates = torch.softmax(x @ router.weight.t() + router.bias, -1)
        candidate = totals + gates
        over = candidate - candidate.mean() > margin
        applied = gates * ~over
        applied = applied / applied.sum()
        totals += applied
        zeroed_any |= bool(over.any())
        got = router(x.unsqueeze(0)).weights[0]
        torch.testing.assert_close(got, applied.detach())
    assert zeroed_any
    torch.testing.assert_close(router.assignment_totals, totals.detach())
    spread = router.assignment_totals - router.assignment_totals.mean()
    assert spread.max() <= margin + 1.0   # an expert is stopped within one example of the margin
    router.eval()   # the rule is a training-time rule
    x = xs[:3]
    torch.testing.assert_close(router(x).weights,
                               torch.softmax(x @ router.weight.t() + router.bias, -1))


def test_classic_gates_work_inside_the_cvmm_moe_layer():
    layer = MoE(MoEConfig(d_model=6, num_experts=4, expert_size=3, k=4, router="hierarchical"))
    y = layer(torch.randn(5, 6))
    assert y.shape == (5, 6)
    assert layer.routing_stats["counts"].tolist() == [5.0] * 4


def test_bad_classic_configs_are_named():
    with pytest.raises(ValueError, match="task must be one of"):
        MixtureOfExperts(3, 2, 4, task="ranking")
    with pytest.raises(ValueError, match="depth must be a positive integer"):
        HierarchicalMixtureOfExperts(3, 2, branching=2, depth=0)
    with pytest.raises(ValueError, match="needs a dense gate"):
        MixtureOfExperts(3, 2, 4, router=sparseffn.SwitchRouterConfig())
    with pytest.raises(ValueError, match="expects input of shape"):
        MixtureOfExperts(3, 2, 4)(torch.randn(2, 5))


def _fit(model, loss_fn, steps=300, lr=0.03):
    optimiser = torch.optim.Adam(model.parameters(), lr=lr)
    for _ in range(steps):
        loss = loss_fn()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    return model


@pytest.mark.parametrize("build", [
    lambda: MixtureOfExperts(2, 3, num_experts=6),
    lambda: HierarchicalMixtureOfExperts(2, 3, branching=2, depth=3),
    lambda: DeepMixtureOfExperts(2, 3, hidden=(16, 16), num_experts=4, margin=50.0),
], ids=["jacobs", "hierarchical", "deep"])
@pytest.mark.slow
def test_classic_mixtures_learn_a_clustered_classification(build):
    torch.manual_seed(0)
    x, y = _clusters()
    model = build()
    _fit(model, lambda: F.nll_loss(model(x), y))
    model.eval()
    accuracy = (model(x).argmax(-1) == y).float().mean().item()
    majority = torch.bincount(y).max().item() / len(y)
    assert accuracy > 0.9 > majority + 0.4


@pytest.mark.slow
def test_mixture_of_linear_experts_fits_a_piecewise_linear_regression():
    torch.manual_seed(0)
    x = torch.rand(400, 1) * 4 - 2
    y = torch.where(x < 0, -2 * x - 1, 3 * x - 1)          # two linear pieces
    model = MixtureOfExperts(1, 1, num_experts=4, task="regression")
    _fit(model, lambda: model.loss(x, y), steps=400)
    with torch.no_grad():
        mse = (model(x) - y).square().mean().item()
    assert mse < 0.1 * y.var().item()


@pytest.mark.parametrize("build", [
    lambda: MixtureOfExperts(4, 3, num_experts=5),
    lambda: MixtureOfExperts(4, 2, num_experts=4, task="regression", expert_hidden=5),
    lambda: HierarchicalMixtureOfExperts(4, 3, branching=2, depth=2),
    lambda: DeepMixtureOfExperts(4, 3, hidden=(6, 5))],
    ids=["classification", "regression_hidden", "hierarchical", "deep"])
def test_gradients_equal_finite_differences_in_float64(build):
    """As for every registered layer (tests/layers/test_conformance.py): the gradients of the
    output and of the aux losses, for the input and every parameter, in float64."""
    torch.manual_seed(0)
    model = build().double().train()
    x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
    names = [key for key, _ in model.named_parameters()]
    assert_gradients_equal_finite_differences(model, x, names)
