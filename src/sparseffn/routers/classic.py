"""The classic gates: Jacobs et al.'s softmax gate over every expert, with Eigen
et al.'s running-usage margin rule, and Jordan & Jacobs' hierarchical gate (a gate over
gates)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..registry import RouterConfig, implements, require_router_k
from ..routing import Routing
from ..validation import require_non_negative, require_positive_int
from .base import Router, full_precision_linear, init_selection_


@dataclass(frozen=True)


class DenseGateRouterConfig(RouterConfig):
    """The classic gate (Jacobs et al. 1991): ``g = softmax(V [x, 1])`` over all
    experts, every expert used (the layer's k must equal num_experts).

    margin: Eigen, Ranzato & Sutskever's deep-MoE rule (2013): during training an expert whose
    running
      total assignment exceeds the mean of all experts' by more than ``margin`` gets gate 0
      (the other gates are renormalised). None: off.
    """

    type_name: ClassVar[str] = "dense_softmax"

    margin: float | None = None

    def __post_init__(self) -> None:
        if self.margin is not None:
            require_non_negative(self, "margin")

    def check_layer(self, num_experts: int, k: int) -> None:
        require_router_k(self, k, num_experts, "every expert")

    def num_params(self, d_model: int, num_experts: int) -> int:
        return num_experts * (d_model + 1)


@dataclass(frozen=True)


class HierarchicalRouterConfig(RouterConfig):
    """The hierarchical mixture's gate (Jordan & Jacobs 1994): a tree of softmax
    gates on ``[x, 1]``, each with ``branching`` children, over ``branching ** depth`` leaf
    experts; a leaf's weight is the product of the gates on its path
    (``g_i · g_(j|i) · ...``). Every leaf is used (k must equal num_experts)."""

    type_name: ClassVar[str] = "hierarchical"

    branching: int = 2

    def __post_init__(self) -> None:
        require_positive_int(self, "branching")
        if self.branching < 2:
            raise ValueError(f"HierarchicalRouterConfig.branching must be at least 2, got "
                             f"{self.branching}")

    def depth(self, num_experts: int) -> int:
        depth = round(math.log(num_experts, self.branching)) if num_experts > 1 else 0
        if depth < 1 or self.branching ** depth != num_experts:
            raise ValueError(f"HierarchicalRouterConfig: num_experts={num_experts} must be a "
                             f"power of branching={self.branching} (branching ** depth, depth "
                             f">= 1)")
        return depth

    def num_gates(self, num_experts: int) -> int:
        """Internal nodes of the tree, each a softmax over ``branching`` children."""
        return (num_experts - 1) // (self.branching - 1)

    def check_layer(self, num_experts: int, k: int) -> None:
        self.depth(num_experts)
        require_router_k(self, k, num_experts, "every leaf expert")

    def num_params(self, d_model: int, num_experts: int) -> int:
        return self.num_gates(num_experts) * self.branching * (d_model + 1)


def _every_expert(tokens: int, num_experts: int, device) -> torch.Tensor:
    return torch.arange(num_experts, device=device).expand(tokens, num_experts)


class _AffineGateRouter(Router):
    """A router whose logits are ``V [x, 1]``: ``weight`` [rows, d_model] and ``bias`` [rows]
    (zero at initialisation), routing to every expert (k defaults to num_experts)."""

    def __init__(self, config, d_model: int, num_experts: int, k: int | None, init: str,
                 init_depth: int, rows: int) -> None:
        super().__init__(config, d_model, num_experts, num_experts if k is None else k, init,
                         init_depth)
        self.weight = nn.Parameter(torch.empty(rows, d_model))
        self.bias = nn.Parameter(torch.empty(rows))          # the "1" of [x, 1]

    def reset_parameters(self) -> None:
        init_selection_(self.weight, self.init, self.init_depth)
        with torch.no_grad():
            self.bias.zero_()

    def gate_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``V [x, 1]`` in float32 (float64 for a float64 ``x``): [T, rows]."""
        return full_precision_linear(x, self.weight, self.bias)


@implements(DenseGateRouterConfig)
class DenseGateRouter(_AffineGateRouter):
    """``g_i(x) = softmax_i(v_iᵀ [x, 1])`` (Jacobs et al. 1991): every expert is
    used with its gate value; the weights sum to one.

    With ``margin`` m (Eigen, Ranzato & Sutskever 2013, arXiv:1312.4314) the router keeps each
    expert's running total assignment ``G_i(t) = Σ_{t' ≤ t} g_i(x_t')`` in the buffer
    ``assignment_totals`` during training, and sets ``g_i = 0`` for an expert whose total
    exceeds the mean total by more than m; the remaining gates are renormalised. The rule is
    applied per batch (the totals including the batch's gates decide which experts are
    zeroed; the totals then grow by the gates actually applied); with one example per batch
    it is the per-example rule. Stats: ``zeroed_experts``.

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, E] = every expert, weights
    [tokens, E])
    """

    def __init__(self, config: DenseGateRouterConfig, d_model: int, num_experts: int,
                 k: int | None = None, init: str = "sigma_moe", init_depth: int = 1) -> None:
        super().__init__(config, d_model, num_experts, k, init, init_depth, rows=num_experts)
        self.register_buffer("assignment_totals", torch.zeros(num_experts))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.assignment_totals.zero_()

    def forward(self, x: torch.Tensor) -> Routing:
        gates = torch.softmax(self.gate_logits(x), dim=-1)                        # [T, E]
        stats = {}
        margin = self.config.margin
        if self.training and margin is not None and x.shape[0]:
            with torch.no_grad():
                totals = self.assignment_totals + gates.sum(0)
                over = totals - totals.mean() > margin                         # [E]
            masked = gates * ~over
            masked = masked / masked.sum(-1, keepdim=True).clamp_min(1e-30)
            gates = torch.where(over.any(), masked, gates)     # no host read
            with torch.no_grad():
                self.assignment_totals += gates.sum(0)
            stats["zeroed_experts"] = over.float().sum()
        return Routing(indices=_every_expert(x.shape[0], self.num_experts, x.device),
                       weights=gates, stats=stats)


@implements(HierarchicalRouterConfig)
class HierarchicalRouter(_AffineGateRouter):
    """A tree of softmax gates on ``[x, 1]`` (Jordan & Jacobs 1994): the root
    chooses among ``branching`` subtrees, each inner node among its own children, down to
    ``branching ** depth`` leaves. A leaf's weight is the product of the gate values on its
    path, ``g_i(x) · g_(j|i)(x) · ...``, computed as a sum of log-softmaxes level by level;
    the leaf weights sum to one. Node n's children are nodes ``n · b + 1 ... n · b + b``
    (level order); leaf ℓ is the ℓ-th node of the last level.

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, E] = every leaf, weights
    [tokens, E])
    """

    def __init__(self, config: HierarchicalRouterConfig, d_model: int, num_experts: int,
                 k: int | None = None, init: str = "sigma_moe", init_depth: int = 1) -> None:
        super().__init__(config, d_model, num_experts, k, init, init_depth,
                         rows=config.num_gates(num_experts) * config.branching)
        self.branching = config.branching
        self.depth = config.depth(num_experts)
        self.reset_parameters()

    def leaf_log_weights(self, x: torch.Tensor) -> torch.Tensor:
        """log of each leaf's path product: float32 (float64 for a float64 ``x``) [T, E]."""
        b = self.branching
        logits = self.gate_logits(x)
        node_log_gates = torch.log_softmax(
            logits.view(x.shape[0], logits.shape[-1] // b, b), dim=-1)          # [T, N, b]
        log_weights = node_log_gates.new_zeros(x.shape[0], 1)
        first = 0
        for level in range(self.depth):     # expand each level's log gates onto its children
            width = b ** level
            level_gates = node_log_gates[:, first:first + width]                  # [T, w, b]
            log_weights = (log_weights.unsqueeze(-1) + level_gates).reshape(x.shape[0], width * b)
            first += width
        return log_weights

    def forward(self, x: torch.Tensor) -> Routing:
        weights = self.leaf_log_weights(x).exp()
        return Routing(indices=_every_expert(x.shape[0], self.num_experts, x.device),
                       weights=weights)
