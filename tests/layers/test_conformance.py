"""What every registered layer and router owes its users, checked from the registries.

Each registered layer config type and each registered router gets an example here; a new
registration without one fails :func:`test_every_registration_has_an_example`. Each expert
store class gets a loop reference; a layer built on a store without one fails
:func:`test_output_and_gradients_match_the_store_reference`. Then every example is checked
for: drop-in shapes (empty batches too), ``cost()`` equal to the parameter count, aux losses
all weighted, config round trip, output and every gradient against the loop reference (the
layer's own routing fed to a per-token loop over the selected experts), deepcopy and
``AveragedModel`` after a training forward, pickling, both activation-checkpointing modes
(no lost aux-loss gradient, no double-counted usage), ``inference_mode`` then a training
forward, meta-device construction then ``reset_parameters``, state-dict round trip, and
``torch.compile(fullgraph=True)``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import pickle
import weakref

import pytest
import torch
from torch.nn import functional as F
from torch.utils.checkpoint import checkpoint

import sparseffn
from sparseffn import (DenseMLPConfig, FFFConfig, MoEConfig, PEERConfig, PKMConfig,
                       SigmaMoEConfig, TopKMLPConfig, build_layer, config_from_dict)
from sparseffn.config import LayerConfig
from sparseffn.router_config import (DenseGateRouterConfig, ExpertChoiceRouterConfig,
                                     GShardRouterConfig,
                                     HierarchicalRouterConfig, NoisyTopKRouterConfig,
                                     RouterConfig, SBaseRouterConfig, SigmaRouterConfig,
                                     SoftmaxRouterConfig, SwitchRouterConfig, TreeRouterConfig)
from sparseffn.routers import ProductKeyRouterConfig
from sparseffn.routing import RoutedFFN
from sparseffn.stores import MLPExperts, NeuronExperts, ValueRows
from tests.conftest import native_or_torch
from tests.device_spy import made_off_device, off_device

D = 12


def _moe(router, k=2, num_experts=5):
    return MoEConfig(d_model=D, num_experts=num_experts, expert_size=6, k=k, router=router)


# One example per registered layer type ...
LAYER_EXAMPLES = {
    "dense": DenseMLPConfig(d_model=D, d_ff=20),
    "topk": TopKMLPConfig(d_model=D, d_ff=20, k=5),
    "sigma_moe": SigmaMoEConfig(d_model=D, num_experts=5, expert_size=6, k=2),
    "moe": _moe(SoftmaxRouterConfig()),
    "fff": FFFConfig(d_model=D, depth=2, leaf_width=4),
    "pkm": PKMConfig(d_model=D, num_subkeys=4, heads=2, k=3, query="linear", key_dim=6),
    "peer": PEERConfig(d_model=D, num_experts=16, heads=2, k=3, key_dim=6,
                       query_norm="batchnorm"),
}
# ... and per registered router, the MoE layer that uses it.
ROUTER_EXAMPLES = {
    "sigma": _moe(SigmaRouterConfig()),
    "softmax": _moe(SoftmaxRouterConfig(renormalize=True)),
    "noisy_topk": _moe(NoisyTopKRouterConfig()),
    "switch": _moe(SwitchRouterConfig(capacity_factor=1.0), k=1),     # drops some tokens
    "gshard": _moe(GShardRouterConfig(capacity_factor=1.0)),
    "sbase": _moe(SBaseRouterConfig()),
    # each token gets between 0 and 5 experts, 2 on average
    "expert_choice": _moe(ExpertChoiceRouterConfig()),
    "dense_softmax": _moe(DenseGateRouterConfig(), k=4, num_experts=4),
    "hierarchical": _moe(HierarchicalRouterConfig(), k=4, num_experts=4),
    "tree": _moe(TreeRouterConfig(), num_experts=4),
    "product_keys": _moe(ProductKeyRouterConfig(heads=2, key_dim=6), k=4, num_experts=16),
}
# Variants whose code paths differ: sparse FFF training, biased leaves off, product keys
# without a query network, PEER with sparse gradients and dropout, a converted dense MLP.
VARIANTS = {
    "fff_sparse": FFFConfig(d_model=D, depth=2, leaf_width=4, train_mode="sparse", k=2,
                            bias=False),
    # nodes of three neurons each; hard inference (greedy descent) in evaluation
    "fff_wide_nodes_hard": FFFConfig(d_model=D, depth=2, leaf_width=4, eval_mode="hard",
                                     router=TreeRouterConfig(node_width=3)),
    "pkm_identity_query": PKMConfig(d_model=D, num_subkeys=4, heads=1, k=3, key_dim=D,
                                    query="identity", query_norm="layernorm"),
    "peer_sparse_grad": PEERConfig(d_model=D, num_experts=16, heads=2, k=3, key_dim=6,
                                   sparse_grad=True, dropout=0.1),
    # what sparseffn.convert builds: MoEfication's hard gate, a dense MLP's biases
    "moe_converted": MoEConfig(d_model=D, num_experts=5, expert_size=6, k=2,
                               router=SigmaRouterConfig(gate="hard"), activation="gelu_tanh",
                               bias=True),
    # SwiGLU experts (Mixtral's; what sparseffn.convert builds from a Llama MLP)
    "moe_gated": MoEConfig(d_model=D, num_experts=5, expert_size=6, k=2, activation="silu",
                           gated=True),
    # DeepSeekMoE's shared experts beside the routed ones, gated
    "moe_shared": MoEConfig(d_model=D, num_experts=5, expert_size=6, k=2, shared_experts=2,
                            activation="silu", gated=True),
    "moe_gated_converted": MoEConfig(d_model=D, num_experts=5, expert_size=6, k=2,
                                     router=SigmaRouterConfig(gate="hard"), activation="silu",
                                     gated=True, bias=True),
}
EXAMPLES = {**{f"layer:{k}": v for k, v in LAYER_EXAMPLES.items()},
            **{f"router:{k}": v for k, v in ROUTER_EXAMPLES.items()},
            **{f"variant:{k}": v for k, v in VARIANTS.items()}}


def test_every_registration_has_an_example():
    assert set(LAYER_EXAMPLES) == set(LayerConfig._registry), \
        "register an example (and, for a new store, a reference) for each layer type"
    assert set(ROUTER_EXAMPLES) == set(RouterConfig._registry), \
        "register an example MoE config for each router"


# --- loop references, one per store ---------------------------------------------------------

def _mlp_experts_reference(store: MLPExperts, x, routing):
    act = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu,
           "gelu_tanh": lambda h: F.gelu(h, approximate="tanh"),
           "quick_gelu": lambda h: h * torch.sigmoid(1.702 * h)}[store.activation]
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(store.d_out)
        for j in range(routing.indices.shape[1]):
            if routing.dispatched is not None and not routing.dispatched[t, j]:
                continue
            e = int(routing.indices[t, j])
            h = store.w1[e] @ x[t] + (0 if store.b1 is None else store.b1[e])
            if store.w_gate is not None:   # a gated linear unit: act(Wg x) ⊙ (W1 x + b1)
                h = act(store.w_gate[e] @ x[t]) * h
            else:
                h = act(h)
            out = h @ store.w2[e] + (0 if store.b2 is None else store.b2[e])
            y = y + routing.weights[t, j].to(x.dtype) * out
        rows.append(y if store.b_out is None else y + store.b_out)
    return torch.stack(rows) if rows else x.new_zeros(0, store.d_out)


def _value_rows_reference(store: ValueRows, x, routing):
    rows = [sum((routing.weights[t, j] * store.values[int(routing.indices[t, j])]
                 for j in range(routing.indices.shape[1])), x.new_zeros(store.d_model))
            for t in range(x.shape[0])]
    return torch.stack(rows) if rows else x.new_zeros(0, store.d_model)


def _neuron_experts_reference(store: NeuronExperts, x, routing):
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(store.d_model)
        for j in range(routing.indices.shape[1]):
            i = int(routing.indices[t, j])
            y = y + routing.weights[t, j] * store.activation(store.w_in[i] @ x[t]) * store.w_out[i]
        rows.append(y)
    return torch.stack(rows) if rows else x.new_zeros(0, store.d_model)


STORE_REFERENCES = {MLPExperts: _mlp_experts_reference, ValueRows: _value_rows_reference,
                    NeuronExperts: _neuron_experts_reference}


def _dense_reference(layer, x):
    return layer.down(layer.activation(layer.up(x)))


def output_and_reference(layer, x):
    """The layer's output by the loop reference of its store, fed the layer's own routing
    (captured from the same forward, so noise and sampling agree)."""
    if not isinstance(layer, RoutedFFN):
        return layer(x), _dense_reference(layer, x)
    captured = []
    route = layer.route

    def spy(x2):
        captured.append(route(x2))
        return captured[-1]
    layer.route = spy
    try:
        y = layer(x)
    finally:
        del layer.route
    reference = STORE_REFERENCES[type(layer.store)]
    x_flat = x.reshape(-1, layer.d_model)
    want = reference(layer.store, x_flat, captured[0])
    shared = getattr(layer, "shared", None)
    if shared is not None:    # every token through every shared expert, with weight one
        every = torch.arange(shared.num_experts).expand(x_flat.shape[0], -1)
        want = want + _mlp_experts_reference(
            shared, x_flat, sparseffn.Routing(indices=every, weights=torch.ones(every.shape)))
    return y, want.reshape(y.shape)


# --- the checks ------------------------------------------------------------------------------

def _build(config, seed=0):
    torch.manual_seed(seed)
    return build_layer(config)


def _dense_grads(params):
    return [None if p.grad is None else (p.grad.to_dense() if p.grad.is_sparse else p.grad)
            for p in params]


params_of = lambda layer: [p for p in layer.parameters()]   # noqa: E731


@pytest.fixture(params=["native", "torch"])
def kernel_path(request):
    """The operators' C kernels, then their PyTorch implementations (what runs without a C
    compiler, in float64, and on a GPU without Triton)."""
    yield from native_or_torch(request)


@pytest.mark.parametrize("name", EXAMPLES)
def test_drop_in_shapes_and_empty_batches(name, kernel_path):
    layer = _build(EXAMPLES[name])
    d_out = getattr(EXAMPLES[name], "output_width", D)
    for mode in ("train", "eval"):
        layer.train(mode == "train")
        assert layer(torch.randn(2, 3, D)).shape == (2, 3, d_out)
        if mode == "eval" or getattr(EXAMPLES[name], "query_norm", None) != "batchnorm":
            assert layer(torch.randn(D)).shape == (d_out,)    # BatchNorm trains on >= 2 rows
        empty = torch.randn(0, D, requires_grad=True)
        y = layer(empty)
        assert y.shape == (0, d_out)
        (y.sum() + sparseffn.aux_loss(layer)).backward()
        assert empty.grad.shape == (0, D)
        assert layer(torch.randn(2, 0, D)).shape == (2, 0, d_out)
    with pytest.raises(ValueError, match="d_model"):
        layer(torch.randn(3, D + 1))


@pytest.mark.parametrize("name", EXAMPLES)
def test_cost_counts_every_parameter(name):
    layer = _build(EXAMPLES[name])
    assert EXAMPLES[name].cost().total_params == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("name", EXAMPLES)
def test_aux_losses_all_have_weights_and_config_round_trips(name):
    config = EXAMPLES[name]
    layer = _build(config).train()
    layer(torch.randn(9, D))
    assert set(layer.aux_losses) <= set(layer.aux_loss_weights)
    sparseffn.aux_loss(layer)            # raises for an unweighted loss
    assert config_from_dict(config.to_dict()) == config
    assert config_from_dict(json.loads(config.to_json())) == config


@pytest.mark.parametrize("name", EXAMPLES)
def test_aux_losses_are_skipped_only_where_nothing_can_train_on_them(name):
    """In evaluation mode without autograd (inference) a layer records no aux losses and gives
    the same output. With autograd, in training mode (also under ``no_grad``, as reentrant
    checkpointing's first forward runs) and inside ``computing_aux_losses`` it records them:
    in evaluation, the values of an evaluation forward with autograd (none for a tree in hard
    descent), in training, those of a training forward."""
    layer = _build(EXAMPLES[name]).train()
    x = torch.randn(9, D)
    layer(x)
    trained = set(layer.aux_losses)      # none for a soft tree: its aux loss is top-k's
    y = layer.eval()(x)
    want = {loss: value.detach() for loss, value in layer.aux_losses.items()}
    with torch.no_grad():
        torch.testing.assert_close(layer(x), y.detach())
        assert layer.aux_losses == {}
        assert sparseffn.aux_loss(layer).item() == 0.0
        with sparseffn.computing_aux_losses(layer):
            torch.testing.assert_close(layer(x), y.detach())
        torch.testing.assert_close(layer.aux_losses, want)
        layer(x)                                       # the block left the default behind
        assert layer.aux_losses == {}
        layer.train()(x)
        assert set(layer.aux_losses) == trained


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_every_tensor_a_forward_makes_is_on_the_inputs_device(name, training):
    """A tensor made without a device is a CPU tensor whatever the input's device, and stops
    CUDA graphs in a step compiled for a GPU (tests/device_spy.py). Checked for the
    operators of the forward and backward and for the statistics and aux losses the layer
    keeps."""
    layer = _build(EXAMPLES[name]).train(training)
    x = torch.randn(9, D, requires_grad=training)
    with made_off_device() as made:
        y = layer(x)
        if training:
            (y.sum() + sparseffn.aux_loss(layer)).backward()
    assert made == [] and off_device({**layer.routing_stats, **layer.aux_losses}) == {}


def _compiled_in_eval(name):
    """(the example layer in evaluation, it compiled (Dynamo, eager backend), an input)."""
    torch._dynamo.reset()
    layer = _build(EXAMPLES[name]).eval()
    return layer, torch.compile(layer, backend="eager", fullgraph=True), torch.randn(7, D)


@pytest.mark.parametrize("name", ["layer:sigma_moe", "router:switch"])
def test_a_compiled_layer_follows_computing_aux_losses_in_and_out(name):
    """Dynamo guards the rule: a compiled layer in evaluation records aux losses inside
    ``computing_aux_losses`` or with autograd, and none under ``no_grad`` before and after."""
    layer, compiled, x = _compiled_in_eval(name)
    recorded = []
    with torch.no_grad():
        compiled(x)
        recorded.append(set(layer.aux_losses))
        with sparseffn.computing_aux_losses(layer):
            compiled(x)
            recorded.append(set(layer.aux_losses))
        compiled(x)
        recorded.append(set(layer.aux_losses))
    compiled(x)
    recorded.append(set(layer.aux_losses))
    weighted = set(layer.aux_loss_weights)
    assert recorded == [set(), weighted, set(), weighted]


@pytest.mark.parametrize("name", EXAMPLES)
def test_no_usage_statistics_counts_nothing_and_changes_nothing_else(name):
    """Inside ``no_usage_statistics``, in training and in evaluation, a forward gives the same
    output and aux losses, leaves the accumulated usage as it was, and keeps only the
    router's own statistics (no ``counts``, ``mass`` or another of the layer's
    ``usage_stats``); after the block, forwards count again, each adding its ``counts`` and
    ``mass``."""
    layer = _build(EXAMPLES[name])
    x = torch.randn(9, D)
    for training in (True, False):
        layer.train(training)
        torch.manual_seed(0)
        y = layer(x)
        aux, stats = dict(layer.aux_losses), dict(layer.routing_stats)
        usage = _usage_buffers(layer)
        with sparseffn.no_usage_statistics(layer):
            torch.manual_seed(0)
            torch.testing.assert_close(layer(x), y)
            torch.testing.assert_close(layer.aux_losses, aux)
            assert set(layer.routing_stats) == set(stats) - set(layer.usage_stats)
            torch.testing.assert_close(_usage_buffers(layer), usage)
        layer(x)
        if hasattr(layer, "usage_counts"):
            assert set(layer.routing_stats) == set(stats)
            torch.testing.assert_close(_usage_buffers(layer), (
                usage[0] + layer.routing_stats["counts"], usage[1] + layer.routing_stats["mass"]))


def _usage_buffers(layer):
    return tuple(getattr(layer, name).clone() for name in ("usage_counts", "usage_mass")
                 if hasattr(layer, name))


def test_no_usage_statistics_nests_and_leaves_a_layers_own_setting_and_its_copies_alone():
    """The block pauses every sparse layer of a model, nests, and leaves the layers' own
    setting (``records_usage``) as it was; a copy made inside it is not paused."""
    model = torch.nn.Sequential(_build(EXAMPLES["layer:sigma_moe"]), _build(EXAMPLES["layer:pkm"]))
    model[1].records_usage = False
    with sparseffn.no_usage_statistics(model):
        with sparseffn.no_usage_statistics(model[0]):
            assert not model[0].counts_usage
        assert [layer.counts_usage for layer in model] == [False, False]
        copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
        buffer = io.BytesIO()
        torch.save(model, buffer)
        copies.append(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
        for copied in copies:
            assert [layer.counts_usage for layer in copied] == [True, False]
            copied[0](torch.randn(3, D))
            assert copied[0].usage_counts.sum() > 0
    assert [layer.counts_usage for layer in model] == [True, False]
    assert [layer.records_usage for layer in model] == [True, False]
    assert "records_usage" not in model[0].__dict__


@pytest.mark.parametrize("name", ["layer:sigma_moe", "router:switch"])
def test_a_compiled_layer_follows_no_usage_statistics_in_and_out(name):
    """Dynamo guards the setting: a compiled layer counts its usage before and after the
    block and not inside it."""
    layer, compiled, x = _compiled_in_eval(name)
    totals = []
    with torch.no_grad():
        for inside in (False, True, False):
            with sparseffn.no_usage_statistics(layer) if inside else contextlib.nullcontext():
                compiled(x)
            totals.append(layer.usage_counts.sum().item())
    pairs = x.shape[0] * layer.router.k
    assert totals == [pairs, pairs, 2 * pairs]


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_output_and_gradients_match_the_store_reference(name, training):
    layer = with_nonzero_biases(_build(EXAMPLES[name]).train(training))
    if isinstance(layer, RoutedFFN):
        assert type(layer.store) in STORE_REFERENCES, "add a loop reference for this store"
    if training and "dropout" in name or (training and EXAMPLES[name] is VARIANTS.get(
            "peer_sparse_grad")):
        layer.store.hidden_dropout.p = 0.0      # the reference has no dropout mask to share
    check_against_the_reference(layer, torch.randn(7, D, requires_grad=True))


def with_nonzero_biases(layer):
    """``layer`` with its expert biases drawn: they start at zero, and the reference must see
    them added."""
    with torch.no_grad():
        for key, p in layer.named_parameters():
            if key.rsplit(".", 1)[-1] in ("b1", "b2", "b_out") and not p.any():
                p.normal_(0.0, 0.5)
    return layer


def check_against_the_reference(layer, x, atol=1e-5):
    """The output of ``layer`` on ``x`` (which requires grad) and the gradients of ``x`` and of
    every parameter equal those of the loop reference fed the layer's own routing."""
    y, ref = output_and_reference(layer, x)
    torch.testing.assert_close(y, ref, atol=atol, rtol=1e-4)
    grad = torch.randn_like(y)
    params = [x] + params_of(layer)
    got = torch.autograd.grad(y, params, grad, retain_graph=True, allow_unused=True)
    want = torch.autograd.grad(ref, params, grad, allow_unused=True)
    for g, w, p in zip(got, want, params):
        g = None if g is None else (g.to_dense() if g.is_sparse else g)
        if w is None:
            assert g is None or torch.all(g == 0)
        else:
            torch.testing.assert_close(g, w, atol=atol, rtol=1e-4)


