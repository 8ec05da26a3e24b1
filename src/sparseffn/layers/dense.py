"""The dense two-layer MLP that every sparse layer approximates (Csordás et al. 2023 Eq. 1-2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..activations import ACTIVATIONS, activation_fn
from ..init import dense_init_std
from ..registry import LayerConfig, LayerCost, config_argument, implements, renamed_fields
from ..routing import SparseFFN
from ..validation import require_choice, require_positive_int, require_probability


@renamed_fields(n_layers="init_depth")
@dataclass(frozen=True)
class DenseMLPConfig(LayerConfig):
    """The two-layer MLP ``y = W2 act(W1 x)`` (Csordás et al. 2023 Eq. 1-2).

    ``init_depth`` only sets the initialisation scale of a pre-LayerNorm Transformer with that
    many blocks: ``W1 ~ N(0, sqrt(2 / (d_model init_depth)))``, ``W2 ~ N(0, sqrt(2 / (d_ff
    init_depth)))`` (Csordás et al. 2023 §5).
    """

    type_name: ClassVar[str] = "dense"

    d_model: int
    d_ff: int
    activation: str = "relu"
    bias: bool = False
    dropout: float = 0.0
    init_depth: int = 1

    def __post_init__(self) -> None:
        require_positive_int(self, "d_model")
        require_positive_int(self, "d_ff")
        require_positive_int(self, "init_depth")
        require_choice(self, "activation", ACTIVATIONS)
        require_probability(self, "dropout")

    def cost(self) -> LayerCost:
        params = 2 * self.d_model * self.d_ff + (self.d_ff + self.d_model if self.bias else 0)
        flops = 4 * self.d_model * self.d_ff
        return LayerCost(params, params, flops, flops)


@implements(DenseMLPConfig)
class DenseMLP(SparseFFN):
    """``y = W2 · act(W1 · x)`` (+ biases if ``config.bias``), with optional dropout on the
    hidden units.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: DenseMLPConfig | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config = config_argument(DenseMLPConfig, config, kwargs, type(self).__name__)
        self.d_model = config.d_model
        self.up = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.down = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.activation = activation_fn(config.activation)
        self.dropout = nn.Dropout(config.dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.config
        nn.init.normal_(self.up.weight, 0.0, dense_init_std(cfg.d_model, cfg.init_depth))
        nn.init.normal_(self.down.weight, 0.0, dense_init_std(cfg.d_ff, cfg.init_depth))
        for linear in (self.up, self.down):
            if linear.bias is not None:
                linear.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        return self.down(self.dropout(self.activation(self.up(x))))
