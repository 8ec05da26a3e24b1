"""The fast feed-forward tree as a router (Chaunin & Mikhailovskiy §1.2-2.3): node logits, the leaf
distribution in any formulation, top-k leaves, and greedy hard descent."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from ..losses import usage_entropy_loss
from ..ops import fff
from ..ops.fff import SOFT_FORMULATIONS, TREE_ACTIVATIONS
from ..ops.precision import autocast_off, routing_dtype
from ..ops.sizes import exported_for_any_size
from ..registry import RouterConfig, implements
from ..routing import Routing
from ..validation import (matrix_tuple, require_bool, require_choice, require_non_negative,
                          require_positive_int)
from .base import Router, init_selection_

TREE_FORMULATIONS = ("auto",) + SOFT_FORMULATIONS
TREE_INITS = ("fff", "layer")


def tree_depth(num_leaves: int, owner: str) -> int:
    """d for ``num_leaves = 2^d`` leaves (d >= 1); ValueError otherwise."""
    depth = int(num_leaves).bit_length() - 1 if isinstance(num_leaves, int) else -1
    if depth < 1 or (1 << depth) != num_leaves:
        raise ValueError(f"{owner}: a binary tree has 2^depth leaves (depth >= 1), so "
                         f"num_experts must be a power of two >= 2, got {num_leaves}")
    return depth


@dataclass(frozen=True)


class TreeRouterConfig(RouterConfig):
    """A fast feed-forward tree (Belcak & Wattenhofer 2023; Chaunin & Mikhailovskiy) over
    ``num_experts = 2^depth`` leaf experts: ``2^depth - 1`` nodes with logits ``z = W x + b``,
    leaf probabilities ``R = softmax(T a(S z))`` (Chaunin & Mikhailovskiy Eq. 9), then top-k.

    activation: ``a``: ``"logsigmoid"`` (the original FFF, Eq. 8: R is the product of the
      sigmoids on the path), ``"softplus"`` (Chaunin & Mikhailovskiy's default), ``"linear"``,
      ``"relu"``,
      ``"gelu"`` (Chaunin & Mikhailovskiy §2.3).
    formulation: how R is computed (all give the same R; see :mod:`sparseffn.ops.fff`):
      ``"orig"``, ``"logs"``, ``"matrix"``, ``"matrix_sparse"``, ``"levelwise"`` or
      ``"auto"`` (levelwise).
    node_width: 1: each node is one neuron, ``z_n = w_n·x + b_n`` (as in the
      ``fastfeedforward`` package and Chaunin & Mikhailovskiy's router benchmark); h > 1: each
      node is a small MLP with h hidden ReLU units and one output (Chaunin & Mikhailovskiy §3.1
      uses 8 or 16).
    bias: node biases.
    renormalize: rescale the k selected leaf probabilities to sum to one.
    t_matrix, s_matrix: explicit T [E, m] and S [m, n] of Eq. 9 instead of the tree's (the
      router then has n nodes and ``formulation`` must be ``"matrix"`` or ``"auto"``);
      ``T = S = I`` with ``activation="linear"`` is the softmax MoE router.
    init: ``"fff"``: uniform ±1/sqrt(d_model) for the node weights and biases, as in the
      ``fastfeedforward`` package; ``"layer"``: the layer's init scheme for the weights and zero
      biases.
    entropy_weight: γ of σ-MoE's batch-entropy regulariser (Csordás et al. 2023 Eq. 34-35)
      taken over the leaf distribution R: ``Σ_i p_i log p_i`` with ``p`` the batch mean of R,
      recorded whenever the top-k leaves are chosen (a sparse FFF in training; an MoE layer
      with this router). Without it a tree trained on its top-k leaves starves leaves (no
      gradient reaches a leaf that no token picks); the papers train soft, where every leaf
      is computed and this does not arise. The default, 10× σ-MoE's 0.001: on the
      ``fff_sparse`` LM preset it ended the starvation and kept usage near uniform, at the
      best bpc of the weights tried (0 to 0.1; docs/fff.md).
    """

    type_name: ClassVar[str] = "tree"

    activation: str = "logsigmoid"
    formulation: str = "auto"
    node_width: int = 1
    bias: bool = True
    renormalize: bool = False
    t_matrix: Any = None
    s_matrix: Any = None
    init: str = "fff"
    entropy_weight: float = 0.01

    def __post_init__(self) -> None:
        require_choice(self, "activation", TREE_ACTIVATIONS)
        require_choice(self, "formulation", TREE_FORMULATIONS)
        require_positive_int(self, "node_width")
        require_bool(self, "bias")
        require_bool(self, "renormalize")
        require_choice(self, "init", TREE_INITS)
        require_non_negative(self, "entropy_weight")
        object.__setattr__(self, "t_matrix", matrix_tuple(self, "t_matrix"))
        object.__setattr__(self, "s_matrix", matrix_tuple(self, "s_matrix"))
        if (self.t_matrix is None) != (self.s_matrix is None):
            raise ValueError("TreeRouterConfig: give both t_matrix and s_matrix, or neither")
        if self.explicit:
            if len(self.t_matrix[0]) != len(self.s_matrix):
                raise ValueError(f"TreeRouterConfig: t_matrix has {len(self.t_matrix[0])} "
                                 f"columns but s_matrix has {len(self.s_matrix)} rows")
            if self.formulation not in ("auto", "matrix"):
                raise ValueError(f"TreeRouterConfig: explicit t_matrix/s_matrix need "
                                 f"formulation 'matrix' (or 'auto'), got {self.formulation!r}")
            if self.node_width != 1:
                raise ValueError("TreeRouterConfig: explicit t_matrix/s_matrix need node_width=1")

    @property
    def explicit(self) -> bool:
        """True when T and S are given rather than the tree's."""
        return self.t_matrix is not None

    def num_nodes(self, num_experts: int) -> int:
        return len(self.s_matrix[0]) if self.explicit else num_experts - 1

    def check_layer(self, num_experts: int, k: int) -> None:
        if self.explicit:
            if len(self.t_matrix) != num_experts:
                raise ValueError(f"TreeRouterConfig: t_matrix has {len(self.t_matrix)} rows "
                                 f"but the layer has num_experts={num_experts}")
        else:
            tree_depth(num_experts, "TreeRouterConfig")
        if not 1 <= k <= num_experts:
            raise ValueError(f"TreeRouterConfig: k must be in [1, num_experts={num_experts}], "
                             f"got {k}")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"entropy": self.entropy_weight}

    def num_params(self, d_model: int, num_experts: int) -> int:
        nodes, h = self.num_nodes(num_experts), self.node_width
        if h == 1:
            return nodes * (d_model + int(self.bias))
        # hidden layer (weights + biases) and the output neuron (weights + bias)
        return nodes * (h * d_model + h + h + int(self.bias))


