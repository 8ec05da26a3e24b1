"""σ-MoE (Csordás et al. 2023 §5): a sigmoid-gated top-k mixture of MLP experts computed with
CVMM."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from ..registry import (LayerConfig, LayerCost, config_argument, implements,
                        renamed_fields, resolve_router)
from ..routers.sigma import SIGMA_GATES, SigmaRouterConfig
from ..validation import require_choice, require_probability
from .moe import MoE, MoEConfig, _check_experts


SIGMA_MOE_GATES = SIGMA_GATES
SIGMA_MOE_INITS = ("sigma_moe", "standard")


@renamed_fields(n_layers="init_depth", gate="router.gate", entropy_weight="router.entropy_weight",
                expert_dropout="router.expert_dropout")
@dataclass(frozen=True)
class SigmaMoEConfig(LayerConfig):
    """σ-MoE (Csordás et al. 2023 §5): ``num_experts`` MLP experts of ``expert_size`` hidden
    units, ``k`` of them per token, chosen by sigmoid scores.

    Fields
    - ``router``: the :class:`~sparseffn.routers.SigmaRouterConfig`: ``gate`` (``"sigmoid"``
      for σ-MoE, the Table 4 ablations ``"softmax"`` and ``"softmax_renorm"``, or
      MoEfication's ``"hard"``),
      ``entropy_weight`` (γ of the batch-entropy regulariser, Eq. 34-35) and
      ``expert_dropout`` (δ, Eq. 36). A dict without ``type`` (a TOML ``[ffn.router]``
      table) changes only the fields it names. The flat ``gate``, ``entropy_weight`` and
      ``expert_dropout`` of earlier releases still work, with a ``DeprecationWarning``.
    - ``hidden_dropout``: ordinary dropout on the experts' hidden units (the "standard
      dropout" ablation of Table 4).
    - ``init``: ``"sigma_moe"`` initialises experts like the dense layer they replace and
      gives the selection rows equal norm; ``"standard"`` uses each expert's own fan-in.
    """

    type_name: ClassVar[str] = "sigma_moe"

    d_model: int
    num_experts: int
    expert_size: int
    k: int
    activation: str = "relu"
    router: Any = None
    hidden_dropout: float = 0.0
    init: str = "sigma_moe"
    init_depth: int = 1

    def __post_init__(self) -> None:
        _check_experts(self)
        object.__setattr__(self, "router", resolve_router(
            self.router, SigmaRouterConfig(), SigmaRouterConfig, "SigmaMoEConfig"))
        require_choice(self, "init", SIGMA_MOE_INITS)
        require_probability(self, "hidden_dropout")

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["router"] = self.router.to_dict()
        return data

    def cost(self) -> LayerCost:
        return self.to_moe_config().cost()

    @property
    def d_ff(self) -> int:
        """Hidden units over all experts: the d_ff of the MLP this layer approximates."""
        return self.num_experts * self.expert_size

    @classmethod
    def from_dense(cls, d_model: int, d_ff: int, num_experts: int, k: int, **kwargs: Any):
        """Split a dense MLP of width ``d_ff`` into ``num_experts`` equal experts (Csordás et al.
        2023
        §3.3: ``G · N_E = d_ff``)."""
        if isinstance(num_experts, int) and num_experts > 0 and d_ff % num_experts:
            raise ValueError(
                f"SigmaMoEConfig.from_dense: d_ff={d_ff} must be divisible by "
                f"num_experts={num_experts} to split it into equal experts"
            )
        return cls(d_model=d_model, num_experts=num_experts,
                   expert_size=d_ff // num_experts, k=k, **kwargs)

    def to_moe_config(self) -> "MoEConfig":
        """The same layer as a :class:`MoEConfig` with a σ-MoE router."""
        return MoEConfig(d_model=self.d_model, num_experts=self.num_experts,
                         expert_size=self.expert_size, k=self.k, activation=self.activation,
                         router=self.router,
                         hidden_dropout=self.hidden_dropout, init=self.init,
                         init_depth=self.init_depth)


@implements(SigmaMoEConfig)
class SigmaMoE(MoE):
    """``y = Σ_{e∈E_x} s[e] · W2^e act(W1^e x)`` (Csordás et al. 2023 Eq. 25) with σ-MoE's
    selection:
    the :class:`MoE` layer with a :class:`~sparseffn.routers.SigmaRouter`, configured by one
    flat :class:`SigmaMoEConfig`.

    Parameters, in Csordás et al.'s key-value view (Eq. 20-24): ``router.weight`` [num_experts,
    d_model] (W_s); ``w1`` [num_experts, expert_size, d_model], whose rows are the keys k_i of
    each expert (W1^e); ``w2`` [num_experts, expert_size, d_model], whose rows are the values
    v_i (W2^e transposed). Expert e computes ``act(x @ w1[e].T) @ w2[e]``.

    Initialisation (``init="sigma_moe"``): experts like the dense MLP of width
    ``d_ff = num_experts · expert_size`` they replace, ``W1^e ~ N(0, sqrt(2/(d_model
    init_depth)))`` and ``W2^e ~ N(0, sqrt(2/(d_ff init_depth)))``; ``init="standard"`` uses the
    expert's own width ``expert_size`` for W2.

    After each forward: ``aux_losses["entropy"]`` (Eq. 35, weight ``entropy_weight``) and the
    per-expert usage in ``routing_stats``.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: SigmaMoEConfig | None = None, **kwargs) -> None:
        config = config_argument(SigmaMoEConfig, config, kwargs, type(self).__name__)
        super().__init__(config.to_moe_config())
        self.config = config
