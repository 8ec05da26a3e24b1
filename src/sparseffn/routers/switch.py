"""Switch Transformer routing (Fedus et al. 2022; Csordás et al. 2023 §4): top-1 with a hard
expert capacity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..losses import router_z_loss, switch_balance_loss
from ..ops.assignment import positions_in_expert
from ..ops.sizes import exported_for_any_size
from ..registry import RouterConfig, implements, require_capacity_factor, require_router_k
from ..routing import Routing
from ..validation import require_choice, require_non_negative, require_probability
from .base import (LinearRouter, ROUTER_PRECISIONS, active_capacity_factor, capacity_of,
                   drop_experts, selected_scores)


@dataclass(frozen=True)


class SwitchRouterConfig(RouterConfig):
    """Switch Transformer routing (Fedus et al. 2022; Csordás et al. 2023 §4).

    Top-1 after the softmax, not renormalised; each expert takes at most
    ``capacity = ceil(capacity_factor · tokens / num_experts)`` tokens, in token order; the
    rest are dropped (their expert output is zero, the residual carries them).
    ``capacity_factor`` 0 or None: dropless.

    eval_capacity_factor: the capacity factor in evaluation mode (``module.eval()``); None or 0
      (the default): dropless, so a token's output does not depend on the tokens evaluated
      with it and generation with a KV cache gives the tokens it gives without one (see
      :func:`~sparseffn.routers.base.active_capacity_factor`).
    balance_weight: weight of ``N_E · f·p`` (Csordás et al. 2023 Eq. 29-31); Switch uses 0.01.
    z_loss_weight: weight of the router z-loss ``mean(logsumexp(logits)²)`` (ST-MoE); 0: off.
    expert_dropout: Csordás et al.'s expert dropout (Eq. 36) applied to the selection; the other
      choice, Switch's high dropout inside the experts, is the layer's ``hidden_dropout``.
    jitter: multiply the router input by U(1-jitter, 1+jitter) during training (Switch's
      "input jitter"); 0: off.
    precision: the selection product ``W x`` in ``"float32"`` (the default; Switch's
      "selective precision") or ``"autocast"`` (see
      :func:`~sparseffn.routers.base.selection_linear`).
    """

    type_name: ClassVar[str] = "switch"

    capacity_factor: float | None = 1.25
    eval_capacity_factor: float | None = None
    balance_weight: float = 0.01
    z_loss_weight: float = 0.0
    expert_dropout: float = 0.0
    jitter: float = 0.0
    precision: str = "float32"

    def __post_init__(self) -> None:
        require_choice(self, "precision", ROUTER_PRECISIONS)
        require_capacity_factor(self)
        require_capacity_factor(self, "eval_capacity_factor")
        require_non_negative(self, "balance_weight")
        require_non_negative(self, "z_loss_weight")
        require_probability(self, "expert_dropout")
        require_probability(self, "jitter")

    def check_layer(self, num_experts: int, k: int) -> None:
        require_router_k(self, k, 1, "one expert (top-1)")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"balance": self.balance_weight, "z_loss": self.z_loss_weight}


@implements(SwitchRouterConfig)
class SwitchRouter(LinearRouter):
    """``p = softmax(W x)``; each token goes to ``argmax p`` with weight ``p[e]`` (no
    renormalisation). Each expert takes at most ``capacity = ceil(capacity_factor · T / E)``
    tokens, first come first served in token order; the others are dropped: not dispatched,
    weight 0, so the layer's output for them is zero and the residual carries them. In
    evaluation mode ``eval_capacity_factor`` applies instead (default: dropless).

    Auxiliary losses: ``balance`` = ``N_E f·p`` (Csordás et al. 2023 Eq. 29-31, f from the top-1
    choices before dropping) and ``z_loss`` (ST-MoE). Stats: ``dropped_fraction``, ``capacity``.

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, 1], weights [tokens, 1],
    dispatched [tokens, 1])
    """

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.config
        if self.training and cfg.jitter > 0:   # Switch's multiplicative input jitter
            x = x * torch.empty_like(x).uniform_(1.0 - cfg.jitter, 1.0 + cfg.jitter)
        logits = self.logits(x)                                  # [T, E]
        probs = torch.softmax(logits, dim=-1)
        selection, _ = drop_experts(probs, cfg.expert_dropout, self.training)
        top1 = selection.detach().argmax(-1)                                   # [T]
        weights = selected_scores(probs, top1.unsqueeze(1))                   # [T, 1]
        tokens = x.shape[0]
        capacity = capacity_of(active_capacity_factor(cfg, self.training), tokens, 1,
                               self.num_experts)
        if capacity is not None and (exported_for_any_size(tokens) or tokens):
            dispatched = (positions_in_expert(top1, self.num_experts) < capacity).unsqueeze(1)
            weights = weights * dispatched
            stats = {"dropped_fraction": 1.0 - dispatched.float().mean(),
                     "capacity": torch.full((), torch.sym_float(capacity), device=x.device)}
        else:    # on the input's device: a CPU tensor in a compiled graph stops CUDA graphs
            dispatched, stats = None, {"dropped_fraction": torch.zeros((), device=x.device)}
        aux = {"balance": switch_balance_loss(probs, top1, self.global_batch),
               "z_loss": router_z_loss(logits, self.global_batch)} \
            if self.computes_aux_losses else {}
        return Routing(indices=top1.unsqueeze(1), weights=weights, dispatched=dispatched,
                       aux_losses=aux, stats=stats)
