"""Layers over product-key retrieval: the product-key memory (PKM; Lample et al. 2019, seed 001
§3.2) and PEER (seed 002 §3). Both are a :class:`ProductKeyRouter` in front of a table of
single rows, read with gathered-row kernels (``ops/rows.py``) that never copy the retrieved
rows out per token."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..activations import activation_fn
from ..config import PEERConfig, PKMConfig
from ..init import dense_init_std
from ..ops.rows import gather_dot, gather_sum
from ..routers.product_keys import ProductKeyRouter
from ..routing import SparseFFN


class ProductKeyMemory(SparseFFN):
    """``y = Σ_heads Σ_{i ∈ top-k} act(s_i) v_i`` (seed 001 Eq. 14-15): each head retrieves
    the top k of ``num_subkeys²`` product keys and adds the matching value rows, weighted by
    the softmax (or ReLU) of their scores.

    Parameters: ``router.*`` (sub-keys, optional query network and norm) and ``values``
    [num_subkeys², d_model], shared by the heads.

    After each forward, ``routing_stats``: ``counts`` (per value row, how many (token, head)
    retrievals read it) and ``mass`` (their summed weights), over ``num_values`` rows.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: PKMConfig | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config = config if config is not None else PKMConfig(**kwargs)
        self.d_model = config.d_model
        self.router = ProductKeyRouter(config.retrieval())
        self.values = nn.Parameter(torch.empty(config.num_values, config.d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``"lample"``: sub-keys N(0, 1/sqrt(key_dim/2)), values N(0, 1/sqrt(d_model));
        ``"dense"``: each full key N(0, sqrt(2/(d_model n_layers))) per entry like the dense
        W1 rows, values like W2 of an MLP of width num_values (seed 001 §5)."""
        cfg = self.config
        if cfg.init == "lample":
            self.router.reset_parameters()
            self.values.normal_(0.0, 1 / math.sqrt(cfg.d_model))
        else:
            self.router.reset_parameters(key_std=dense_init_std(cfg.d_model, cfg.n_layers))
            self.values.normal_(0.0, dense_init_std(cfg.num_values, cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x2 = x.reshape(-1, self.d_model)
        routing = self.router(x2)
        y = gather_sum(routing.indices, routing.weights, self.values,         # Eq. 14
                       sparse_grad=self.config.sparse_grad)
        self._record_routing(routing, self.config.num_values)
        return y.reshape(x.shape).to(x.dtype)

    def sparse_grad_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are sparse (``config.sparse_grad``)."""
        return [self.values] if self.config.sparse_grad else []

    def extra_repr(self) -> str:
        cfg = self.config
        return f"d_model={cfg.d_model}, num_values={cfg.num_values}, activation={cfg.activation}"


class PEER(SparseFFN):
    """``f(x) = Σ_heads Σ_{i ∈ I_h} g_i(x) σ(u_iᵀ x) v_i`` (seed 002 §3.2): ``num_experts``
    single-neuron experts, the top k per head retrieved by product keys, router scores
    ``g = softmax`` (or sigmoid) of the retrieved keys' scores.

    Parameters: ``router.*`` (query networks, optional query norm, sub-keys) and the experts as
    two embedding tables ``w_in`` [N, d_model] (rows u_i) and ``w_out`` [N, d_model] (rows
    v_i), shared by the heads. Per token only the ``heads · k`` retrieved rows of each table
    are read: ``σ(u_iᵀ x)`` as gathered dot products and ``Σ g σ v`` as a gathered sum, neither
    materialising [T, heads·k, d_model] weights.

    After each forward, ``routing_stats``: ``counts`` (per expert, how many (token, head)
    retrievals chose it) and ``mass`` (their summed router scores).

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: PEERConfig | None = None, **kwargs) -> None:
        super().__init__()
        self.config = config = config if config is not None else PEERConfig(**kwargs)
        self.d_model = config.d_model
        self.router = ProductKeyRouter(config.retrieval())
        self.w_in = nn.Parameter(torch.empty(config.num_experts, config.d_model))
        self.w_out = nn.Parameter(torch.empty(config.num_experts, config.d_model))
        self.activation = activation_fn(config.activation)
        self.hidden_dropout = nn.Dropout(config.dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``w_in`` N(0, sqrt(2/(d_model n_layers))) and ``w_out`` N(0, sqrt(2/(heads·k
        n_layers))): seed 001 §5's dense init for an MLP whose hidden layer is the heads·k
        retrieved neurons."""
        cfg = self.config
        self.router.reset_parameters()
        self.w_in.normal_(0.0, dense_init_std(cfg.d_model, cfg.n_layers))
        self.w_out.normal_(0.0, dense_init_std(cfg.heads * cfg.k, cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x2 = x.reshape(-1, self.d_model)
        routing = self.router(x2)
        sparse = self.config.sparse_grad
        hidden = self.activation(gather_dot(x2, self.w_in, routing.indices,      # σ(u_iᵀ x)
                                            sparse_grad=sparse))
        hidden = self.hidden_dropout(hidden)
        y = gather_sum(routing.indices, routing.weights.to(hidden.dtype) * hidden, self.w_out,
                       sparse_grad=sparse)
        self._record_routing(routing, self.config.num_experts)
        return y.reshape(x.shape).to(x.dtype)

    def sparse_grad_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are sparse (``config.sparse_grad``)."""
        return [self.w_in, self.w_out] if self.config.sparse_grad else []

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"d_model={cfg.d_model}, num_experts={cfg.num_experts}, heads={cfg.heads}, "
                f"k={cfg.k}, activation={cfg.activation}, score={cfg.score}")
