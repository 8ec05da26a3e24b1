"""The one record every router returns, and the base class of every sparse FFN layer.

A router maps tokens to experts; the expert store never knows how (../DESIGN.md). Layers keep
their auxiliary losses and routing statistics on the module after each forward, so that
``forward(x) -> same shape`` stays drop-in; :mod:`sparseffn.auxiliary` collects them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class Routing:
    """Which experts each token uses, and with what weight.

    indices: int64 [tokens, k], expert ids.
    weights: float32 [tokens, k], the gate value multiplying each selected expert's output
      (zero where the slot was not dispatched).
    aux_losses: unweighted auxiliary losses (scalar tensors) by name.
    dispatched: bool [tokens, k] or None (all dispatched): False where a slot was dropped at
      an expert's capacity (or, in GShard, where the second expert was not sampled); such a
      slot is never computed and contributes zero.
    stats: router-specific statistics (detached scalars), e.g. ``dropped_fraction``.
    """

    indices: torch.Tensor
    weights: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    dispatched: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)


def expert_usage(indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 dispatched: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert number of dispatched (token, slot) pairs and their total selection weight,
    float32 [E]."""
    flat = indices.reshape(-1)
    if dispatched is not None:
        keep = dispatched.reshape(-1)
        flat, weights = flat[keep], weights.reshape(-1)[keep]
    counts = torch.bincount(flat, minlength=num_experts).float()
    mass = torch.zeros(num_experts, dtype=torch.float32, device=flat.device)
    mass.index_add_(0, flat, weights.detach().reshape(-1).float())
    return counts, mass


class SparseFFN(nn.Module):
    """Base of every drop-in FFN layer: ``forward(x: [..., d_model]) -> [..., d_model]``.

    After each forward a layer holds:
      aux_losses: unweighted auxiliary losses by name (scalar tensors, in the graph);
      aux_loss_weights: the weight of each in the training objective;
      routing_stats: per-expert ``counts`` and selection ``mass`` of the last forward, and the
        router's own statistics (``dropped_fraction`` where capacity applies);
    and accumulates ``usage_counts`` / ``usage_mass`` across forwards until
    :meth:`reset_usage` (for the expert-usage analyses of seed 001 Fig. 3).
    """

    d_model: int

    def __init__(self) -> None:
        super().__init__()
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.aux_loss_weights: dict[str, float] = {}
        self.routing_stats: dict[str, torch.Tensor] = {}

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"{type(self).__name__} expects input of shape [..., d_model="
                             f"{self.d_model}], got {tuple(x.shape)}")

    def _record_routing(self, routing: Routing, num_experts: int) -> None:
        self.aux_losses = dict(routing.aux_losses)
        with torch.no_grad():
            counts, mass = expert_usage(routing.indices, routing.weights, num_experts,
                                        routing.dispatched)
            self._record_usage(counts, mass, routing.stats)

    @torch.no_grad()
    def _record_usage(self, counts: torch.Tensor, mass: torch.Tensor,
                      stats: dict[str, torch.Tensor]) -> None:
        """Keep this forward's per-expert ``counts`` and ``mass`` (float32 [E]) and other
        ``stats`` in ``routing_stats``, and add them to the accumulated usage."""
        self.routing_stats = {"counts": counts, "mass": mass, **stats}
        usage = getattr(self, "usage_counts", None)
        if usage is None or usage.shape[0] != counts.shape[0] or usage.device != counts.device:
            self.reset_usage(counts.shape[0], counts.device)
        self.usage_counts += counts
        self.usage_mass += mass

    def sparse_grad_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients are sparse tensors (none, unless a layer says so)."""
        return []

    def reset_usage(self, num_experts: int | None = None, device=None) -> None:
        """Zero the accumulated per-expert usage."""
        if num_experts is None:
            if not hasattr(self, "usage_counts"):
                return
            num_experts, device = self.usage_counts.shape[0], self.usage_counts.device
        self.usage_counts = torch.zeros(num_experts, device=device)
        self.usage_mass = torch.zeros(num_experts, device=device)
