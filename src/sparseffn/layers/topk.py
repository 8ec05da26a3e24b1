"""The MLP with a top-K activation (seed 001 §3.1)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..config import TopKMLPConfig
from ..init import dense_init_std
from ..routing import SparseFFN
from ..activations import activation_fn


class TopKMLP(SparseFFN):
    """``u = act(W1 x)``; keep the K largest entries (Eq. 13); ``y = Σ_{i∈E_x} u_i v_i`` (Eq. 14).

    The first layer is computed in full (as the paper notes, top-K alone cannot save it); the
    second reads only the K selected value rows, through an embedding bag.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: TopKMLPConfig | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config = config if config is not None else TopKMLPConfig(**kwargs)
        self.d_model = config.d_model
        self.keys = nn.Parameter(torch.empty(config.d_ff, config.d_model))    # W1, rows k_i
        self.values = nn.Parameter(torch.empty(config.d_ff, config.d_model))  # W2ᵀ, rows v_i
        self.activation = activation_fn(config.activation)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        cfg = self.config
        self.keys.normal_(0.0, dense_init_std(cfg.d_model, cfg.n_layers))
        self.values.normal_(0.0, dense_init_std(cfg.d_ff, cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x2 = x.reshape(-1, self.d_model)
        u = self.activation(F.linear(x2, self.keys))                   # [T, d_ff]  (Eq. 1)
        top_values, top_index = torch.topk(u, self.config.k, dim=-1)   # Eq. 13
        y = F.embedding_bag(top_index, self.values, per_sample_weights=top_values,
                            mode="sum")                                 # Eq. 14
        return y.reshape(x.shape)
