"""Top-K of the hidden activations as a router (Csordás, Irie & Schmidhuber 2023,
arXiv:2310.10837, §3.1): the "experts" are the d_ff hidden units of an MLP, and a token uses
the K whose activations are largest, weighted by those activations."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from ..activations import activation_fn
from ..routing import Routing


class TopKActivationRouter(nn.Module):
    """``u = act(W1 x)`` (their Eq. 1), keep the K largest entries (Eq. 13): indices [T, K]
    of the kept hidden units and their activations as weights.

    Parameters: ``keys`` [d_ff, d_model] (W1, rows k_i), ``N(0, std)``. The first layer is
    computed in full: top-K alone cannot save it (as the paper notes).

    forward(x: [T, d_model]) -> Routing(indices [T, K], weights [T, K])
    """

    def __init__(self, d_model: int, d_ff: int, k: int, activation: str = "relu",
                 std: float = 1.0) -> None:
        super().__init__()
        self.d_model, self.num_experts, self.k = d_model, d_ff, k
        self.activation_name, self.std = activation, std
        self.activation = activation_fn(activation)
        self.keys = nn.Parameter(torch.empty(d_ff, d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        self.keys.normal_(0.0, self.std)

    def aux_loss_weights(self) -> dict[str, float]:
        """Top-K has no auxiliary loss."""
        return {}

    def forward(self, x: torch.Tensor) -> Routing:
        u = self.activation(F.linear(x, self.keys.to(x.dtype)))        # [T, d_ff]  (Eq. 1)
        weights, indices = torch.topk(u, self.k, dim=-1)                # Eq. 13
        return Routing(indices=indices, weights=weights)

    def extra_repr(self) -> str:
        return (f"d_model={self.d_model}, d_ff={self.num_experts}, k={self.k}, "
                f"activation={self.activation_name}")
