"""The MLP with a top-K activation (Csordás, Irie & Schmidhuber 2023, arXiv:2310.10837,
§3.1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..activations import ACTIVATIONS
from ..init import dense_init_std
from ..registry import LayerConfig, LayerCost, config_argument, implements, renamed_fields
from ..routers.activation import TopKActivationRouter
from ..routing import RoutedFFN
from ..stores import ValueRows
from ..validation import require_choice, require_k, require_positive_int


@renamed_fields(n_layers="init_depth")
@dataclass(frozen=True)
class TopKMLPConfig(LayerConfig):
    """The MLP with a top-K activation: only the K largest of ``u = act(W1 x)`` reach W2
    (Csordás et al. 2023 §3.1, Eq. 13-14)."""

    type_name: ClassVar[str] = "topk"

    d_model: int
    d_ff: int
    k: int
    activation: str = "relu"
    init_depth: int = 1

    def __post_init__(self) -> None:
        require_positive_int(self, "d_model")
        require_positive_int(self, "d_ff")
        require_positive_int(self, "init_depth")
        require_k(self, "d_ff")
        require_choice(self, "activation", ACTIVATIONS)

    def cost(self) -> LayerCost:
        # All keys are read (Eq. 13 needs the full u); only k value rows are (Eq. 14).
        flops = 2 * self.d_model * self.d_ff + 2 * self.k * self.d_model
        return LayerCost(total_params=2 * self.d_model * self.d_ff,
                         active_params=self.d_model * self.d_ff + self.k * self.d_model,
                         flops=flops, expert_flops=flops)


@implements(TopKMLPConfig)
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
        config = config_argument(TopKMLPConfig, config, kwargs, type(self).__name__)
        router = TopKActivationRouter(config.d_model, config.d_ff, config.k, config.activation,
                                      std=dense_init_std(config.d_model, config.init_depth))
        store = ValueRows(config.d_ff, config.d_model,
                          std=dense_init_std(config.d_ff, config.init_depth))
        super().__init__(router, store)
        self.config = config
