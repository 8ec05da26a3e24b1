"""The MLP with a top-K activation (Csordás, Irie & Schmidhuber 2023, arXiv:2310.10837,
§3.1)."""

from __future__ import annotations

from ..config import TopKMLPConfig
from ..init import dense_init_std
from ..routers.activation import TopKActivationRouter
from ..routing import RoutedFFN
from ..stores import ValueRows


class TopKMLP(RoutedFFN):
    """``u = act(W1 x)``; keep the K largest entries (Eq. 13); ``y = Σ_{i∈E_x} u_i v_i``
    (Eq. 14): a :class:`~sparseffn.routers.activation.TopKActivationRouter` (the first layer,
    computed in full) plus a :class:`~sparseffn.stores.ValueRows` store whose rows are the
    values v_i (W2 transposed); the second layer reads only the K selected rows.

    Parameters: ``router.keys`` [d_ff, d_model] and ``store.values`` [d_ff, d_model], with
    the dense MLP's initialisation (their §5).

    After each forward, ``routing_stats``: ``counts`` (per hidden unit, the tokens that kept
    it) and ``mass`` (its summed activation).

    forward(x: [..., d_model]) -> [..., d_model]
    """

    _renamed_parameters = {"keys": "router.keys", "values": "store.values"}

    def __init__(self, config: TopKMLPConfig | None = None, **kwargs) -> None:
        config = config if config is not None else TopKMLPConfig(**kwargs)
        router = TopKActivationRouter(config.d_model, config.d_ff, config.k, config.activation,
                                      std=dense_init_std(config.d_model, config.n_layers))
        store = ValueRows(config.d_ff, config.d_model,
                          std=dense_init_std(config.d_ff, config.n_layers))
        super().__init__(router, store)
        self.config = config