# From depth _PADDED_MIN_DEPTH the node logits are computed with the weight padded to 2^d rows:
# a GEMM with 2^d - 1 output columns is slower than with 2^d. On one 2-core AVX-512 machine
# (MKL) it measured up to 1.6x slower at d = 6-7, and elsewhere the padded weight's copy cost
# about what it saved; on a 2-core AVX2 machine, padded / plain time (copy included, median of
# interleaved rounds) was 0.46-0.74 at 2,048 tokens and 0.54-0.99 at 512 for every depth 4-13,
# d_model 256 and 1024 (depth 12, d_model 1024: 124 against 170 ms), but 0.80-1.09 at depths
# 2-3 and 1.6-2.4 at depth 1, hence _PADDED_MIN_DEPTH. Only from
# _PADDED_MIN_TOKENS tokens: below, the copy and the slice cost more than the GEMM saves
# (padded / plain time 1.0-1.1 at 256 tokens, 1.2-2.8 at 16, on the first machine).
_PADDED_MIN_DEPTH = 4
_PADDED_MIN_TOKENS = 512


@implements(TreeRouterConfig)
class TreeRouter(Router):
    """``R = softmax(T a(S z))`` over ``num_experts = 2^depth`` leaves (Chaunin & Mikhailovskiy
    Eq. 9), then the top-k leaves with their probabilities as weights.

    Parameters: ``weight`` [N, d_model] and ``bias`` [N] (node_width 1: one neuron per node);
    with node_width h > 1, ``weight`` [N·h, d_model] and ``hidden_bias`` [N·h] are the nodes'
    hidden layers, ``out_weight`` [N, h] and ``bias`` [N] their output neurons. With explicit
    T and S (buffers ``T``, ``S``) there are ``S.shape[1]`` nodes and no tree.

    Also: :meth:`node_logits` (z [T, N]), :meth:`leaf_probs` (R [T, L]) and
    :meth:`hard_leaves` (greedy descent, [T]).
    """

    def __init__(self, config: TreeRouterConfig, d_model: int, num_experts: int, k: int,
                 init: str = "sigma_moe", init_depth: int = 1) -> None:
        super().__init__(config, d_model, num_experts, k, init, init_depth)
        self.depth = None if config.explicit else tree_depth(num_experts, "TreeRouter")
        self.num_nodes = config.num_nodes(num_experts)
        h = config.node_width
        self.weight = nn.Parameter(torch.empty(self.num_nodes * h, d_model))
        self.bias = nn.Parameter(torch.empty(self.num_nodes)) if config.bias else None
        if h > 1:
            self.hidden_bias = nn.Parameter(torch.empty(self.num_nodes * h))
            self.out_weight = nn.Parameter(torch.empty(self.num_nodes, h))
        if config.explicit:
            self.register_buffer("T", torch.tensor(config.t_matrix))
            self.register_buffer("S", torch.tensor(config.s_matrix))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """``init="fff"``: every node parameter uniform in ±1/sqrt(fan_in) (the
        ``fastfeedforward`` package); ``"layer"``: the weights by the layer's scheme
        (:func:`init_selection_`), biases zero."""
        cfg = self.config
        bound = 1 / math.sqrt(self.d_model)
        if cfg.init == "fff":
            self.weight.uniform_(-bound, bound)
        else:
            init_selection_(self.weight, self.init, self.init_depth)
        biases = [self.bias] + ([self.hidden_bias] if cfg.node_width > 1 else [])
        for bias in biases:
            if bias is None:
                continue
            if cfg.init == "fff":
                bias.uniform_(-bound, bound)
            else:
                bias.zero_()
        if cfg.node_width > 1:
            out_bound = 1 / math.sqrt(cfg.node_width)
            self.out_weight.uniform_(-out_bound, out_bound)

    def node_logits(self, x: torch.Tensor) -> torch.Tensor:
        """z [T, N] in float32, float64 for a float64 ``x`` (the routing decision runs at full
        precision under autocast and in a half-precision module)."""
        with autocast_off(x.device.type):
            x = x.to(routing_dtype(x.dtype))
            if self.config.node_width == 1:
                return self._linear_logits(x)
            hidden = F.relu(F.linear(x, self.weight.to(x.dtype), self.hidden_bias.to(x.dtype)))
            z = (hidden.view(x.shape[0], self.num_nodes, self.config.node_width)
                 * self.out_weight.to(x.dtype)).sum(-1)
            return z if self.bias is None else z + self.bias.to(x.dtype)

    def _linear_logits(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias, nodes = self.weight.to(x.dtype), self.bias, self.num_nodes
        if (self.depth is not None and self.depth >= _PADDED_MIN_DEPTH
                and x.device.type == "cpu" and not exported_for_any_size(x.shape[0])
                and x.shape[0] >= _PADDED_MIN_TOKENS):   # (a guard, when exported, if first)
            weight = F.pad(weight, (0, 0, 0, 1))
            bias = None if bias is None else F.pad(bias.to(x.dtype), (0, 1))
            return F.linear(x, weight, bias)[:, :nodes]
        return F.linear(x, weight, None if bias is None else bias.to(x.dtype))

    def leaf_probs(self, x: torch.Tensor, formulation: str | None = None) -> torch.Tensor:
        """R(i|x) [T, num_experts] (float32; float64 for a float64 ``x``) in ``formulation``
        (default: the config's)."""
        z = self.node_logits(x)
        if self.config.explicit:
            return fff.leaf_probs_matrix(z, self.config.activation, self.T, self.S)
        return fff.leaf_probs(z, formulation or self.config.formulation, self.config.activation)

    @torch.no_grad()
    def hard_leaves(self, x: torch.Tensor) -> torch.Tensor:
        """Greedy descent (Chaunin & Mikhailovskiy §1.2): int64 [T], one node per level per token,
        going left where the node's logit is positive. The logits are computed in float32
        (float64 for a float64 ``x``) whatever the module's dtype or autocast, as
        :meth:`node_logits` computes them."""
        if self.depth is None:
            raise ValueError("hard inference needs the tree (this router has explicit T and S)")
        dtype = routing_dtype(x.dtype)
        x = x.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        if self.config.node_width == 1:   # (an operator: it runs with autocast off)
            return fff.descend(x, self.weight.to(dtype), bias)
        h = self.config.node_width
        weight = self.weight.to(dtype).view(self.num_nodes, h, self.d_model)
        hidden_bias = self.hidden_bias.to(dtype).view(self.num_nodes, h)
        out_weight = self.out_weight.to(dtype)

        def node_logit(level: int, node: torch.Tensor) -> torch.Tensor:
            hidden = F.relu(torch.bmm(weight.index_select(0, node), x[:, :, None])[:, :, 0]
                            + hidden_bias.index_select(0, node))           # [T, h]
            z = (hidden * out_weight.index_select(0, node)).sum(-1)
            return z if bias is None else z + bias.index_select(0, node)
        with autocast_off(x.device.type):   # the bmm would run in the autocast dtype
            return fff.descend_from_logits_fn(node_logit, self.depth, x.shape[0], x.device)

    def forward(self, x: torch.Tensor) -> Routing:
        """The top-k leaves by R, their probabilities as weights; ``aux_losses["entropy"]``
        is the batch-entropy regulariser over R (``TreeRouterConfig.entropy_weight``)."""
        probs = self.leaf_probs(x)                                             # [T, L]
        weights, indices = probs.topk(self.k, dim=-1)
        if self.config.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        aux = {"entropy": usage_entropy_loss(probs, self.global_batch)} \
            if self.computes_aux_losses else {}
        return Routing(indices, weights, aux_losses=aux)

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, depth={self.depth}, "
                f"activation={self.config.activation}, formulation={self.config.formulation}")
