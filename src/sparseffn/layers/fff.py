"""The fast feed-forward layer: a tree router over 2^depth leaf MLPs (Belcak & Wattenhofer;
seeds 003 and 000)."""

from __future__ import annotations

import torch

from ..config import FFFConfig
from ..routers.tree import TreeRouter
from ..routing import RoutedFFN, Routing
from ..stores import MLPExperts


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
    and, in the soft mode, ``entropy`` (mean leaf-distribution entropy, nats).

    forward(x: [..., d_model]) -> [..., d_out]
    """

    _renamed_parameters = {"w1": "store.w1", "w2": "store.w2", "b1": "store.b1",
                           "b2": "store.b2"}

    def __init__(self, config: FFFConfig | None = None, **kwargs) -> None:
        config = config if config is not None else FFFConfig(**kwargs)
        router = TreeRouter(config.router_config(), config.d_model, config.num_leaves,
                            config.k, init="sigma_moe", n_layers=config.n_layers)
        store = MLPExperts(config.num_leaves, config.d_model, config.leaf_width,
                           config.output_width, activation=config.leaf_activation,
                           bias=config.bias, dropout=config.dropout, init=config.init,
                           init_layers=config.n_layers)
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
            with torch.no_grad():
                p = probs.detach().float()
                entropy = -(p * p.clamp_min(1e-30).log()).sum(-1).mean()
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
                f"d_out={cfg.output_width}, activation={cfg.activation}, "
                f"train_mode={cfg.train_mode}, eval_mode={cfg.resolved_eval_mode}")
