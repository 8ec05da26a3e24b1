"""σ-MoE (seed 001 §5): a sigmoid-gated top-k mixture of MLP experts computed with CVMM."""

from __future__ import annotations

import torch
from torch import nn

from ..config import SigmaMoEConfig
from ..init import dense_init_std
from ..ops import DispatchPlan, expert_mlp
from ..routers import SigmaRouter
from ..routing import SparseFFN


class SigmaMoE(SparseFFN):
    """``y = Σ_{e∈E_x} s[e] · W2^e act(W1^e x)`` (seed 001 Eq. 25) with σ-MoE's selection.

    Parameters, in seed 001's key-value view (Eq. 20-24): ``router.weight`` [num_experts,
    d_model] (W_s); ``w1`` [num_experts, expert_size, d_model], whose rows are the keys k_i of
    each expert (W1^e); ``w2`` [num_experts, expert_size, d_model], whose rows are the values
    v_i (W2^e transposed). Expert e computes ``act(x W1^eᵀ) W2^eᵀ``, i.e.
    ``act(x @ w1[e].T) @ w2[e]``.

    Initialisation (``init="sigma_moe"``): experts like the dense MLP of width
    ``d_ff = num_experts · expert_size`` they replace, ``W1^e ~ N(0, sqrt(2/(d_model
    n_layers)))`` and ``W2^e ~ N(0, sqrt(2/(d_ff n_layers)))``; ``init="standard"`` uses the
    expert's own width ``expert_size`` for W2.

    After each forward: ``aux_losses["entropy"]`` (Eq. 35, weight ``entropy_weight``) and the
    per-expert usage in ``routing_stats``.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: SigmaMoEConfig | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config = config if config is not None else SigmaMoEConfig(**kwargs)
        self.d_model = config.d_model
        self.router = SigmaRouter(config)
        self.w1 = nn.Parameter(torch.empty(config.num_experts, config.expert_size, config.d_model))
        self.w2 = nn.Parameter(torch.empty(config.num_experts, config.expert_size, config.d_model))
        self.hidden_dropout = nn.Dropout(config.hidden_dropout)
        self.aux_loss_weights = {"entropy": config.entropy_weight}
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.config
        w2_fan_in = cfg.d_ff if cfg.init == "sigma_moe" else cfg.expert_size
        self.w1.normal_(0.0, dense_init_std(cfg.d_model, cfg.n_layers))
        self.w2.normal_(0.0, dense_init_std(w2_fan_in, cfg.n_layers))
        self.router.reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x2 = x.reshape(-1, self.d_model)
        routing = self.router(x2)
        plan = DispatchPlan.build(routing.indices, self.config.num_experts)
        dropout = self.hidden_dropout if self.training and self.hidden_dropout.p > 0 else None
        y = expert_mlp(x2, plan, self.w1, self.w2, routing.weights,      # [T, d_model]
                       activation=self.config.activation, hidden_dropout=dropout)
        self._record_routing(routing, self.config.num_experts)
        return y.reshape(x.shape)
