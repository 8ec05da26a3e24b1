"""The fast feed-forward layer: a tree router over 2^depth leaf MLPs (Belcak & Wattenhofer;
Chaunin & Mikhailovskiy)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..activations import ACTIVATIONS
from ..registry import (LayerConfig, LayerCost, config_argument, implements,
                        renamed_fields, resolve_router)
from ..routers.tree import TreeRouter, TreeRouterConfig
from ..routing import RoutedFFN, Routing
from ..stores import MLPExperts
from ..validation import (require_bool, require_choice, require_k, require_positive_int,
                          require_probability)


FFF_TRAIN_MODES = ("soft", "sparse")
FFF_EVAL_MODES = ("soft", "topk", "hard")


@renamed_fields(n_layers="init_depth", node_width="router.node_width",
                activation="router.activation", formulation="router.formulation",
                renormalize="router.renormalize", t_matrix="router.t_matrix",
                s_matrix="router.s_matrix")
@dataclass(frozen=True)
class FFFConfig(LayerConfig):
    """A fast feed-forward tree (Belcak & Wattenhofer 2023; Chaunin & Mikhailovskiy §1.2-2.3):
    ``depth``
    levels of router nodes over ``2^depth`` leaf experts, each a two-layer MLP
    ``W2 act(W1 x + b1) + b2`` with ``leaf_width`` hidden units.

    Fields
    - ``d_out``: output width (None: d_model, the drop-in case; a classifier sets its classes).
    - ``router``: the :class:`~sparseffn.routers.TreeRouterConfig` (the tree's activation
      ``a``, formulation, node width, renormalisation, explicit T/S). None, or a dict without
      ``type`` (a TOML ``[ffn.router]`` table) changing only the fields it names: the tree
      whose node biases follow ``bias`` and whose init follows ``init``. The flat
      ``activation``, ``formulation``, ``node_width``, ``renormalize``, ``t_matrix`` and
      ``s_matrix`` of earlier releases still work, with a ``DeprecationWarning``.
    - ``bias``: biases in the leaves (and, unless ``router`` says otherwise, the nodes).
    - ``leaf_activation``: ``"relu"`` or ``"gelu"`` inside the leaves.
    - ``dropout``: on the leaves' hidden units during training (as ``fastfeedforward``).
    - ``train_mode``: ``"soft"`` (every leaf weighted by R, as in the papers) or ``"sparse"``
      (the top-k leaves by R, through CVMM; beyond the papers).
    - ``eval_mode``: ``"soft"``, ``"topk"`` (k leaves by R), or ``"hard"`` (greedy descent,
      one leaf with weight 1: d node dot products per token); None: like training (soft ->
      soft, sparse -> topk).
    - ``k``: leaves per token in the sparse modes.
    - ``init``: ``"fff"`` (uniform ±1/sqrt(fan_in) everywhere, as ``fastfeedforward``) or
      ``"sigma_moe"`` (leaves like the dense MLP of width 2^depth·leaf_width, Csordás et al. 2023
      §5; nodes by the σ-MoE selection init).
    """

    type_name: ClassVar[str] = "fff"

    d_model: int
    depth: int
    leaf_width: int
    d_out: int | None = None
    router: Any = None
    leaf_activation: str = "relu"
    bias: bool = True
    dropout: float = 0.0
    train_mode: str = "soft"
    eval_mode: str | None = None
    k: int = 1
    init: str = "fff"
    init_depth: int = 1

    def __post_init__(self) -> None:
        for name in ("d_model", "depth", "leaf_width", "init_depth"):
            require_positive_int(self, name)
        if self.depth > 24:
            raise ValueError(f"FFFConfig.depth must be at most 24 (2^24 leaves), got {self.depth}")
        if self.d_out is not None:
            require_positive_int(self, "d_out")
        require_choice(self, "leaf_activation", ACTIVATIONS)
        require_choice(self, "train_mode", FFF_TRAIN_MODES)
        if self.eval_mode is not None:
            require_choice(self, "eval_mode", FFF_EVAL_MODES)
        require_choice(self, "init", ("fff", "sigma_moe"))
        require_probability(self, "dropout")
        require_bool(self, "bias")
        require_k(self, "num_leaves")
        default = TreeRouterConfig(bias=self.bias, init="fff" if self.init == "fff" else "layer")
        object.__setattr__(self, "router", resolve_router(self.router, default, TreeRouterConfig,
                                                          "FFFConfig"))
        if self.router.formulation == "matrix" and self.depth > 14:
            raise ValueError(f"FFFConfig: formulation 'matrix' stores a dense T of 2^depth x "
                             f"2^(depth+1) floats; use 'levelwise' or 'auto' for depth "
                             f"{self.depth} > 14")
        self.router.check_layer(self.num_leaves, self.k)
        if self.resolved_eval_mode == "hard" and self.router.explicit:
            raise ValueError("FFFConfig: eval_mode 'hard' descends the tree; it is not defined "
                             "for explicit t_matrix/s_matrix")

    @property
    def num_leaves(self) -> int:
        return 1 << self.depth

    @property
    def num_nodes(self) -> int:
        return (1 << self.depth) - 1

    @property
    def output_width(self) -> int:
        return self.d_model if self.d_out is None else self.d_out

    @property
    def resolved_eval_mode(self) -> str:
        if self.eval_mode is not None:
            return self.eval_mode
        return "soft" if self.train_mode == "soft" else "topk"

    def router_config(self) -> TreeRouterConfig:
        """The tree router (``router``)."""
        return self.router

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["router"] = self.router.to_dict()
        return data

    def cost(self) -> LayerCost:
        """Counted for the evaluation forward (``resolved_eval_mode``): soft reads every node
        and leaf, topk every node and k leaves, hard ``depth`` nodes and one leaf."""
        bias = int(self.bias)
        leaf = (self.d_model * self.leaf_width + self.leaf_width * self.output_width
                + bias * (self.leaf_width + self.output_width))
        tree = self.router_config()
        num_nodes = tree.num_nodes(self.num_leaves)
        router = tree.num_params(self.d_model, self.num_leaves)
        per_node = router // num_nodes
        leaf_flops = 2 * (self.d_model + self.output_width) * self.leaf_width
        width = self.router.node_width
        node_flops = 2 * self.d_model * width + (2 * width if width > 1 else 0)
        mode = self.resolved_eval_mode
        nodes_read = self.depth if mode == "hard" else num_nodes
        leaves_read = {"soft": self.num_leaves, "topk": self.k, "hard": 1}[mode]
        return LayerCost(total_params=router + self.num_leaves * leaf,
                         active_params=nodes_read * per_node + leaves_read * leaf,
                         flops=nodes_read * node_flops + leaves_read * leaf_flops,
                         expert_flops=leaves_read * leaf_flops)


@implements(FFFConfig)
class FastFeedForward(RoutedFFN):
    """``y = Σ_i R(i|x) f_i(x)`` (Belcak & Wattenhofer 2023, arXiv:2308.14711; Eq. 5 of the
    matrix-FFF note of Chaunin & Mikhailovskiy) over ``2^depth`` leaves
    ``f_i(x) = W2_i act(W1_i x + b1_i) + b2_i``: a :class:`TreeRouter` (any formulation and
    activation of the leaf distribution ``R``, their Eq. 9) plus an
    :class:`~sparseffn.stores.MLPExperts` store of leaves.

    Modes (``FFFConfig.train_mode`` / ``eval_mode``), all expressed as a routing:
      soft:  every leaf, weighted by R (the papers' training forward): a dense routing, which
             the store computes as one GEMM pair;
      topk:  the k most probable leaves, weighted by their R, through CVMM (sparse training);
      hard:  greedy descent to one leaf per token, weight 1 (Belcak & Wattenhofer §3):
             ``depth`` node dot products and one leaf MLP per token. Equal to the soft formula
             with the chosen leaf's weight set to one and the others to zero, leaf bias
             included.

    Parameters: ``router.*``; ``store.w1`` [L, leaf_width, d_model] and ``store.b1``
    [L, leaf_width]; ``store.w2`` [L, leaf_width, d_out] and ``store.b2`` [L, d_out] (biases
    when ``bias``).

    After each forward, ``routing_stats``: ``counts`` (the (token, leaf) pairs computed: every
    token for every leaf in the soft mode), ``mass`` (Σ over tokens of the weight of leaf i)
    and, in the soft mode, ``entropy`` (mean leaf-distribution entropy, nats); inside
    :func:`sparseffn.no_usage_statistics` none of the three.

    forward(x: [..., d_model]) -> [..., d_out]
    """

    _renamed_parameters = {"w1": "store.w1", "w2": "store.w2", "b1": "store.b1",
                           "b2": "store.b2"}
    usage_stats = ("counts", "mass", "entropy")

    def __init__(self, config: FFFConfig | None = None, **kwargs) -> None:
        config = config_argument(FFFConfig, config, kwargs, type(self).__name__)
        router = TreeRouter(config.router_config(), config.d_model, config.num_leaves,
                            config.k, init="sigma_moe", init_depth=config.init_depth)
        store = MLPExperts(config.num_leaves, config.d_model, config.leaf_width,
                           config.output_width, activation=config.leaf_activation,
                           bias=config.bias, dropout=config.dropout, init=config.init,
                           init_depth=config.init_depth)
        super().__init__(router, store)
        self.config = config
        self.depth = config.depth
        # Drawn again after the experts, as in earlier releases: a seed gives the same weights.
        self.router.reset_parameters()

    @property
    def mode(self) -> str:
        """The mode the next forward runs in."""
        return self.config.train_mode if self.training else self.config.resolved_eval_mode

    def route(self, x: torch.Tensor) -> Routing:
        mode = self.mode
        if mode == "soft":
            probs = self.router.leaf_probs(x)                                  # [T, L]
            if not self.counts_usage:       # a usage statistic: not at a decode step
                return Routing.all_experts(probs)
            with torch.no_grad():   # entr(p) = -p log p, and 0 at p = 0: three operators
                entropy = torch.special.entr(probs.detach().float()).sum(-1).mean()
            return Routing.all_experts(probs, stats={"entropy": entropy})
        if mode == "hard":
            indices = self.router.hard_leaves(x)[:, None]                      # [T, 1]
            return Routing(indices, torch.ones(indices.shape, dtype=x.dtype, device=x.device))
        return self.router(x)                                                  # topk / sparse

    def soft_output(self, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """``Σ_i R_i f_i(x)`` over every leaf. x: [T, d_model]; probs: [T, L]; returns
        [T, d_out]."""
        return self.store.dense_output(x, probs)

    def sparse_output(self, x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor
                      ) -> torch.Tensor:
        """``Σ_j w_j f_{i_j}(x)`` over each token's selected leaves, through CVMM.

        x: [T, d_model]; indices, weights: [T, k]; returns [T, d_out]."""
        return self.store(x, Routing(indices, weights))

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"d_model={cfg.d_model}, depth={cfg.depth}, leaf_width={cfg.leaf_width}, "
                f"d_out={cfg.output_width}, activation={cfg.router.activation}, "
                f"train_mode={cfg.train_mode}, eval_mode={cfg.resolved_eval_mode}")
