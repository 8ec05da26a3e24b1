"""The expert-store contract: the parameters of the experts and the arithmetic over them.

A store never knows how its experts were chosen; a router never knows how they are computed.
Every routed layer is a router plus a store (:class:`~sparseffn.routing.RoutedFFN`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..routing import Routing


class ExpertStore(nn.Module):
    """``store(x: [T, d_model], routing) -> [T, d_out]``: ``Σ_j w_tj · expert_{i_tj}(x_t)``
    over each token's selected experts, with ``routing.indices`` and ``routing.weights``
    [T, k] (or, for a ``dense`` routing, the weights [T, E] of every expert).

    Subclasses own their parameters, say how many experts they hold (``num_experts``) and
    implement ``forward`` and ``reset_parameters``.
    """

    num_experts: int
    d_model: int
    d_out: int

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        raise NotImplementedError

    def reset_parameters(self) -> None:
        raise NotImplementedError

    def sparse_grad_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients are sparse tensors (none, unless a store says so)."""
        return []

    def input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype this store casts ``x`` to before its products (under autocast), or None
        where it reads ``x`` as it comes. A layer whose router casts ``x`` to the same dtype
        casts it once for both (:class:`~sparseffn.routing.RoutedFFN`)."""
        return None
