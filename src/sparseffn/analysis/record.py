"""Record what every sparse layer of a model decided, forward by forward.

    with RoutingRecorder(model) as recorder:
        for batch in batches:
            model(batch)
    record = recorder.records["blocks.0.ffn"]
    record.indices            # int64 [tokens, k], every forward's tokens in order

For routed layers (a router plus an expert store, and the classic mixtures) the recorder keeps
each forward's :class:`~sparseffn.routing.Routing` (indices, weights, dispatched), detached and
on the CPU. For dense MLPs it keeps the number of non-zero hidden units per token; for fast
feed-forward trees (and any layer routed by a :class:`~sparseffn.routers.tree.TreeRouter`) the
node logits of each token. Nothing is kept after the ``with`` block ends but the records, and
a model in the block trains and infers exactly as outside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..layers.dense import DenseMLP
from ..routers.tree import TreeRouter
from ..routing import RoutedFFN, Routing, SparseFFN, expert_usage
from .stats import active_channels


@dataclass
class LayerRecord:
    """What one layer decided over the recorded forwards (tokens in forward order).

    kind: "routed" (experts selected per token) or "dense" (a dense MLP's hidden layer).
    num_experts: E of a routed layer (None for a dense one); d_ff: a dense MLP's width.
    """

    name: str
    kind: str
    num_experts: int | None = None
    d_ff: int | None = None
    _indices: list = field(default_factory=list, repr=False)
    _weights: list = field(default_factory=list, repr=False)
    _dispatched: list = field(default_factory=list, repr=False)
    _active: list = field(default_factory=list, repr=False)
    _node_logits: list = field(default_factory=list, repr=False)

    @staticmethod
    def _cat(parts: list, empty_shape=(0,), dtype=torch.int64) -> torch.Tensor:
        return torch.cat(parts) if parts else torch.empty(empty_shape, dtype=dtype)

    @property
    def indices(self) -> torch.Tensor:
        """int64 [T, k]: the experts each token selected."""
        return self._cat(self._indices, (0, 1))

    @property
    def weights(self) -> torch.Tensor:
        """float32 [T, k]: their gate values."""
        return self._cat(self._weights, (0, 1), torch.float32)

    @property
    def dispatched(self) -> torch.Tensor | None:
        """bool [T, k]: False where a slot was dropped at capacity; None if none ever was."""
        if all(d is None for d in self._dispatched):
            return None
        return torch.cat([torch.ones(i.shape, dtype=torch.bool) if d is None else d
                          for i, d in zip(self._indices, self._dispatched)])

    @property
    def mass(self) -> torch.Tensor:
        """float64 [E]: the selection weight each expert received (dispatched slots only), as
        the layer's own ``usage_mass`` counts it."""
        _, mass = expert_usage(self.indices, self.weights, self.num_experts or 0, self.dispatched)
        return mass.double()

    @property
    def active(self) -> torch.Tensor:
        """int64 [T]: non-zero hidden units per token of a dense MLP."""
        return self._cat(self._active)

    @property
    def node_logits(self) -> torch.Tensor | None:
        """float32 [T, 2^d - 1]: the tree router's node logits, or None (no tree)."""
        return torch.cat(self._node_logits) if self._node_logits else None

    @property
    def tokens(self) -> int:
        parts = self._indices if self.kind == "routed" else self._active
        return sum(p.shape[0] for p in parts)


class RoutingRecorder:
    """A context manager that records every sparse layer of ``model`` (see the module doc).

    ``records``: :class:`LayerRecord` by the layer's module path (``"<root>"`` for the model
    itself), for every routed layer and every :class:`~sparseffn.DenseMLP`, in module order.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.records: dict[str, LayerRecord] = {}
        self._handles: list = []
        self._observed: list[SparseFFN] = []

    def __enter__(self) -> "RoutingRecorder":
        for name, module in self.model.named_modules():
            name = name or "<root>"
            if isinstance(module, DenseMLP):
                record = LayerRecord(name, "dense", d_ff=module.config.d_ff)
                self._handles.append(module.down.register_forward_pre_hook(
                    self._dense_hook(record)))
            elif isinstance(module, SparseFFN) and getattr(module, "num_experts", None):
                record = LayerRecord(name, "routed", num_experts=module.num_experts)
                if module._transient.observer is not None:
                    raise RuntimeError(f"layer {name} is already being recorded (one "
                                       f"RoutingRecorder per model at a time)")
                module._transient.observer = self._routing_observer(record)
                self._observed.append(module)
                router = getattr(module, "router", None)
                if isinstance(module, RoutedFFN) and isinstance(router, TreeRouter) \
                        and router.depth is not None:
                    self._handles.append(module.register_forward_pre_hook(
                        self._tree_hook(record, module)))
            else:
                continue
            self.records[name] = record
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        for module in self._observed:
            module._transient.observer = None
        self._handles, self._observed = [], []

    @staticmethod
    def _routing_observer(record: LayerRecord):
        def observe(routing: Routing) -> None:
            record._indices.append(routing.indices.detach().reshape(-1, routing.indices.shape[-1])
                                   .long().cpu())
            record._weights.append(routing.weights.detach().float().reshape(
                -1, routing.weights.shape[-1]).cpu())
            dispatched = routing.dispatched
            record._dispatched.append(None if dispatched is None else
                                      dispatched.detach().reshape(-1, dispatched.shape[-1]).cpu())
        return observe

    @staticmethod
    def _dense_hook(record: LayerRecord):
        def hook(module, args):
            record._active.append(active_channels(args[0]).reshape(-1).cpu())
        return hook

    @staticmethod
    def _tree_hook(record: LayerRecord, layer: RoutedFFN):
        def hook(module, args):
            with torch.no_grad():
                x = args[0].reshape(-1, layer.d_model)
                record._node_logits.append(layer.router.node_logits(x).float().cpu())
        return hook
