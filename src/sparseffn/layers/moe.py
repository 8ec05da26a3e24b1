"""A mixture of MLP experts computed with CVMM, with any router (../DESIGN.md: router |
expert store)."""

from __future__ import annotations

from ..config import MoEConfig
from ..routers import build_router
from ..routing import RoutedFFN
from ..stores import MLPExperts


class MoE(RoutedFFN):
    """``y = Σ_{e∈E_x} w_e(x) · W2^e act(W1^e x)`` (Csordás, Irie & Schmidhuber 2023,
    arXiv:2310.10837, Eq. 25), with ``E_x`` and the weights ``w_e`` from the router that
    ``config.router`` names (σ-MoE, softmax top-k, noisy top-k, Switch, GShard, S-BASE, the
    classic dense and hierarchical gates, the fast feed-forward tree): a router plus an
    :class:`~sparseffn.stores.MLPExperts` store.

    Parameters: ``router.*`` (the selection network), ``store.w1`` [num_experts, expert_size,
    d_model] (the keys, rows of W1^e) and ``store.w2`` [num_experts, expert_size, d_model] (the
    values, rows of W2^e transposed). Expert e computes ``act(x @ w1[e].T) @ w2[e]``.

    Pairs the router drops (Switch / GShard capacity) are never computed: a dropped token's
    output is zero, so a residual connection around the layer carries it unchanged.

    After each forward: the router's unweighted ``aux_losses`` (weights in
    ``aux_loss_weights``, from the router config), ``routing_stats`` (per-expert ``counts``
    and ``mass`` of the dispatched pairs, plus e.g. ``dropped_fraction``), accumulated
    ``usage_counts`` / ``usage_mass``.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    _renamed_parameters = {"w1": "store.w1", "w2": "store.w2"}

    def __init__(self, config: MoEConfig | None = None, **kwargs) -> None:
        config = config if config is not None else MoEConfig(**kwargs)
        router = build_router(config.router, config.d_model, config.num_experts, config.k,
                              init=config.init, n_layers=config.n_layers)
        store = MLPExperts(config.num_experts, config.d_model, config.expert_size,
                           activation=config.activation, dropout=config.hidden_dropout,
                           init=config.init, init_layers=config.n_layers)
        super().__init__(router, store)
        self.config = self.moe_config = config
        # Drawn again after the experts, as in earlier releases: a seed gives the same weights.
        self.router.reset_parameters()
