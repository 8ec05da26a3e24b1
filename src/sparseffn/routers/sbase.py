"""BASE layers (Lewis et al. 2021) and S-BASE (Clark et al. 2022): balanced assignment during
training, sigmoid weighting, plain top-k at inference (seed 001 §4, Eq. 32-33)."""

from __future__ import annotations

import torch

from ..losses import batch_entropy_loss
from ..ops.assignment import (capacity_rounding, count_keys, exact_balanced_assignment,
                              sinkhorn_log_plan)
from ..routing import Routing
from .base import LinearRouter


class SBaseRouter(LinearRouter):
    """Scores ``sel(x) = σ(W x)`` (Eq. 32). During training the batch's tokens are assigned
    to experts so that every expert gets an equal share: the Sinkhorn plan of ``exp(W x)``
    rounded to k experts per token (``assignment="sinkhorn"``, ``rounding`` top-k or
    capacity-bounded), or the exact linear assignment maximising
    ``Σ sel(x)[e_x]`` (Eq. 33, ``"exact"``). At evaluation, no balancing: the top-k of
    ``sel(x)``. The selected experts are weighted by ``sel(x)[e]``.

    Auxiliary loss ``entropy`` (Eq. 35, as seed 001 uses for S-BASE). Stats:
    ``max_load`` (the busiest expert's pairs over the balanced share).

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, k], weights [tokens, k])
    """

    def assign(self, logits: torch.Tensor) -> torch.Tensor:
        """The balanced top-k assignment of a training batch: int64 [T, k]."""
        if self.config.assignment == "exact":
            return exact_balanced_assignment(torch.sigmoid(logits.detach()), self.k)
        log_plan = sinkhorn_log_plan(logits, self.config.sinkhorn_iterations)
        if self.config.rounding == "capacity":
            return capacity_rounding(log_plan, self.k)
        return torch.topk(log_plan, self.k, dim=-1, sorted=False).indices

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.logits(x)                                       # [T, E]
        if self.training:
            indices = self.assign(logits)
        else:
            indices = torch.topk(logits.detach(), self.k, dim=-1, sorted=False).indices
        weights = torch.sigmoid(logits.gather(1, indices))                        # Eq. 32
        tokens = x.shape[0]
        share = tokens * self.k / self.num_experts
        load = count_keys(indices, self.num_experts).float()
        stats = {"max_load": (load.max() / share) if tokens else torch.zeros(())}
        return Routing(indices=indices, weights=weights,
                       aux_losses={"entropy": batch_entropy_loss(logits)}, stats=stats)