@pytest.mark.parametrize("name", EXAMPLES)
def test_deepcopy_pickle_and_averaged_model_after_a_training_forward(name):
    layer = _build(EXAMPLES[name]).train()
    x = torch.randn(6, D)
    layer(x).sum().backward()
    twin = copy.deepcopy(layer)
    assert twin.aux_losses == {} and twin.routing_stats == {}
    averaged = torch.optim.swa_utils.AveragedModel(layer)
    averaged.update_parameters(layer)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    layer.eval(), twin.eval(), averaged.eval(), loaded.eval()
    for other in (twin, averaged, loaded):
        torch.testing.assert_close(other(x), layer(x))


def _usage(layer):
    return None if not hasattr(layer, "usage_counts") else layer.usage_counts.clone()


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
@pytest.mark.parametrize("name", EXAMPLES)
def test_activation_checkpointing_keeps_the_aux_gradient_and_counts_usage_once(name, reentrant):
    config = EXAMPLES[name]
    plain, ckpt = _build(config).train(), _build(config).train()
    x = torch.randn(8, D, requires_grad=True)
    outputs = {}
    for label, layer in (("plain", plain), ("ckpt", ckpt)):
        torch.manual_seed(1)
        xx = x.detach().clone().requires_grad_(True)
        if label == "plain":
            y = layer(xx)
        else:
            y = checkpoint(layer, xx, use_reentrant=reentrant)
        loss = (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum() \
            + sparseffn.aux_loss(layer)
        loss.backward()
        outputs[label] = (xx.grad, _dense_grads(params_of(layer)), _usage(layer))
    (gx, gp, usage), (cx, cp, cusage) = outputs["plain"], outputs["ckpt"]
    torch.testing.assert_close(cx, gx, atol=1e-5, rtol=1e-4)
    for a, b in zip(cp, gp):
        if b is None:
            assert a is None or torch.all(a == 0)
        else:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    if usage is not None:
        torch.testing.assert_close(cusage, usage)      # recorded once, not twice


@pytest.mark.parametrize("name", EXAMPLES)
def test_inference_mode_then_training_forward(name):
    layer = _build(EXAMPLES[name])
    with torch.inference_mode():
        layer.eval()(torch.randn(5, D))
        layer.train()(torch.randn(5, D))
    layer.train()
    y = layer(torch.randn(5, D))
    (y.sum() + sparseffn.aux_loss(layer)).backward()
    layer.reset_usage()
    assert all(p.grad is not None for p in layer.parameters() if p.requires_grad) or \
        isinstance(layer, RoutedFFN)


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_forward_lets_go_of_the_last_forwards_graph_before_building_its_own(name):
    """A layer keeps its last forward's aux losses, in the autograd graph, for ``aux_loss``
    to collect. The next forward lets go of them before its first submodule runs: a graph
    kept alive keeps each parameter's AccumulateGrad node, which the new graph would reuse
    with the CUDA stream it was made on, so that a CUDA graph captured after an eager step
    on the default stream fails (PyTorch warns that "the AccumulateGrad node's stream does
    not match")."""
    layer = _build(EXAMPLES[name]).train()
    x = torch.randn(7, D)
    (layer(x).sum() + sparseffn.aux_loss(layer)).backward()
    kept = [t for t in (*layer.aux_losses.values(), *layer.routing_stats.values())
            if t.grad_fn is not None]
    assert kept or not any(t.requires_grad for t in layer.aux_losses.values())
    alive = [weakref.ref(t) for t in kept]
    del kept
    seen = []

    def check(module, args):   # what the last forward left, when this one's first child runs
        seen.append((layer.aux_losses, layer.routing_stats,
                     [ref() is not None for ref in alive]))
    hooks = [child.register_forward_pre_hook(check) for child in layer.children()]
    layer(torch.randn(5, D))
    for hook in hooks:
        hook.remove()
    aux_losses, routing_stats, still_alive = seen[0]
    assert aux_losses == {} and routing_stats == {}, "the last forward's were still held"
    assert not any(still_alive), "the last forward's aux losses were still alive"


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_layer_called_three_times_sums_its_aux_losses_when_asked(name):
    """A layer shared across depth: inside ``summing_aux_losses`` the aux loss and its
    gradients are those of three copies of the layer called once each; outside, a layer keeps
    its last call's."""
    shared = _build(EXAMPLES[name]).train()
    copies = [copy.deepcopy(shared) for _ in range(3)]
    xs = [torch.randn(7, D) for _ in range(3)]
    with sparseffn.summing_aux_losses(shared):
        for i, x in enumerate(xs):
            torch.manual_seed(10 + i)     # the noisy routers draw the same noise as the copies
            shared(x)
        total = sparseffn.aux_loss(shared)
    want = []
    for i, (layer, x) in enumerate(zip(copies, xs)):
        torch.manual_seed(10 + i)
        layer(x)
        want.append(sparseffn.aux_loss(layer))
    torch.testing.assert_close(total, sum(want), rtol=1e-5, atol=1e-7)
    if total.requires_grad:
        total.backward()
        sum(want).backward()
        for (param_name, p), *qs in zip(shared.named_parameters(),
                                        *(c.parameters() for c in copies)):
            grads = [q.grad for q in qs if q.grad is not None]
            if p.grad is None:
                assert not grads, param_name
            else:
                torch.testing.assert_close(p.grad, sum(grads), rtol=1e-5, atol=1e-7,
                                           msg=param_name)
    for i in (0, 2):                      # outside the block: the last call's
        torch.manual_seed(10 + i)
        shared(xs[i])
    torch.testing.assert_close(sparseffn.aux_loss(shared), want[2].detach(), rtol=1e-5,
                               atol=1e-7)


@pytest.mark.parametrize("name", EXAMPLES)
def test_a_float64_default_dtype_builds_float64_layers_that_train(name):
    """Under ``torch.set_default_dtype(torch.float64)`` (scientific code sets it) a layer is
    built in float64 and trains and evaluates in it; the usage statistics, which are float32
    whatever the default, once met a float64 tensor of ones there and failed."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        layer = _build(EXAMPLES[name])
        x = torch.randn(7, D, requires_grad=True)
        y = layer(x)
        (y.square().sum() + sparseffn.aux_loss(layer)).backward()
        with torch.no_grad():
            y_eval = layer.eval()(x)
    finally:
        torch.set_default_dtype(previous)
    assert {p.dtype for p in layer.parameters()} == {torch.float64}
    assert y.dtype == y_eval.dtype == x.grad.dtype == torch.float64
    assert torch.isfinite(x.grad).all()


def _straight_through(config) -> bool:
    """Whether the layer's router back-propagates a gradient its forward does not have:
    MoEfication's hard gate (weights exactly 1, the gradient sent to σ(logit))."""
    return getattr(getattr(config, "router", None), "gate", None) == "hard"


@pytest.mark.parametrize("name", EXAMPLES)
def test_gradients_equal_finite_differences_in_float64(name):
    """In float64, the gradients of a training forward's output and of each of its aux losses
    (unweighted), with respect to the input and every parameter, equal central finite
    differences of the forward (``torch.autograd.gradcheck`` in fast mode: random projections
    of each Jacobian; also a backward given only some output gradients).

    Independent of the loop references, which are fed the layer's own routing: this checks
    the routers' operators and the aux losses too. A float64 layer routes in float64: in
    float32 its gates were rounded to 1e-7, which finite differences over 1e-6 read as errors
    of 10%. Left out: gradients that are sparse tensors (gradcheck takes dense ones), and
    with a straight-through hard gate the input and the router, whose gradient is by design
    not the forward's."""
    layer, x, names = _float64_layer_input_and_checked_parameters(name)
    assert names
    assert_gradients_equal_finite_differences(layer, x, names)


@pytest.mark.parametrize("name", EXAMPLES)
def test_second_derivatives_equal_finite_differences_in_float64(name):
    """The same for second derivatives (``torch.autograd.gradgradcheck``: the gradients'
    gradients against finite differences of the gradients), with respect to the same
    tensors. The fused backward is differentiable once; while a graph is built the
    operators' gradients are recomputed from their portable forms (``ops/grad_mode.py``).
    Before, a second derivative raised on ``.backward()`` and left the layer out otherwise."""
    layer, x, names = _float64_layer_input_and_checked_parameters(name)
    assert_gradients_equal_finite_differences(layer, x, names,
                                              check=torch.autograd.gradgradcheck)
    # gradgradcheck differentiates the gradients built with a graph, whatever their values:
    # those must be the fused backward's, which gradcheck checks
    plain, with_graph = (_gradients_of_a_projection(layer, x, names, graph)
                         for graph in (False, True))
    for got, want in zip(with_graph, plain):
        torch.testing.assert_close(got, want)


def _gradients_of_a_projection(layer, x, names, create_graph):
    """The gradients, with respect to ``x`` (where it requires grad) and the parameters
    ``names``, of a fixed random projection of the training forward's output and aux losses,
    taken with or without ``create_graph``."""
    values = {key: p.detach().clone().requires_grad_() for key, p in layer.named_parameters()
              if key in names}
    x = x.detach().clone().requires_grad_(x.requires_grad)
    torch.manual_seed(1)
    y = torch.func.functional_call(layer, {**dict(layer.named_parameters()), **values}, (x,))
    outputs = (y, *sparseffn.aux_loss_terms(layer).values())
    weights = torch.Generator().manual_seed(2)
    objective = sum((out * torch.randn(out.shape, generator=weights, dtype=out.dtype)).sum()
                    for out in outputs)
    inputs = ([x] if x.requires_grad else []) + list(values.values())
    return torch.autograd.grad(objective, inputs, create_graph=create_graph, allow_unused=True)


def _float64_layer_input_and_checked_parameters(name):
    """The float64 training layer of example ``name`` (non-zero biases), an input [5, D]
    (requiring grad unless the gate is straight-through), and the names of the parameters
    whose gradients the finite-difference tests check (see
    :func:`test_gradients_equal_finite_differences_in_float64`)."""
    config = EXAMPLES[name]
    layer = with_nonzero_biases(_build(config).double().train())
    x = torch.randn(5, D, dtype=torch.float64, requires_grad=not _straight_through(config))
    layer(x).sum().backward()
    names = [key for key, p in layer.named_parameters()
             if p.grad is not None and not p.grad.is_sparse
             and not (_straight_through(config) and not key.startswith("store."))]
    return layer, x, names


def assert_gradients_equal_finite_differences(layer, x, names, check=torch.autograd.gradcheck):
    """``torch.autograd.gradcheck`` (or ``check``: ``gradgradcheck``) of the float64
    ``layer``'s output on ``x`` and of each of its unweighted aux losses, with respect to
    ``x`` (where it requires grad) and the parameters ``names``, the others held fixed."""
    fixed = {key: p.detach() for key, p in layer.named_parameters()}

    def forward(x, *values):
        torch.manual_seed(1)        # the same noise and dropout masks at every evaluation
        y = torch.func.functional_call(layer, {**fixed, **dict(zip(names, values))}, (x,))
        return (y, *sparseffn.aux_loss_terms(layer).values())

    values = [p.detach().clone().requires_grad_() for key, p in layer.named_parameters()
              if key in names]
    # float64 differences are good to about 1e-9: these bounds fail a gradient 1.001 times
    # too large, which gradcheck's defaults (1e-5, 1e-3) let pass
    assert check(forward, (x, *values), atol=1e-8, rtol=1e-6, fast_mode=True)


@pytest.mark.parametrize("name", EXAMPLES)
def test_meta_device_init_then_reset_parameters(name):
    config = EXAMPLES[name]
    with torch.device("meta"):
        layer = build_layer(config)
    layer.to_empty(device="cpu")
    for t in list(layer.parameters()) + list(layer.buffers()):
        if t.is_floating_point():
            t.detach().fill_(float("nan"))         # what uninitialised memory may hold
    torch.manual_seed(0)
    layer.reset_parameters()
    for name_, t in list(layer.named_parameters()) + list(layer.named_buffers()):
        assert torch.isfinite(t).all(), f"{name_} not initialised by reset_parameters"
    if hasattr(layer, "usage_counts"):
        assert torch.all(layer.usage_counts == 0) and torch.all(layer.usage_mass == 0)
    reference = _build(config)
    for (n1, a), (n2, b) in zip(layer.named_parameters(), reference.named_parameters()):
        assert n1 == n2 and a.shape == b.shape
        if bool((b == b.flatten()[0]).all()):       # constants: norms' scales, zero biases
            torch.testing.assert_close(a, b)
        elif b.numel() >= 16:                        # drawn from the same distribution
            assert math.isclose(a.std().item(), b.std().item(), rel_tol=0.5), n1
    assert torch.isfinite(layer(torch.randn(4, D))).all()


@pytest.mark.parametrize("name", EXAMPLES)
def test_state_dict_round_trip(name):
    layer, other = _build(EXAMPLES[name], seed=0).eval(), _build(EXAMPLES[name], seed=1).eval()
    state = layer.state_dict()
    assert not any("usage" in key for key in state)       # statistics are not weights
    other.load_state_dict(state)
    x = torch.randn(5, D)
    torch.testing.assert_close(other(x), layer(x))


COMPILED = [n for n in EXAMPLES if n != "variant:peer_sparse_grad"]   # sparse COO: not traced


@pytest.mark.parametrize("name", COMPILED)
def test_compiles_in_one_graph_and_matches_eager(name):
    layer = _build(EXAMPLES[name]).train()
    if name in ("router:noisy_topk", "router:gshard", "router:switch"):
        layer.eval()                 # their training noise is drawn differently when compiled
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, D)
    results = []
    for fn in (layer, compiled):
        torch.manual_seed(3)
        xx = x.clone().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = fn(xx)
        (y.square().sum() + sparseffn.aux_loss(layer)).backward()
        results.append((y.detach(), xx.grad, _dense_grads(params_of(layer))))
    (y, gx, gp), (cy, cgx, cgp) = results
    torch.testing.assert_close(cy, y, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(cgx, gx, atol=1e-5, rtol=1e-4)
    for a, b in zip(cgp, gp):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    torch._dynamo.reset()


@pytest.mark.parametrize("config", [
    EXAMPLES["layer:sigma_moe"], EXAMPLES["layer:pkm"], EXAMPLES["layer:fff"],
    # PyTorch 2.13's Inductor read the scatter behind the unsorted gate gradient (k >= E/2)
    # and behind gather's gradient (S-BASE) before writing it
    SigmaMoEConfig(d_model=D, num_experts=8, expert_size=6, k=4),
    MoEConfig(d_model=D, num_experts=6, expert_size=6, k=1, router=SBaseRouterConfig()),
    # Inductor could not generate the usage counts' scatter into one element
    SigmaMoEConfig(d_model=D, num_experts=1, expert_size=6, k=1)],
    ids=["sigma_moe", "pkm", "fff", "sigma_moe_half_the_experts", "sbase_top1", "one_expert"])
def test_inductor_compiled_training_step_matches_eager(config):
    """The default backend generates code: one MoE, one product-key and one tree layer give
    eager's output, gradients (of the input and of every parameter) and buffers."""
    layer = _build(config).train()
    twin = copy.deepcopy(layer)
    torch._dynamo.reset()
    compiled = torch.compile(twin, fullgraph=True)
    x = torch.randn(31, D, requires_grad=True)
    x_twin = x.detach().clone().requires_grad_(True)
    y, y_compiled = layer(x), compiled(x_twin)
    torch.testing.assert_close(y_compiled, y, atol=1e-5, rtol=1e-4)
    grad = torch.randn_like(y)
    want = torch.autograd.grad(y, [x, *layer.parameters()], grad)
    got = torch.autograd.grad(y_compiled, [x_twin, *twin.parameters()], grad)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
    compiled_buffers = dict(twin.named_buffers())     # usage counts, running statistics
    for name, buffer in layer.named_buffers():
        torch.testing.assert_close(compiled_buffers[name], buffer)
    torch._dynamo.reset()
