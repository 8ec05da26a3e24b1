"""BASE layers (Lewis et al. 2021) and S-BASE (Clark et al. 2022): balanced assignment during
training, sigmoid weighting, plain top-k at inference (Csordás et al. 2023 §4, Eq. 32-33)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..losses import batch_entropy_loss
from ..ops.assignment import (capacity_rounding, exact_balanced_assignment,
                              sinkhorn_log_plan, sinkhorn_topk)
from ..registry import RouterConfig, implements
from ..routing import Routing
from ..validation import require_choice, require_non_negative, require_positive_int
from .base import LinearRouter, ROUTER_PRECISIONS, selected_scores

SBASE_ASSIGNMENTS = ("sinkhorn", "exact")
SBASE_ROUNDINGS = ("topk", "capacity")


@dataclass(frozen=True)
class SBaseRouterConfig(RouterConfig):
    """BASE / S-BASE (Csordás et al. 2023 §4, Eq. 32-33): during training, a balanced assignment
    of the batch's tokens to experts; the selected experts are weighted by ``σ(W x)``; at
    evaluation
    plain top-k. Extended to k > 1 (Csordás et al. 2023 Table 4 "S-BASE, K=4").

    assignment: ``"sinkhorn"`` (Clark et al. 2022: Sinkhorn iterations on ``exp(W x)``, then
      the top-k of the balanced plan), or ``"exact"`` (the linear assignment of Eq. 33, each
      expert taking at most ``ceil(tokens · k / num_experts)`` tokens; solved with SciPy, for
      small batches).
    sinkhorn_iterations: number of row/column normalisations.
    rounding: how the Sinkhorn plan becomes k experts per token: ``"topk"`` (each token's k
      largest plan entries, as Clark et al. and Csordás et al. 2023; nearly balanced) or
      ``"capacity"``
      (deferred acceptance with at most ``ceil(T·k/E)`` pairs per expert: exactly balanced
      for k = 1, within a few % for k > 1; slower, see ``ops.assignment.capacity_rounding``).
    entropy_weight: γ of Eq. 35 (Csordás et al. 2023 regularises S-BASE with it, App. B Table 9).
    precision: the selection product ``W x`` in ``"float32"`` (the default; Switch's
      "selective precision") or ``"autocast"`` (see
      :func:`~sparseffn.routers.base.selection_linear`).
    """

    type_name: ClassVar[str] = "sbase"

    assignment: str = "sinkhorn"
    sinkhorn_iterations: int = 8
    rounding: str = "topk"
    entropy_weight: float = 0.001
    precision: str = "float32"

    def __post_init__(self) -> None:
        require_choice(self, "precision", ROUTER_PRECISIONS)
        require_choice(self, "assignment", SBASE_ASSIGNMENTS)
        require_choice(self, "rounding", SBASE_ROUNDINGS)
        require_positive_int(self, "sinkhorn_iterations")
        require_non_negative(self, "entropy_weight")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"entropy": self.entropy_weight}


@implements(SBaseRouterConfig)
class SBaseRouter(LinearRouter):
    """Scores ``sel(x) = σ(W x)`` (Eq. 32). During training the batch's tokens are assigned
    to experts so that every expert gets an equal share: the Sinkhorn plan of ``exp(W x)``
    rounded to k experts per token (``assignment="sinkhorn"``, ``rounding`` top-k or
    capacity-bounded), or the exact linear assignment maximising
    ``Σ sel(x)[e_x]`` (Eq. 33, ``"exact"``). At evaluation, no balancing: the top-k of
    ``sel(x)``. The selected experts are weighted by ``sel(x)[e]``.

    Auxiliary loss ``entropy`` (Eq. 35, as Csordás et al. 2023 uses for S-BASE). Stats, in
    training: ``max_load`` (the busiest expert's pairs over the balanced share). At evaluation
    the layer's ``routing_stats["counts"]`` give the load (a decode step builds no dispatch
    plan for it).

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, k], weights [tokens, k])
    """

    def assign(self, logits: torch.Tensor) -> torch.Tensor:
        """The balanced top-k assignment of a training batch: int64 [T, k]."""
        if self.config.assignment == "exact":
            return exact_balanced_assignment(torch.sigmoid(logits.detach()), self.k)
        iterations = self.config.sinkhorn_iterations
        if self.config.rounding == "capacity":
            return capacity_rounding(sinkhorn_log_plan(logits, iterations), self.k)
        return sinkhorn_topk(logits, iterations, self.k)

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.logits(x)                                       # [T, E]
        if self.training:
            indices = self.assign(logits)
        else:
            indices = torch.topk(logits.detach(), self.k, dim=-1, sorted=False).indices
        weights = torch.sigmoid(selected_scores(logits, indices))                 # Eq. 32
        aux = {"entropy": batch_entropy_loss(logits, self.global_batch)} \
            if self.computes_aux_losses else {}
        routing = Routing(indices=indices, weights=weights, aux_losses=aux)
        if self.training:     # the balance the assignment reached; at evaluation there is none
            tokens = x.shape[0]
            share = tokens * self.k / self.num_experts
            # the pairs per expert from the dispatch plan, which the expert store then reuses
            load = routing.plan(self.num_experts).counts
            routing.stats["max_load"] = load.max() / share if tokens \
                else torch.zeros((), device=x.device)
        return routing
