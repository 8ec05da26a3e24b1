"""A mixture of MLP experts computed with CVMM, with any router (../DESIGN.md: router |
expert store)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import MoEConfig
from ..init import dense_init_std
from ..ops import DispatchPlan, expert_mlp
from ..routers import build_router
from ..routing import SparseFFN


class MoE(SparseFFN):
    """``y = Σ_{e∈E_x} w_e(x) · W2^e act(W1^e x)`` (seed 001 Eq. 25), with ``E_x`` and the
    weights ``w_e`` from the router that ``config.router`` names (σ-MoE, softmax top-k, noisy
    top-k, Switch, GShard, S-BASE, the classic dense and hierarchical gates).

    Parameters: ``router.*`` (the selection network), ``w1`` [num_experts, expert_size,
    d_model] (the keys, rows of W1^e) and ``w2`` [num_experts, expert_size, d_model] (the
    values, rows of W2^e transposed). Expert e computes ``act(x @ w1[e].T) @ w2[e]``.

    Pairs the router drops (Switch / GShard capacity) are never computed: a dropped token's
    output is zero, so a residual connection around the layer carries it unchanged.

    After each forward: the router's unweighted ``aux_losses`` (weights in
    ``aux_loss_weights``, from the router config), ``routing_stats`` (per-expert ``counts``
    and ``mass`` of the dispatched pairs, plus e.g. ``dropped_fraction``), accumulated
    ``usage_counts`` / ``usage_mass``.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: MoEConfig | None = None, **kwargs) -> None:
        super().__init__()
        config = config if config is not None else MoEConfig(**kwargs)
        self.config = self.moe_config = config
        self.d_model = config.d_model
        self.router = build_router(config.router, config.d_model, config.num_experts, config.k,
                                   init=config.init, n_layers=config.n_layers)
        shape = (config.num_experts, config.expert_size, config.d_model)
        self.w1 = nn.Parameter(torch.empty(shape))
        self.w2 = nn.Parameter(torch.empty(shape))
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.aux_loss_weights = config.router.aux_loss_weights()
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``init="sigma_moe"``: experts like the dense MLP of width d_ff = num_experts ·
        expert_size, ``W1 ~ N(0, sqrt(2/(d_model n_layers)))``, ``W2 ~ N(0, sqrt(2/(d_ff
        n_layers)))`` (seed 001 §5); ``"standard"``: W2's fan-in is expert_size;
        ``"switch"``: truncated ``N(0, sqrt(0.1/fan_in))``, i.e. ``sqrt(0.1/G)`` for W2
        (Fedus et al.)."""
        cfg = self.moe_config
        if cfg.init == "switch":
            for weight, fan_in in ((self.w1, cfg.d_model), (self.w2, cfg.expert_size)):
                std = math.sqrt(0.1 / fan_in)
                nn.init.trunc_normal_(weight, 0.0, std, -2 * std, 2 * std)
        else:
            w2_fan_in = cfg.d_ff if cfg.init == "sigma_moe" else cfg.expert_size
            self.w1.normal_(0.0, dense_init_std(cfg.d_model, cfg.n_layers))
            self.w2.normal_(0.0, dense_init_std(w2_fan_in, cfg.n_layers))
        self.router.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        cfg = self.moe_config
        x2 = x.reshape(-1, self.d_model)
        routing = self.router(x2)
        plan = DispatchPlan.build(routing.indices, cfg.num_experts, dispatched=routing.dispatched)
        dropout = self.hidden_dropout if self.training and self.hidden_dropout.p > 0 else None
        y = expert_mlp(x2, plan, self.w1, self.w2, routing.weights,        # [T, d_model]
                       activation=cfg.activation, hidden_dropout=dropout)
        self._record_routing(routing, cfg.num_experts)
        return y.reshape(x.shape)
