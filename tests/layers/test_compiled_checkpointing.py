"""Activation checkpointing inside a compiled model: ``torch.compile`` of a block that calls
``torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)``, the way LLM training
combines the two.

Dynamo traces a checkpointed function as a higher-order operator that must have no side
effects, because eager checkpointing replays them when it recomputes the forward. A sparse
layer has two: it keeps its aux losses for ``sparseffn.aux_loss(model)`` and adds to its usage
statistics. Eager sparseffn layers already record nothing in a recomputation (usage is counted
once), so skipping the replay is what they want: with
``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True`` (set here by
``sparseffn.runtime.compiling_checkpointed_sparse_layers``, as the trainer sets it) the block
compiles in one graph and trains as the eager layer does without checkpointing (output, aux
loss, every gradient, usage). Without the setting, ``fullgraph=True`` fails with PyTorch's
"HOP: Unsafe side effect" (whose hint names the setting), and without ``fullgraph`` Dynamo
breaks the graph there and the checkpointed layer runs eagerly, still correctly. PyTorch
before 2.10 has no such setting: there the test checks that graph-break path instead.
"""

import copy

import pytest
import torch
from torch._dynamo.utils import counters
from torch.utils.checkpoint import checkpoint

import sparseffn
from sparseffn.bench.compiled import layer_configs
from sparseffn.runtime import (checkpointed_sparse_layers_trace_in_one_graph,
                               compiling_checkpointed_sparse_layers)

ONE_GRAPH = checkpointed_sparse_layers_trace_in_one_graph()     # PyTorch 2.10 and later


class _Block(torch.nn.Module):
    """x + layer(x), the layer checkpointed."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + checkpoint(self.layer, x, use_reentrant=False)


def _step(block_or_layer, layer, x):
    """One training step's output and aux loss (backward run), seeded for the noisy routers."""
    torch.manual_seed(1)
    y = block_or_layer(x)
    aux = sparseffn.aux_loss(layer)
    (y.square().sum() + aux).backward()
    return y.detach(), aux.detach()


@pytest.mark.parametrize("name", list(layer_configs(32)))
def test_a_compiled_checkpointed_layer_trains_as_the_eager_layer(name):
    torch.manual_seed(0)
    layer = sparseffn.build_layer(layer_configs(32)[name]).train()
    reference = copy.deepcopy(layer)
    x = torch.randn(50, 32)
    x_compiled, x_eager = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch._dynamo.reset()
    counters.clear()
    try:
        compiled = torch.compile(_Block(layer), fullgraph=ONE_GRAPH, backend="aot_eager")
        with compiling_checkpointed_sparse_layers():
            y, aux = _step(compiled, layer, x_compiled)
        if ONE_GRAPH or name == "dense":    # the dense MLP has no side effects to skip
            assert counters["stats"]["unique_graphs"] == 1
        else:       # the checkpoint runs eagerly, between the graphs before and after it
            assert sum(counters["graph_break"].values()) >= 1
    finally:
        torch._dynamo.reset()
    y_want, aux_want = _step(lambda t: t + reference(t), reference, x_eager)
    torch.testing.assert_close(y, y_want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aux, aux_want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=1e-5, atol=1e-6)
    for (param_name, p), q in zip(layer.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), param_name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=param_name)
    for buffer in ("usage_counts", "usage_mass"):   # counted once, not again in the recompute
        if hasattr(layer, buffer):
            torch.testing.assert_close(getattr(layer, buffer), getattr(reference, buffer))


def test_without_the_setting_fullgraph_names_the_side_effect():
    torch.manual_seed(0)
    block = _Block(sparseffn.build_layer(layer_configs(32)["sigma_moe"]).train())
    torch._dynamo.reset()
    try:
        with pytest.raises(Exception, match="(?i)side ?effect"):
            torch.compile(block, fullgraph=True, backend="aot_eager")(torch.randn(10, 32))
    finally:
        torch._dynamo.reset()
