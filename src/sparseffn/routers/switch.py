"""Switch Transformer routing (Fedus et al. 2022; seeds 001 §4, 002, 004): top-1 with a hard
expert capacity."""

from __future__ import annotations

import torch

from ..losses import router_z_loss, switch_balance_loss
from ..routing import Routing
from ..ops.assignment import positions_in_expert
from .base import LinearRouter, capacity_of, drop_experts


class SwitchRouter(LinearRouter):
    """``p = softmax(W x)``; each token goes to ``argmax p`` with weight ``p[e]`` (no
    renormalisation). Each expert takes at most ``capacity = ceil(capacity_factor · T / E)``
    tokens, first come first served in token order; the others are dropped: not dispatched,
    weight 0, so the layer's output for them is zero and the residual carries them.

    Auxiliary losses: ``balance`` = ``N_E f·p`` (seed 001 Eq. 29-31, f from the top-1 choices
    before dropping) and ``z_loss`` (ST-MoE). Stats: ``dropped_fraction``, ``capacity``.

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
        weights = probs.gather(1, top1.unsqueeze(1))                          # [T, 1]
        tokens = x.shape[0]
        capacity = capacity_of(cfg.capacity_factor, tokens, 1, self.num_experts)
        dispatched = None
        stats = {"dropped_fraction": torch.zeros(())}
        if capacity is not None and tokens:
            dispatched = (positions_in_expert(top1, self.num_experts) < capacity).unsqueeze(1)
            weights = weights * dispatched
            stats = {"dropped_fraction": 1.0 - dispatched.float().mean(),
                     "capacity": torch.tensor(float(capacity))}
        return Routing(indices=top1.unsqueeze(1), weights=weights, dispatched=dispatched,
                       aux_losses={"balance": switch_balance_loss(probs, top1),
                                   "z_loss": router_z_loss(logits)},
                       stats=stats)
