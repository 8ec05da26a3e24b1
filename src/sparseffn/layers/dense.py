"""The dense two-layer MLP that every sparse layer approximates (seed 001 Eq. 1-2)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import DenseMLPConfig
from ..init import dense_init_std
from ..routing import SparseFFN
from ..activations import activation_fn


class DenseMLP(SparseFFN):
    """``y = W2 · act(W1 · x)`` (+ biases if ``config.bias``), with optional dropout on the
    hidden units.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: DenseMLPConfig | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config = config if config is not None else DenseMLPConfig(**kwargs)
        self.d_model = config.d_model
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.activation = activation_fn(config.activation)
        self.dropout = nn.Dropout(config.dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.config
        nn.init.normal_(self.up.weight, 0.0, dense_init_std(cfg.d_model, cfg.n_layers))
        nn.init.normal_(self.down.weight, 0.0, dense_init_std(cfg.d_ff, cfg.n_layers))
        for linear in (self.up, self.down):
            if linear.bias is not None:
                linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return self.down(self.dropout(self.activation(self.up(x))))
