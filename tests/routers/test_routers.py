"""Every router behind the one interface: invariants, hand-computed losses, references."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F

import sparseffn
from tests.ops.reference import expert_mlp_reference
from sparseffn import MoE, MoEConfig, config_from_dict
from sparseffn.losses import cv_squared, router_z_loss, switch_balance_loss
from sparseffn.router_config import (DenseGateRouterConfig, ExpertChoiceRouterConfig,
                                     GShardRouterConfig,
                                     HierarchicalRouterConfig, NoisyTopKRouterConfig,
                                     SBaseRouterConfig, SigmaRouterConfig, SoftmaxRouterConfig,
                                     SwitchRouterConfig, TreeRouterConfig)
from sparseffn.routers import build_router, gshard_top2
from sparseffn.ops.assignment import positions_in_expert
from sparseffn.routers.noisy import noisy_topk_load

E = 8
# (router config, k) for every routing rule, at num_experts = E.
ROUTERS = {
    "sigma": (SigmaRouterConfig(), 2),
    "sigma_hard": (SigmaRouterConfig(gate="hard"), 2),
    "softmax": (SoftmaxRouterConfig(), 2),
    "softmax_renorm": (SoftmaxRouterConfig(renormalize=True), 2),
    "noisy_topk": (NoisyTopKRouterConfig(), 2),
    "switch": (SwitchRouterConfig(capacity_factor=1.0), 1),
    "switch_dropless": (SwitchRouterConfig(capacity_factor=None), 1),
    "gshard": (GShardRouterConfig(capacity_factor=1.0, group_size=16), 2),
    "sbase": (SBaseRouterConfig(), 2),
    "sbase_exact": (SBaseRouterConfig(assignment="exact"), 2),
    "sbase_capacity": (SBaseRouterConfig(rounding="capacity"), 2),
    "expert_choice": (ExpertChoiceRouterConfig(), 2),
    "expert_choice_top_k_eval": (ExpertChoiceRouterConfig(eval_routing="top_k"), 2),
    "dense_softmax": (DenseGateRouterConfig(), E),
    "hierarchical": (HierarchicalRouterConfig(branching=2), E),
    "tree": (TreeRouterConfig(), 2),
    "tree_softplus_renorm": (TreeRouterConfig(activation="softplus", renormalize=True), 2),
}
# Rules whose weights sum to one per token (before any capacity dropping).
SUM_TO_ONE = {"softmax_renorm", "noisy_topk", "gshard", "dense_softmax", "hierarchical",
              "tree_softplus_renorm"}


def _layer(name, d_model=12, expert_size=6, seed=0, **kwargs):
    router, k = ROUTERS[name]
    torch.manual_seed(seed)
    return MoE(MoEConfig(d_model=d_model, num_experts=E, expert_size=expert_size, k=k,
                         router=router, **kwargs))


def _moe_reference(layer, x, routing):
    """Csordás et al. 2023 Eq. 25 as a per-token loop, with a dropped slot contributing nothing."""
    weights = routing.weights
    if routing.dispatched is not None:
        weights = weights * routing.dispatched
    return expert_mlp_reference(x, routing.indices, weights, layer.store.w1.transpose(1, 2),
                                layer.store.w2, F.relu)


# --- configs ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_moe_config_round_trips_with_every_router(name):
    router, k = ROUTERS[name]
    cfg = MoEConfig(d_model=12, num_experts=E, expert_size=6, k=k, router=router)
    assert config_from_dict(cfg.to_dict()) == cfg
    import json
    assert config_from_dict(json.loads(cfg.to_json())) == cfg


def test_router_may_be_named_or_given_as_a_dict():
    by_name = MoEConfig(d_model=4, num_experts=4, expert_size=2, k=1, router="switch")
    assert by_name.router == SwitchRouterConfig()
    by_dict = MoEConfig(d_model=4, num_experts=4, expert_size=2, k=1,
                        router={"type": "switch", "capacity_factor": 2.0})
    assert by_dict.router.capacity_factor == 2.0


@pytest.mark.parametrize("router,k,message", [
    ("switch", 2, "k must be 1"),
    ("gshard", 1, "k must be 2"),
    ("dense_softmax", 2, "k must be 8"),
    ({"type": "hierarchical", "branching": 3}, 8, "power of branching=3"),
    ("nope", 1, "router 'type' must be one of"),
    ({"type": "switch", "capacity": 1}, 1, "no field"),
    ({"type": "switch", "capacity_factor": -1}, 1, "capacity_factor must be a non-negative"),
    ({"type": "switch", "eval_capacity_factor": -1}, 1,
     "eval_capacity_factor must be a non-negative"),
    ({"type": "gshard", "eval_capacity_factor": "2"}, 2, "eval_capacity_factor must be a finite"),
    ({"type": "sbase", "assignment": "hungarian"}, 1, "assignment must be one of"),
    ({"type": "gshard", "second_expert": "top"}, 2, "second_expert must be one of"),
])
def test_impossible_router_configs_are_named(router, k, message):
    with pytest.raises(ValueError, match=message):
        MoEConfig(d_model=4, num_experts=8, expert_size=2, k=k, router=router)


def test_cost_counts_the_router_parameters():
    base = dict(d_model=16, num_experts=8, expert_size=4)
    layer = MoE(MoEConfig(**base, k=2, router="noisy_topk"))
    assert layer.config.cost().total_params == sum(p.numel() for p in layer.parameters())
    layer = MoE(MoEConfig(**base, k=8, router="hierarchical"))
    assert layer.config.cost().total_params == sum(p.numel() for p in layer.parameters())


# --- what every router guarantees ------------------------------------------------------

@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_moe_with_every_router_matches_the_per_token_reference(matmul_path, name):
    layer = _layer(name).eval()
    x = torch.randn(32, 12, requires_grad=True)
    routing = layer.router(x)
    out = layer(x)
    ref = _moe_reference(layer, x, routing)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(out)
    params = [x, layer.store.w1, layer.store.w2]
    for got, want in zip(torch.autograd.grad(out, params, grad),
                         torch.autograd.grad(ref, params, grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_weights_are_non_negative_and_sum_to_one_where_the_rule_says(name):
    layer = _layer(name, capacity=None) if False else _layer(name)
    for mode in (layer.train, layer.eval):
        mode()
        routing = layer.router(torch.randn(64, 12))
        # expert choice has a slot for every expert (all but its choices undispatched)
        choosing = name == "expert_choice" or (name.startswith("expert_choice") and
                                               layer.training)
        slots = E if choosing else ROUTERS[name][1]
        assert routing.indices.shape == routing.weights.shape == (64, slots)
        assert routing.weights.dtype == torch.float32
        assert torch.all(routing.weights >= 0)
        assert torch.all(routing.indices.sort(-1).values.diff(dim=-1) > 0), "distinct experts"
        if name in SUM_TO_ONE and name != "gshard":
            torch.testing.assert_close(routing.weights.sum(-1), torch.ones(64))
        if name == "gshard":   # g1 + g2 = 1 wherever both were dispatched
            both = routing.dispatched.all(-1) if routing.dispatched is not None else \
                torch.ones(64, dtype=torch.bool)
            torch.testing.assert_close(routing.weights[both].sum(-1), torch.ones(int(both.sum())))


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_gradients_reach_every_router_parameter(name):
    layer = _layer(name).train()
    x = torch.randn(64, 12)
    loss = layer(x).square().mean() + sparseffn.aux_loss(layer)
    loss.backward()
    for pname, p in layer.router.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, pname


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_training_forward_is_deterministic_under_a_seed(name):
    # Bitwise equal outputs need deterministic algorithms: the fused CPU kernels add a
    # token's k > 2 expert outputs in thread order (they step aside in deterministic mode).
    x = torch.randn(48, 12)
    outs, routings = [], []
    torch.use_deterministic_algorithms(True)
    try:
        for _ in range(2):
            layer = _layer(name, seed=3, hidden_dropout=0.1).train()
            torch.manual_seed(11)
            outs.append(layer(x))
            torch.manual_seed(11)
            routings.append(layer.router(x))
    finally:
        torch.use_deterministic_algorithms(False)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)
    assert torch.equal(routings[0].indices, routings[1].indices)
    torch.testing.assert_close(routings[0].weights, routings[1].weights, rtol=0, atol=0)


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_scores_are_float32_under_bf16(name):
    layer = _layer(name).eval()
    x = torch.randn(16, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = layer.router(x.bfloat16())
        y = layer(x)
    assert routing.weights.dtype == torch.float32
    assert y.dtype == torch.bfloat16
    want = layer.router(x.bfloat16().float())   # same decisions as fp32 on the rounded input
    torch.testing.assert_close(routing.weights, want.weights)


LINEAR_ROUTERS = ("sigma", "softmax", "switch", "gshard", "sbase")


@pytest.mark.parametrize("name", LINEAR_ROUTERS)
def test_autocast_precision_computes_the_selection_product_in_the_autocast_dtype(name):
    router, k = ROUTERS[name]
    torch.manual_seed(0)
    layer = MoE(MoEConfig(d_model=12, num_experts=E, expert_size=6, k=k,
                          router=dataclasses.replace(router, precision="autocast"))).eval()
    weight = layer.router.weight
    x = torch.randn(16, 12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = layer.router.logits(x)
        y = layer(x)
    assert logits.dtype == torch.float32 and y.dtype == torch.bfloat16
    # the product of the bf16-rounded operands, rounded to bf16, as nn.Linear under autocast
    want = F.linear(x.bfloat16(), weight.bfloat16()).float()
    torch.testing.assert_close(logits, want, rtol=0, atol=0)
    full = F.linear(x, weight)
    assert not torch.equal(logits, full)    # the default float32 product differs ...
    with torch.autocast("cpu", dtype=torch.bfloat16):
        default = MoE(dataclasses.replace(layer.config, router=router)).router
        default.load_state_dict(layer.router.state_dict())
        torch.testing.assert_close(default.logits(x), full, rtol=1e-6, atol=1e-6)   # ... it is fp32
    # outside autocast the product runs in the weight's dtype (a pure-bf16 module)
    layer.bfloat16()
    out = layer.router.logits(x)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.bfloat16(), weight.bfloat16()).float(),
                               rtol=0, atol=0)


def test_hard_gate_weights_are_exactly_one_with_the_sigmoid_gradient():
    """MoEfication's gate (Zhang et al. 2022): selected experts count fully, and the scores
    still learn through a straight-through sigmoid."""
    torch.manual_seed(0)
    router = build_router(SigmaRouterConfig(gate="hard"), 6, E, 3)
    x = torch.randn(11, 6)
    routing = router(x)
    assert torch.equal(routing.weights, torch.ones(11, 3))
    logits = router.logits(x).detach().requires_grad_()
    indices = routing.indices
    torch.sigmoid(logits.gather(1, indices)).sum().backward()
    got = torch.autograd.grad(routing.weights.sum(), router.weight)[0]      # [E, d_model]
    torch.testing.assert_close(got, logits.grad.t() @ x)


def test_router_precision_is_checked_and_round_trips():
    with pytest.raises(ValueError, match="precision must be one of 'float32', 'autocast'"):
        SigmaRouterConfig(precision="bf16")
    config = MoEConfig(d_model=8, num_experts=4, expert_size=2, k=2,
                       router=SigmaRouterConfig(precision="autocast"))
    assert config_from_dict(config.to_dict()) == config


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_usage_statistics_count_the_dispatched_pairs(name):
    layer = _layer(name).train()
    x = torch.randn(40, 12)
    layer(x)
    stats = sparseffn.routing_stats(layer)["<root>"]
    k = ROUTERS[name][1]
    dropped = stats.get("dropped_fraction")
    if name in ("switch",):
        assert stats["counts"].sum().item() == round(40 * (1 - dropped.item()))
    elif name != "gshard":
        assert stats["counts"].sum().item() == 40 * k
    assert stats["usage_counts"].sum().item() == stats["counts"].sum().item()


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_usage_statistics_are_the_dispatched_pairs_of_each_expert(name):
    layer = _layer(name).train()
    seen, route = [], layer.route
    layer.route = lambda x: seen.append(route(x)) or seen[-1]
    layer(torch.randn(40, 12))
    (routing,) = seen
    kept = torch.ones_like(routing.indices, dtype=torch.bool) if routing.dispatched is None \
        else routing.dispatched
    stats = layer.routing_stats
    assert stats["counts"].dtype == stats["mass"].dtype == torch.float32
    assert not stats["mass"].requires_grad
    assert stats["counts"].tolist() == torch.bincount(
        routing.indices[kept], minlength=layer.num_experts).float().tolist()
    want_mass = torch.zeros(layer.num_experts).index_add_(
        0, routing.indices[kept], routing.weights.detach()[kept].float())
    torch.testing.assert_close(stats["mass"], want_mass)


def test_a_moe_forward_sorts_its_pairs_once_and_counts_them_from_that_sort():
    from sparseffn.bench.op_count import OpCounter
    layer = _layer("sigma").train()
    with OpCounter() as counter:
        layer(torch.randn(40, 12))
    ops = counter.counts.by_name
    assert ops["aten.sort"] == 1                  # the dispatch plan's
    assert ops["aten.index_add_"] == 1            # the selection mass; counts from the plan


# --- capacity (Switch, GShard) ---------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 60), experts=st.integers(1, 9),
       capacity_factor=st.floats(0.1, 2.0), seed=st.integers(0, 2**16))
def test_switch_never_exceeds_capacity_and_drops_in_token_order(tokens, experts,
                                                                 capacity_factor, seed):
    torch.manual_seed(seed)
    router = build_router(SwitchRouterConfig(capacity_factor=capacity_factor), 6, experts, 1)
    x = torch.randn(tokens, 6) * 3
    routing = router(x)
    capacity = max(1, math.ceil(capacity_factor * tokens / experts))
    kept = routing.dispatched if routing.dispatched is not None else \
        torch.ones(tokens, 1, dtype=torch.bool)
    counts = torch.bincount(routing.indices[kept], minlength=experts)
    assert int(counts.max()) <= capacity
    assert torch.all(routing.weights[~kept] == 0)
    for e in range(experts):   # the first `capacity` tokens choosing e are the kept ones
        chosen = (routing.indices[:, 0] == e).nonzero().flatten()
        assert torch.equal(kept[chosen, 0], torch.arange(len(chosen)) < capacity)
    assert routing.stats["dropped_fraction"].item() == pytest.approx(1 - kept.float().mean().item())


@pytest.mark.parametrize("capacity_factor", [0, 0.0, None])
def test_capacity_factor_zero_or_none_is_dropless(capacity_factor):
    router = build_router(SwitchRouterConfig(capacity_factor=capacity_factor), 6, 4, 1)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[0, 0] = 10.0      # every token prefers expert 0
    routing = router(torch.ones(50, 6))
    assert routing.dispatched is None and torch.all(routing.indices == 0)
    assert routing.stats["dropped_fraction"].item() == 0
    gshard = build_router(GShardRouterConfig(capacity_factor=capacity_factor,
                                             second_expert="all"), 6, 4, 2)
    assert gshard(torch.randn(50, 6)).dispatched is None


def _crowded_layer(router, k, tokens=40):
    """A layer whose router sends every token with x0 > 0 to expert 3 first (and expert 5
    second), and ``tokens`` inputs that all have x0 > 0: at capacity factor 1 most tokens are
    dropped in training."""
    torch.manual_seed(0)
    layer = MoE(MoEConfig(d_model=12, num_experts=E, expert_size=6, k=k, router=router))
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[3, 0] = 5.0
        layer.router.weight[5, 0] = 4.0
    x = torch.randn(tokens, 12)
    x[:, 0] = x[:, 0].abs() + 1
    return layer, x


CAPACITY_ROUTERS = {"switch": (SwitchRouterConfig(capacity_factor=1.0), 1),
                    "gshard": (GShardRouterConfig(capacity_factor=1.0, second_expert="all"), 2)}


@pytest.mark.parametrize("name", sorted(CAPACITY_ROUTERS))
def test_evaluation_is_dropless_by_default_so_a_token_does_not_depend_on_its_batch(name):
    router, k = CAPACITY_ROUTERS[name]
    layer, x = _crowded_layer(router, k)
    trained = layer.train()(x)
    assert bool((trained == 0).all(-1).any()), "training drops tokens at capacity"
    layer.eval()
    with torch.no_grad():
        whole = layer(x)
        one_by_one = torch.cat([layer(x[i:i + 1]) for i in range(len(x))])
    assert layer.router(x).dispatched is None
    assert bool((whole != 0).any(-1).all()), "no token is dropped at evaluation"
    torch.testing.assert_close(whole, one_by_one, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(CAPACITY_ROUTERS))
def test_eval_capacity_factor_applies_capacity_at_evaluation(name):
    router, k = CAPACITY_ROUTERS[name]
    layer, x = _crowded_layer(dataclasses.replace(router, eval_capacity_factor=1.0), k)
    with torch.no_grad():
        trained = layer.train()(x)
        evaluated = layer.eval()(x)
    torch.testing.assert_close(evaluated, trained)   # no jitter, dropout or sampling here
    assert layer.routing_stats["capacity"].item() == math.ceil(1.0 * k * 40 / E)
    roomy, _ = _crowded_layer(dataclasses.replace(router, capacity_factor=None,
                                                  eval_capacity_factor=1.0), k)
    roomy.train()(x)
    assert roomy.routing_stats["dropped_fraction"].item() == 0, "dropless in training"
    roomy.eval()(x)
    assert roomy.routing_stats["dropped_fraction"].item() > 0, "capacity at evaluation"


def test_dropped_tokens_produce_zero_output():
    layer, x = _crowded_layer(ROUTERS["switch"][0], 1, tokens=64)   # all pick expert 3
    y = layer.train()(x)
    capacity = math.ceil(1.0 * 64 / E)
    assert torch.all(y[capacity:] == 0) and torch.all(y[:capacity].abs().sum(-1) > 0)
    assert layer.routing_stats["dropped_fraction"].item() == pytest.approx(1 - capacity / 64)
    (y.sum()).backward()
    assert torch.all(layer.store.w1.grad[:3] == 0)   # only expert 3 computed anything


def _gshard_algorithm1(gates, group_size, capacity, uniform):
    """GShard (Lepikhin et al.) Algorithm 1, line by line, one group at a time (the slow reference)."""
    T, num_experts = gates.shape
    combine = torch.zeros(T, num_experts)
    aux_terms = []
    for start in range(0, T, group_size):
        group = range(start, min(start + group_size, T))
        S = len(group)
        c = [0] * num_experts                                                   # (1)
        m = gates[start:start + S].mean(0)                                      # (3)
        for s in group:                                                         # (4)
            top = torch.topk(gates[s], 2)
            g1, e1, g2, e2 = top.values[0], int(top.indices[0]), top.values[1], int(top.indices[1])
            g1 = g1 / (g1 + g2)                                                 # (6)
            pos = c[e1]                                                         # (7)
            if c[e1] < capacity:                                                # (8)
                combine[s, e1] = g1                                             # (9)
            c[e1] = pos + 1                                                     # (11)
        aux_terms.append(sum(c[e] / S * m[e] for e in range(num_experts)) / num_experts)  # (13)
        for s in group:                                                         # (14)
            top = torch.topk(gates[s], 2)
            g1, e1, g2, e2 = top.values[0], int(top.indices[0]), top.values[1], int(top.indices[1])
            g2 = g2 / (g1 + g2)                                                 # (16)
            rnd = uniform[s]                                                    # (17)
            pos = c[e2]                                                         # (18)
            if pos < capacity and 2 * g2 > rnd:                                 # (19)
                combine[s, e2] = g2                                             # (20)
            c[e2] = pos + 1                                                     # (22)
    return combine, torch.stack(aux_terms).mean()


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), experts=st.integers(2, 7), group_size=st.integers(1, 16),
       capacity=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_gshard_matches_algorithm_1_step_by_step(tokens, experts, group_size, capacity, seed):
    generator = torch.Generator().manual_seed(seed)
    gates = torch.softmax(torch.randn(tokens, experts, generator=generator) * 2, -1)
    gates.requires_grad_()
    uniform = torch.rand(tokens, generator=generator)
    result = gshard_top2(gates, group_size, capacity, uniform)
    want_combine, want_aux = _gshard_algorithm1(gates, group_size, capacity, uniform)
    got = torch.zeros(tokens, experts).scatter_add_(1, result.indices, result.combine)
    torch.testing.assert_close(got, want_combine)
    torch.testing.assert_close(result.aux_loss, want_aux)
    # ℓ_aux's gradient too (line 13: through the mean gates m, the counts c carry none)
    got_grad, = torch.autograd.grad(result.aux_loss, gates)
    want_grad, = torch.autograd.grad(want_aux, gates)
    torch.testing.assert_close(got_grad, want_grad)
    # No expert's buffer in any group holds more than C dispatched tokens.
    group = torch.arange(tokens) // group_size
    keys = (group.unsqueeze(1) * experts + result.indices)[result.dispatched]
    assert int(torch.bincount(keys).max()) <= capacity
    # Without ℓ_aux (inference): the same assignment, and no loss.
    bare = gshard_top2(gates, group_size, capacity, uniform, aux=False)
    assert bare.aux_loss is None
    for field in ("indices", "combine", "dispatched", "positions"):
        torch.testing.assert_close(getattr(bare, field), getattr(result, field), msg=field)


@pytest.mark.parametrize("group_size", [None, 5])
@pytest.mark.parametrize("training", [True, False], ids=["train_all_dropless", "eval"])
def test_gshard_where_nothing_can_drop_routes_as_algorithm_1(training, group_size):
    """Where nothing can drop a pair (evaluation, dropless by default; or training with
    ``second_expert="all"`` and no capacity) the router computes no buffer positions. Its
    combine weights, aux loss and the loss's gradient are Algorithm 1's with unlimited
    capacity. Its statistics say nothing was dropped, and every pair is dispatched."""
    config = GShardRouterConfig(capacity_factor=None if training else 1.0,
                                group_size=group_size, second_expert="all")
    router = build_router(config, 6, 5, 2).train(training)
    x = torch.randn(13, 6)
    routing = router(x)
    gates = torch.softmax(router.logits(x), -1)
    want_combine, want_aux = _gshard_algorithm1(gates, group_size or 13, math.inf,
                                                torch.zeros(13))
    got = torch.zeros(13, 5).scatter_add_(1, routing.indices, routing.weights)
    torch.testing.assert_close(got, want_combine)
    aux = routing.aux_losses["gshard"]
    torch.testing.assert_close(aux, want_aux)
    torch.testing.assert_close(torch.autograd.grad(aux, router.weight),
                               torch.autograd.grad(want_aux, router.weight))
    assert routing.dispatched is None
    assert {name: value.item() for name, value in routing.stats.items()} == {
        "dropped_fraction": 0.0, "first_dropped_fraction": 0.0, "second_dispatched_fraction": 1.0}
    empty = router(torch.randn(0, 6))
    assert empty.indices.shape == (0, 2) and empty.stats["second_dispatched_fraction"] == 0


def test_gshard_second_expert_is_sampled_in_proportion_to_2_g2():
    router = build_router(GShardRouterConfig(capacity_factor=None), 4, 4, 2).train()
    x = torch.randn(4000, 4)
    torch.manual_seed(5)
    routing = router(x)
    g1, g2 = routing.weights[:, 0], routing.weights[:, 1]   # g1 is never dropped here
    logits = x @ router.weight.t()
    top = torch.topk(torch.softmax(logits, -1), 2).values
    p_second = (2 * top[:, 1] / top.sum(-1)).clamp(max=1)
    dispatched = routing.dispatched[:, 1].float()
    assert abs(dispatched.mean().item() - p_second.mean().item()) < 0.03
    assert torch.all(g2[routing.dispatched[:, 1]] > 0) and torch.all(g1 > 0)
    router.eval()
    assert router(x).dispatched is None   # at evaluation every second choice that fits goes


def test_positions_in_expert_counts_earlier_pairs_of_the_same_group():
    experts = torch.tensor([1, 0, 1, 1, 0, 2])
    groups = torch.tensor([0, 0, 0, 1, 1, 1])
    assert positions_in_expert(experts, 3).tolist() == [0, 0, 1, 2, 1, 0]
    assert positions_in_expert(experts, 3, groups).tolist() == [0, 0, 1, 0, 0, 0]


def _positions_by_counting(experts, groups):
    seen, out = {}, []
    for e, g in zip(experts.tolist(), groups.tolist()):
        out.append(seen.get((g, e), 0))
        seen[(g, e)] = out[-1] + 1
    return out


@pytest.mark.parametrize("num_experts", [1, 7, 2 ** 31])   # the last: keys too wide for int32
def test_positions_in_expert_match_counting_in_order(num_experts):
    torch.manual_seed(0)
    experts = torch.randint(0, min(num_experts, 7), (301,))
    groups = torch.arange(301) // 40
    assert positions_in_expert(experts, num_experts, groups).tolist() == \
        _positions_by_counting(experts, groups)
    assert positions_in_expert(experts, num_experts, groups, num_groups=8).tolist() == \
        _positions_by_counting(experts, groups)
    assert positions_in_expert(experts, num_experts).tolist() == \
        _positions_by_counting(experts, torch.zeros_like(groups))
    assert positions_in_expert(experts[:0], num_experts).tolist() == []


# --- auxiliary losses against hand-computed values -------------------------------------

def test_switch_balance_loss_by_hand():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.6, 0.3, 0.1], [0.1, 0.1, 0.8], [0.2, 0.5, 0.3]])
    top1 = probs.argmax(-1)                       # experts 0, 0, 2, 1
    f = [2 / 4, 1 / 4, 1 / 4]
    p = [(0.7 + 0.6 + 0.1 + 0.2) / 4, (0.2 + 0.3 + 0.1 + 0.5) / 4, (0.1 + 0.1 + 0.8 + 0.3) / 4]
    want = 3 * sum(a * b for a, b in zip(f, p))
    assert switch_balance_loss(probs, top1).item() == pytest.approx(want)
    uniform = torch.full((6, 3), 1 / 3)
    assert switch_balance_loss(uniform, torch.tensor([0, 1, 2, 0, 1, 2])).item() == \
        pytest.approx(1.0)


def test_switch_balance_loss_and_its_gradient_equal_eq_29_to_31_with_counted_fractions():
    torch.manual_seed(0)
    logits = torch.randn(53, 7, requires_grad=True)
    probs = torch.softmax(logits, -1)
    top1 = probs.detach().argmax(-1)
    fraction = torch.bincount(top1, minlength=7).float() / 53                    # Eq. 29
    want = 7 * (fraction * probs.mean(0)).sum()                                   # Eq. 30-31
    got = switch_balance_loss(probs, top1)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(torch.autograd.grad(got, logits, retain_graph=True)[0],
                               torch.autograd.grad(want, logits)[0])


def test_z_loss_and_cv_by_hand():
    logits = torch.tensor([[0.0, 0.0], [1.0, -1.0]])
    want = (math.log(2) ** 2 + math.log(math.e + math.exp(-1)) ** 2) / 2
    assert router_z_loss(logits).item() == pytest.approx(want)
    values = torch.tensor([1.0, 2.0, 3.0, 6.0])
    mean, var = 3.0, (4 + 1 + 0 + 9) / 4
    assert cv_squared(values).item() == pytest.approx(var / mean ** 2)
    assert cv_squared(torch.ones(5)).item() == 0


def test_noisy_topk_losses_by_hand():
    router = build_router(NoisyTopKRouterConfig(), 3, 4, 2).train()
    x = torch.randn(5, 3)
    torch.manual_seed(7)
    routing = router(x)
    torch.manual_seed(7)
    clean = x @ router.weight.t()
    std = F.softplus(x @ router.noise_weight.t()) + 0.01
    noisy = clean + torch.randn(5, 4) * std
    top = torch.topk(noisy, 2)
    torch.testing.assert_close(routing.indices, top.indices)
    torch.testing.assert_close(routing.weights, torch.softmax(top.values, -1))
    importance = torch.zeros(4)
    load = torch.zeros(4)
    normal = torch.distributions.Normal(0.0, 1.0)
    for t in range(5):
        for j in range(2):
            importance[top.indices[t, j]] += routing.weights[t, j]
        for e in range(4):   # P(expert e stays in the top 2 with fresh noise)
            others = torch.cat([noisy[t, :e], noisy[t, e + 1:]])
            threshold = torch.topk(others, 2).values[1]
            load[e] += normal.cdf((clean[t, e] - threshold) / std[t, e])
    torch.testing.assert_close(routing.aux_losses["importance"], cv_squared(importance))
    torch.testing.assert_close(routing.aux_losses["load"], cv_squared(load))
    torch.testing.assert_close(noisy_topk_load(clean, noisy, std, 2), load)


def test_noisy_topk_takes_one_top_k_for_gating_and_load_and_counts_load_in_evaluation():
    from sparseffn.bench.op_count import OpCounter
    router = build_router(NoisyTopKRouterConfig(), 3, 6, 2).train()
    x = torch.randn(30, 3)
    with OpCounter() as counter:
        router(x)
    assert counter.counts.by_name["aten.topk"] == 1   # the (k+1)-th also sets the threshold
    routing = router.eval()(x)
    load = torch.bincount(routing.indices.reshape(-1), minlength=6).float()
    torch.testing.assert_close(routing.aux_losses["load"], cv_squared(load))
    assert cv_squared(torch.tensor([[1.0, 3.0], [2.0, 2.0]])).tolist() == [0.25, 0.0]


def test_noisy_topk_sums_importance_and_load_over_the_global_batch_in_one_call():
    from sparseffn.losses import BatchSum

    class OtherProcessAddsOne(BatchSum):     # another process's sums: 1 for every expert
        shapes = []

        def sum(self, values):
            OtherProcessAddsOne.shapes.append(tuple(values.shape))
            return values + 1

    router = build_router(NoisyTopKRouterConfig(), 3, 6, 2).eval()
    router.global_batch = OtherProcessAddsOne()
    routing = router(torch.randn(30, 3))
    assert OtherProcessAddsOne.shapes == [(2, 6)]
    flat = routing.indices.reshape(-1)
    importance = torch.zeros(6).index_add_(0, flat, routing.weights.reshape(-1))
    load = torch.bincount(flat, minlength=6).float()
    torch.testing.assert_close(routing.aux_losses["importance"], cv_squared(importance + 1))
    torch.testing.assert_close(routing.aux_losses["load"], cv_squared(load + 1))


@pytest.mark.parametrize("name", ["sigma", "softmax", "noisy_topk", "switch", "sbase", "tree"])
def test_routers_sum_over_the_global_batch_only_where_their_aux_losses_can_train(name):
    """With global batch statistics the aux losses add every process's sums: a collective per
    layer (expert parallelism). In evaluation without autograd (inference) a router computes
    no aux losses, so it joins no such collective; in training, with autograd, or inside
    ``computing_aux_losses`` it does."""
    from sparseffn.losses import BatchSum

    class Counting(BatchSum):
        calls = 0

        def sum(self, values):
            Counting.calls += 1
            return values

    config, k = ROUTERS[name]
    router = build_router(config, 3, E, k)
    router.global_batch = Counting()
    x = torch.randn(30, 3)

    def calls_of_one_forward():
        before = Counting.calls
        router(x)
        return Counting.calls - before

    assert calls_of_one_forward() >= 1                    # training
    router.eval()
    assert calls_of_one_forward() >= 1                    # evaluation with autograd
    with torch.no_grad():
        assert calls_of_one_forward() == 0                # inference
        with sparseffn.computing_aux_losses(router):
            assert calls_of_one_forward() >= 1


def test_noisy_topk_has_no_noise_at_evaluation():
    router = build_router(NoisyTopKRouterConfig(), 3, 4, 2).eval()
    x = torch.randn(9, 3)
    routing = router(x)
    top = torch.topk(x @ router.weight.t(), 2)
    torch.testing.assert_close(routing.weights, torch.softmax(top.values, -1))


# --- S-BASE ----------------------------------------------------------------------------

def test_sinkhorn_plan_is_balanced_and_its_assignment_nearly_so():
    from sparseffn.ops.assignment import sinkhorn_log_plan
    torch.manual_seed(0)
    tokens, experts = 1024, 8
    logits = torch.randn(tokens, experts) + torch.linspace(0, 3, experts)   # skewed preference
    plan = sinkhorn_log_plan(logits, 30).exp()
    torch.testing.assert_close(plan.sum(1), torch.ones(tokens))
    torch.testing.assert_close(plan.sum(0), torch.full((experts,), tokens / experts), rtol=1e-3,
                               atol=1e-3)
    router = build_router(SBaseRouterConfig(sinkhorn_iterations=30), 6, experts, 1).train()
    with torch.no_grad():
        router.weight.copy_(torch.randn(experts, 6))
        router.weight[-1] += 2.0     # a popular expert
    x = torch.randn(tokens, 6).abs()
    balanced = torch.bincount(router(x).indices.flatten(), minlength=experts).float()
    greedy = torch.bincount((x @ router.weight.t()).argmax(-1), minlength=experts).float()
    share = tokens / experts
    # The plan is balanced; its per-token top-1 only nearly so, where plain top-1 piles
    # almost every token onto the popular expert.
    assert 0.4 < balanced.min() / share and balanced.max() / share < 1.4
    assert greedy.max() / share > 4
    assert router(x).stats["max_load"].item() == pytest.approx(balanced.max().item() / share)


def test_exact_assignment_is_optimal_and_exactly_balanced():
    from itertools import combinations, product

    from sparseffn.ops.assignment import exact_balanced_assignment
    torch.manual_seed(1)
    for tokens, experts, k in [(6, 3, 1), (4, 4, 2), (5, 3, 2)]:
        scores = torch.rand(tokens, experts)
        got = exact_balanced_assignment(scores, k)
        capacity = math.ceil(tokens * k / experts)
        assert torch.bincount(got.flatten(), minlength=experts).max() <= capacity
        assert all(len(set(row.tolist())) == k for row in got)
        best = -1.0   # brute force over every choice of k experts per token
        for choice in product(list(combinations(range(experts), k)), repeat=tokens):
            counts = torch.bincount(torch.tensor(choice).flatten(), minlength=experts)
            if counts.max() <= capacity:
                best = max(best, sum(scores[t, list(c)].sum().item() for t, c in enumerate(choice)))
        assert scores.gather(1, got).sum().item() == pytest.approx(best, abs=1e-5)


@pytest.mark.parametrize("rounding,max_load", [("topk", 1.35), ("capacity", 1.0)])
def test_sbase_balances_only_in_training_and_weights_by_sigmoid(rounding, max_load):
    torch.manual_seed(0)
    router = build_router(SBaseRouterConfig(rounding=rounding), 6, 4, 1)
    with torch.no_grad():
        router.weight[0] += 3.0
    x = torch.randn(200, 6).abs()
    logits = x @ router.weight.t()
    router.eval()
    routing = router(x)
    assert torch.equal(routing.indices, torch.topk(logits, 1).indices)
    torch.testing.assert_close(routing.weights, torch.sigmoid(logits.gather(1, routing.indices)))
    # the balance statistic is the assignment's: none (and no dispatch plan) at evaluation
    assert "max_load" not in routing.stats and routing.built_plan(4) is None
    router.train()
    trained = router(x)
    load = torch.bincount(trained.indices.flatten(), minlength=4).float()
    assert load.max() / (200 / 4) <= max_load
    assert trained.stats["max_load"].item() == pytest.approx(load.max().item() / (200 / 4))
    torch.testing.assert_close(trained.weights, torch.sigmoid(logits.gather(1, trained.indices)))


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 80), experts=st.integers(1, 8), k=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_capacity_rounding_gives_distinct_experts_within_capacity(tokens, experts, k, seed):
    from sparseffn.ops.assignment import capacity_rounding
    k = min(k, experts)
    generator = torch.Generator().manual_seed(seed)
    scores = torch.randn(tokens, experts, generator=generator) + \
        torch.linspace(0, 2, experts)
    indices = capacity_rounding(scores, k)
    assert indices.shape == (tokens, k)
    assert all(len(set(row)) == k for row in indices.tolist())
    load = torch.bincount(indices.flatten(), minlength=experts)
    capacity = math.ceil(tokens * k / experts)
    if k == 1:   # always feasible by deferred acceptance
        assert int(load.max()) <= capacity
    else:
        assert int(load.max()) <= capacity + tokens // 4 + 1
    # k = 1: every token got its best expert unless it filled with higher-scoring tokens.
    best = scores.argmax(-1)
    for t in range(tokens if k == 1 else 0):
        if best[t] not in indices[t]:
            holders = (indices == best[t]).any(-1)
            assert int(holders.sum()) >= capacity
            assert scores[holders, best[t]].min() >= scores[t, best[t]]


# --- inits, dropout choices ------------------------------------------------------------

def test_switch_initialisation_is_sqrt_point1_over_fan_in():
    layer = MoE(MoEConfig(d_model=256, num_experts=8, expert_size=128, k=1, router="switch",
                          init="switch"))
    for weight, fan_in in ((layer.store.w1, 256), (layer.store.w2, 128), (layer.router.weight, 256)):
        want = math.sqrt(0.1 / fan_in) * 0.8796   # std of N(0, σ) truncated at ±2σ
        assert abs(weight.std().item() - want) < 0.03 * want


def test_switch_offers_expert_dropout_or_high_dropout_inside_experts():
    x = torch.randn(64, 12)
    for kwargs, router in (({"hidden_dropout": 0.4}, SwitchRouterConfig()),
                           ({}, SwitchRouterConfig(expert_dropout=0.5))):
        torch.manual_seed(0)
        layer = MoE(MoEConfig(d_model=12, num_experts=E, expert_size=6, k=1, router=router,
                              **kwargs))
        layer.eval()
        a, b = layer(x), layer(x)
        torch.testing.assert_close(a, b)
        layer.train()
        assert not torch.allclose(layer(x), a)
    # Expert dropout changes which expert is chosen, never rescales the weight (Eq. 36).
    router = build_router(SwitchRouterConfig(capacity_factor=None, expert_dropout=0.5), 12, E, 1)
    routing = router.train()(x)
    probs = torch.softmax(x @ router.weight.t(), -1)
    torch.testing.assert_close(routing.weights, probs.gather(1, routing.indices))
    assert (routing.indices[:, 0] != probs.argmax(-1)).any()


# --- every router trains ---------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_fits_a_regression_task(name):
    torch.manual_seed(0)
    d = 8
    teacher = torch.nn.Sequential(torch.nn.Linear(d, 32), torch.nn.Tanh(), torch.nn.Linear(32, d))
    x = torch.randn(512, d)
    with torch.no_grad():
        y = teacher(x)
    layer = _layer(name, d_model=d, expert_size=16)
    optimiser = torch.optim.Adam(layer.parameters(), lr=1e-2)
    baseline = (y - y.mean(0)).square().mean().item()   # the best constant prediction
    for _ in range(150):
        loss = (layer(x) - y).square().mean()
        optimiser.zero_grad()
        (loss + sparseffn.aux_loss(layer)).backward()
        optimiser.step()
    layer.eval()
    with torch.no_grad():
        final = (layer(x) - y).square().mean().item()
    assert final < 0.35 * baseline, (final, baseline)


def test_a_moe_with_its_router_is_one_toml_table():
    import tomllib
    text = """
    type = "moe"
    d_model = 16
    num_experts = 8
    expert_size = 4
    k = 2
    init = "switch"
    [router]
    type = "gshard"
    capacity_factor = 1.5
    group_size = 64
    """
    cfg = config_from_dict(tomllib.loads("\n".join(line.strip() for line in text.splitlines())))
    assert cfg.router == GShardRouterConfig(capacity_factor=1.5, group_size=64)
    layer = sparseffn.build_layer(cfg)
    assert isinstance(layer.router, sparseffn.routers.GShardRouter)
    assert layer(torch.randn(3, 16)).shape == (3, 16)


def test_product_key_router_in_a_moe_checks_its_layer():
    from sparseffn.routers import ProductKeyRouterConfig
    with pytest.raises(ValueError, match="square"):
        MoE(MoEConfig(d_model=8, num_experts=10, expert_size=4, k=2,
                      router=ProductKeyRouterConfig(heads=1, key_dim=4)))
    with pytest.raises(ValueError, match="multiple of heads"):
        MoE(MoEConfig(d_model=8, num_experts=16, expert_size=4, k=3,
                      router=ProductKeyRouterConfig(heads=2, key_dim=4)))
    with pytest.raises(ValueError, match="key_dim must be even"):
        ProductKeyRouterConfig(key_dim=5)
    with pytest.raises(ValueError, match="key_dim must equal d_model"):
        MoE(MoEConfig(d_model=8, num_experts=16, expert_size=4, k=2,
                      router=ProductKeyRouterConfig(query="identity", key_dim=4)))
    layer = MoE(MoEConfig(d_model=8, num_experts=16, expert_size=4, k=4,
                          router={"type": "product_keys", "heads": 2, "key_dim": 4}))
    routing = layer.router(torch.randn(6, 8))
    assert routing.indices.shape == (6, 4) and int(routing.indices.max()) < 16
    assert layer.config.cost().total_params == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("tokens", [5, 511, 512])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("depth", [3, 6, 12])
def test_tree_node_logits_padded_or_not_are_the_linear_map(tokens, bias, depth, monkeypatch):
    """From depth 4 the node logits come from a GEMM with the weight padded to 2^d rows from
    512 tokens on, and from the plain GEMM below: the same map and gradients either way."""
    from sparseffn.routers.tree import TreeRouter
    router = TreeRouter(TreeRouterConfig(bias=bias), 16, 1 << depth, 2)
    pads = []
    pad = F.pad
    monkeypatch.setattr(F, "pad", lambda *args, **kw: pads.append(1) or pad(*args, **kw))
    x = torch.randn(tokens, 16, requires_grad=True)
    z = router.node_logits(x)
    assert bool(pads) == (depth >= 4 and tokens >= 512)
    ref = F.linear(x, router.weight, router.bias)
    assert z.shape == (tokens, (1 << depth) - 1)
    torch.testing.assert_close(z, ref)
    g = torch.randn_like(ref)
    params = [x, router.weight] + ([router.bias] if bias else [])
    for a, b in zip(torch.autograd.grad((z * g).sum(), params),
                    torch.autograd.grad((ref * g).sum(), params)):
        torch.testing.assert_close(a, b)
