"""The fast feed-forward layer: a tree router over 2^depth leaf MLPs (Belcak & Wattenhofer;
seeds 003 and 000)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..activations import activation_fn
from ..config import FFFConfig
from ..init import dense_init_std
from ..ops import DispatchPlan, expert_mlp
from ..routers.tree import TreeRouter
from ..routing import SparseFFN


class FastFeedForward(SparseFFN):
    """``y = Σ_i R(i|x) f_i(x)`` (seed 003 Eq. 5) over ``2^depth`` leaves
    ``f_i(x) = W2_i act(W1_i x + b1_i) + b2_i``, with the leaf distribution ``R`` of the
    router tree (Eq. 9, any formulation and activation; see :class:`TreeRouter`).

    Modes (``FFFConfig.train_mode`` / ``eval_mode``):
      soft:  every leaf, weighted by R (the papers' training forward; one dense GEMM pair);
      topk:  the k most probable leaves, weighted by their R, through CVMM (sparse training);
      hard:  greedy descent to one leaf per token, weight 1 (seed 003 §1.2): ``depth`` node
             dot products and one leaf MLP per token. Equal to the soft formula with the
             chosen leaf's weight set to one and the others to zero; the leaf bias included.

    Parameters: ``router.*``; ``w1`` [L, leaf_width, d_model] and ``b1`` [L, leaf_width];
    ``w2`` [L, leaf_width, d_out] and ``b2`` [L, d_out] (biases when ``bias``).

    After each forward, ``routing_stats``: ``counts`` (tokens whose largest-weight leaf is i),
    ``mass`` (Σ over tokens of the weight of leaf i) and, in the soft mode, ``entropy`` (mean
    leaf-distribution entropy, nats).

    forward(x: [..., d_model]) -> [..., d_out]
    """

    def __init__(self, config: FFFConfig | None = None, **kwargs) -> None:
        super().__init__()
        config = config if config is not None else FFFConfig(**kwargs)
        self.config = config
        self.d_model, self.depth = config.d_model, config.depth
        self.router = TreeRouter(config.router_config(), config.d_model, config.num_leaves,
                                 config.k, init="sigma_moe", n_layers=config.n_layers)
        leaves, width, d_out = config.num_leaves, config.leaf_width, config.output_width
        self.w1 = nn.Parameter(torch.empty(leaves, width, config.d_model))
        self.w2 = nn.Parameter(torch.empty(leaves, width, d_out))
        self.b1 = nn.Parameter(torch.empty(leaves, width)) if config.bias else None
        self.b2 = nn.Parameter(torch.empty(leaves, d_out)) if config.bias else None
        self.hidden_dropout = nn.Dropout(config.dropout)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``init="fff"``: W1, b1 uniform ±1/sqrt(d_model), W2, b2 uniform ±1/sqrt(leaf_width)
        (the ``fastfeedforward`` package); ``"sigma_moe"``: W1 ~ N(0, sqrt(2/(d_model
        n_layers))), W2 ~ N(0, sqrt(2/(L·leaf_width·n_layers))), zero biases (seed 001 §5)."""
        cfg = self.config
        if cfg.init == "fff":
            for params, fan_in in (((self.w1, self.b1), cfg.d_model),
                                   ((self.w2, self.b2), cfg.leaf_width)):
                bound = 1 / math.sqrt(fan_in)
                for p in params:
                    if p is not None:
                        p.uniform_(-bound, bound)
        else:
            self.w1.normal_(0.0, dense_init_std(cfg.d_model, cfg.n_layers))
            self.w2.normal_(0.0, dense_init_std(cfg.num_leaves * cfg.leaf_width, cfg.n_layers))
            for p in (self.b1, self.b2):
                if p is not None:
                    p.zero_()
        self.router.reset_parameters()

    @property
    def mode(self) -> str:
        """The mode the next forward runs in."""
        return self.config.train_mode if self.training else self.config.resolved_eval_mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input(x)
        x2 = x.reshape(-1, self.d_model)
        mode = "topk" if self.mode == "sparse" else self.mode
        if mode == "soft":
            probs = self.router.leaf_probs(x2)
            y = self.soft_output(x2, probs)
            self._record(probs.max(dim=-1).indices, probs.detach().sum(0), probs)
        else:
            if mode == "hard":
                indices = self.router.hard_leaves(x2)[:, None]                  # [T, 1]
                weights = torch.ones(indices.shape, dtype=x2.dtype, device=x2.device)
            else:
                routing = self.router(x2)
                indices, weights = routing.indices, routing.weights
            y = self.sparse_output(x2, indices, weights)
            mass = torch.zeros(self.config.num_leaves, device=x2.device)
            mass.index_add_(0, indices.reshape(-1), weights.detach().reshape(-1).float())
            self._record(indices[:, 0], mass, None)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def soft_output(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``Σ_i R_i f_i(x)`` over every leaf: the leaves' hidden layers as one GEMM
        [T, L·leaf_width], each leaf's block scaled by R_i, then one GEMM back.

        x: [T, d_model]; probs: [T, L]; returns [T, d_out]."""
        tokens = x.shape[0]
        leaves, width, d_model = self.w1.shape
        hidden = nn.functional.linear(x, self.w1.reshape(leaves * width, d_model),
                                      None if self.b1 is None else self.b1.reshape(-1))
        hidden = self.hidden_dropout(activation_fn(self.config.leaf_activation)(hidden))
        probs = probs.to(hidden.dtype)
        hidden = (hidden.view(tokens, leaves, width) * probs.unsqueeze(-1)).view(tokens, -1)
        y = hidden @ self.w2.reshape(leaves * width, -1)
        return y if self.b2 is None else y + probs @ self.b2.to(y.dtype)

    def sparse_output(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                      ) -> torch.Tensor:
        """``Σ_j w_j f_{i_j}(x)`` over each token's selected leaves, through CVMM.

        x: [T, d_model]; indices, weights: [T, k]; returns [T, d_out]."""
        plan = DispatchPlan.build(indices, self.config.num_leaves)
        dropout = self.hidden_dropout if self.training and self.hidden_dropout.p > 0 else None
        return expert_mlp(x, plan, self.w1, self.w2, weights.to(x.dtype),
                          activation=self.config.leaf_activation, hidden_dropout=dropout,
                          b1=self.b1, b2=self.b2, indices=indices)

    def _record(self, top_leaf: torch.Tensor, mass: torch.Tensor,
                probs: torch.Tensor | None) -> None:
        self.aux_losses = {}
        with torch.no_grad():
            counts = torch.bincount(top_leaf, minlength=self.config.num_leaves).float()
            stats = {}
            if probs is not None:
                p = probs.detach().float()
                stats["entropy"] = -(p * p.clamp_min(1e-30).log()).sum(-1).mean()
            self._record_usage(counts, mass.float(), stats)

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"d_model={cfg.d_model}, depth={cfg.depth}, leaf_width={cfg.leaf_width}, "
                f"d_out={cfg.output_width}, activation={cfg.activation}, "
                f"train_mode={cfg.train_mode}, eval_mode={cfg.resolved_eval_mode}")
