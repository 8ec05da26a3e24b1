"""A mixture of MLP experts computed with CVMM, with any router (../DESIGN.md: router |
expert store)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..activations import ACTIVATIONS
from ..registry import (LayerConfig, LayerCost, build_router, config_argument, implements,
                        renamed_fields, router_config_from)
from ..routers.sigma import SigmaRouterConfig
from ..routing import RoutedFFN
from ..stores import MLPExperts
from ..validation import (require_bool, require_choice, require_k, require_non_negative_int,
                          require_positive_int, require_probability)


MOE_INITS = ("sigma_moe", "standard", "switch")


def _check_experts(config: object) -> None:
    """The fields every mixture of MLP experts has."""
    for name in ("d_model", "num_experts", "expert_size", "init_depth"):
        require_positive_int(config, name)
    require_k(config, "num_experts")
    require_choice(config, "activation", ACTIVATIONS)


@renamed_fields(n_layers="init_depth")
@dataclass(frozen=True)
class MoEConfig(LayerConfig):
    """A mixture of ``num_experts`` two-layer MLP experts of ``expert_size`` hidden units, ``k``
    per token, chosen by any router (see :mod:`sparseffn.router_config`).

    Fields
    - ``router``: a router config, a dict with ``type`` (as in TOML) or a bare router name
      (``"sigma"``, ``"softmax"``, ``"noisy_topk"``, ``"switch"``, ``"gshard"``, ``"sbase"``,
      ``"expert_choice"``, ``"dense_softmax"``, ``"hierarchical"``) for its defaults.
    - ``hidden_dropout``: dropout on the experts' hidden units (Switch's "expert dropout" of
      0.4 in Fedus et al.; Csordás et al. 2023 Table 4's "standard dropout").
    - ``init``: ``"sigma_moe"`` (experts like the dense MLP of width num_experts·expert_size
      they replace, selection rows of equal norm; Csordás et al. 2023 §5), ``"standard"`` (each
      expert's own fan-in) or ``"switch"`` (Fedus et al.: every matrix
      ``N(0, sqrt(0.1 / fan_in))``, i.e. ``sqrt(0.1/G)`` for the second expert layer).
    - ``bias``: the biases of a dense MLP split into the experts: one per hidden unit and one
      output bias added once per token (see :class:`~sparseffn.stores.MLPExperts`'s
      ``dense_bias``; what :mod:`sparseffn.convert` builds from BERT's or GPT-2's MLPs).
    - ``gated``: gated (GLU) experts ``(act(x Wgᵀ) ⊙ x W1ᵀ) W2`` with a third matrix per
      expert (Shazeer 2020, arXiv:2002.05202; ``activation="silu"`` gives SwiGLU experts as
      in Mixtral, and what :mod:`sparseffn.convert` builds from Llama-family MLPs).
    - ``shared_experts``: experts of ``expert_size`` hidden units that every token uses with
      weight one, beside the ``k`` routed ones (DeepSeekMoE's "shared expert isolation", Dai
      et al. 2024, arXiv:2401.06066, §3.2): together one dense MLP of ``shared_experts ·
      expert_size`` hidden units, with the experts' activation, gating, hidden dropout and
      init (scaled to its own width), without biases. 0 (the default): none.
    """

    type_name: ClassVar[str] = "moe"

    d_model: int
    num_experts: int
    expert_size: int
    k: int
    router: Any = SigmaRouterConfig()
    activation: str = "relu"
    hidden_dropout: float = 0.0
    init: str = "sigma_moe"
    init_depth: int = 1
    bias: bool = False
    gated: bool = False
    shared_experts: int = 0

    def __post_init__(self) -> None:
        _check_experts(self)
        require_non_negative_int(self, "shared_experts")
        require_bool(self, "bias")
        require_bool(self, "gated")
        require_choice(self, "init", MOE_INITS)
        require_probability(self, "hidden_dropout")
        object.__setattr__(self, "router", router_config_from(self.router))
        self.router.check_layer(self.num_experts, self.k)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["router"] = self.router.to_dict()
        return data

    def cost(self) -> LayerCost:
        selection = self.router.num_params(self.d_model, self.num_experts)
        expert = (3 if self.gated else 2) * self.d_model * self.expert_size
        biases = (self.num_experts * self.expert_size + self.d_model) if self.bias else 0
        active_biases = (self.k * self.expert_size + self.d_model) if self.bias else 0
        shared = self.shared_experts * expert          # every token uses them
        return LayerCost(total_params=selection + self.num_experts * expert + biases + shared,
                         active_params=selection + self.k * expert + active_biases + shared,
                         flops=2 * selection + 2 * self.k * expert + 2 * shared,
                         expert_flops=2 * self.k * expert + 2 * shared)

    @property
    def d_ff(self) -> int:
        """Hidden units over all routed experts: the d_ff of the MLP this layer approximates
        (the shared experts' are not counted)."""
        return self.num_experts * self.expert_size


@implements(MoEConfig)
class MoE(RoutedFFN):
    """``y = Σ_{e∈E_x} w_e(x) · W2^e act(W1^e x)`` (Csordás, Irie & Schmidhuber 2023,
    arXiv:2310.10837, Eq. 25), with ``E_x`` and the weights ``w_e`` from the router that
    ``config.router`` names (σ-MoE, softmax top-k, noisy top-k, Switch, GShard, S-BASE, expert
    choice, the classic dense and hierarchical gates, the fast feed-forward tree): a router plus an
    :class:`~sparseffn.stores.MLPExperts` store.

    Parameters: ``router.*`` (the selection network), ``store.w1`` [num_experts, expert_size,
    d_model] (the keys, rows of W1^e) and ``store.w2`` [num_experts, expert_size, d_model] (the
    values, rows of W2^e transposed). Expert e computes ``act(x @ w1[e].T) @ w2[e]``.

    Pairs the router drops (Switch / GShard capacity) are never computed: a dropped token's
    output is zero, so a residual connection around the layer carries it unchanged.

    With ``config.shared_experts`` > 0 (DeepSeekMoE, Dai et al. 2024 §3.2), ``y`` also gets
    ``Σ_s W2^s act(W1^s x)`` over the shared experts, which every token uses with weight one:
    parameters ``shared.w1`` and ``shared.w2`` [shared_experts, expert_size, d_model] (and
    ``shared.w_gate`` for gated experts), an :class:`~sparseffn.stores.MLPExperts` computed
    densely. They take no part in the routing, its aux losses or its usage statistics, and
    expert parallelism replicates them like any dense weight.

    After each forward: the router's unweighted ``aux_losses`` (weights in
    ``aux_loss_weights``, from the router config), ``routing_stats`` (per-expert ``counts``
    and ``mass`` of the dispatched pairs, plus e.g. ``dropped_fraction``), accumulated
    ``usage_counts`` / ``usage_mass``.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    _renamed_parameters = {"w1": "store.w1", "w2": "store.w2"}

    def __init__(self, config: MoEConfig | None = None, **kwargs) -> None:
        config = config_argument(MoEConfig, config, kwargs, type(self).__name__)
        router = build_router(config.router, config.d_model, config.num_experts, config.k,
                              init=config.init, init_depth=config.init_depth)
        store = MLPExperts(config.num_experts, config.d_model, config.expert_size,
                           activation=config.activation, dense_bias=config.bias,
                           dropout=config.hidden_dropout, init=config.init,
                           init_depth=config.init_depth, gated=config.gated)
        super().__init__(router, store)
        self.config = self.moe_config = config
        # Drawn again after the experts, as in earlier releases: a seed gives the same weights.
        self.router.reset_parameters()
        if config.shared_experts:   # drawn last: a seed gives the routed part the same weights
            self.shared = MLPExperts(config.shared_experts, config.d_model, config.expert_size,
                                     activation=config.activation,
                                     dropout=config.hidden_dropout, init=config.init,
                                     init_depth=config.init_depth, gated=config.gated)
