"""Layer configurations: one frozen dataclass per layer family, validated at construction.

Every config round-trips through plain dicts (and so through JSON/TOML) with a ``type``
field naming the family, so that an experiment is one file::

    cfg = SigmaMoEConfig(d_model=512, num_experts=16, expert_size=128, k=4)
    assert config_from_dict(cfg.to_dict()) == cfg

An impossible config raises ``ValueError`` naming the field and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, ClassVar

from .router_config import SIGMA_GATES, SigmaRouterConfig, TreeRouterConfig, router_config_from
from .validation import (from_typed_dict, require_bool as _require_bool,
                         require_choice as _require_choice, require_k as _require_k,
                         require_non_negative as _require_non_negative,
                         require_positive_int as _require_positive_int,
                         require_probability as _require_probability)

ACTIVATIONS = ("relu", "gelu")
SIGMA_MOE_GATES = SIGMA_GATES
SIGMA_MOE_INITS = ("sigma_moe", "standard")
MOE_INITS = ("sigma_moe", "standard", "switch")


@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, counted from its config.

    total_params: every parameter of the layer.
    active_params: parameters a single token reads in the forward pass.
    flops: forward FLOPs per token (a multiply-add is 2 FLOPs; activations, sorting and
      other elementwise work are not counted).
    expert_flops: the part of ``flops`` spent in the experts / value rows, i.e. without the
      selection network; seed 001 Table 7 reports ``expert_flops`` relative to dense.
    """

    total_params: int
    active_params: int
    flops: int
    expert_flops: int


class LayerConfig:
    """Mixin for layer configs: dict/JSON round trip under a registered ``type`` name."""

    type_name: ClassVar[str]
    _registry: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        LayerConfig._registry[cls.type_name] = cls

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def cost(self) -> LayerCost:
        raise NotImplementedError

    def replace(self, **changes: Any):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


def config_from_dict(data: dict[str, Any]) -> LayerConfig:
    """Build the config a ``to_dict()`` produced; unknown types and fields are errors."""
    return from_typed_dict(LayerConfig._registry, data, "config")


@dataclass(frozen=True)
class DenseMLPConfig(LayerConfig):
    """The two-layer MLP ``y = W2 act(W1 x)`` (seed 001 Eq. 1-2).

    ``n_layers`` only sets the initialisation scale of a pre-LayerNorm Transformer with that
    many blocks: ``W1 ~ N(0, sqrt(2 / (d_model n_layers)))``, ``W2 ~ N(0, sqrt(2 / (d_ff
    n_layers)))`` (seed 001 §5).
    """

    type_name: ClassVar[str] = "dense"

    d_model: int
    d_ff: int
    activation: str = "relu"
    bias: bool = False
    dropout: float = 0.0
    n_layers: int = 1

    def __post_init__(self) -> None:
        _require_positive_int(self, "d_model")
        _require_positive_int(self, "d_ff")
        _require_positive_int(self, "n_layers")
        _require_choice(self, "activation", ACTIVATIONS)
        _require_probability(self, "dropout")

    def cost(self) -> LayerCost:
        params = 2 * self.d_model * self.d_ff + (self.d_ff + self.d_model if self.bias else 0)
        flops = 4 * self.d_model * self.d_ff
        return LayerCost(params, params, flops, flops)


@dataclass(frozen=True)
class TopKMLPConfig(LayerConfig):
    """The MLP with a top-K activation: only the K largest of ``u = act(W1 x)`` reach W2
    (seed 001 §3.1, Eq. 13-14)."""

    type_name: ClassVar[str] = "topk"

    d_model: int
    d_ff: int
    k: int
    activation: str = "relu"
    n_layers: int = 1

    def __post_init__(self) -> None:
        _require_positive_int(self, "d_model")
        _require_positive_int(self, "d_ff")
        _require_positive_int(self, "n_layers")
        _require_k(self, "d_ff")
        _require_choice(self, "activation", ACTIVATIONS)

    def cost(self) -> LayerCost:
        # All keys are read (Eq. 13 needs the full u); only k value rows are (Eq. 14).
        flops = 2 * self.d_model * self.d_ff + 2 * self.k * self.d_model
        return LayerCost(total_params=2 * self.d_model * self.d_ff,
                         active_params=self.d_model * self.d_ff + self.k * self.d_model,
                         flops=flops, expert_flops=flops)


def _check_experts(config: object) -> None:
    """The fields every mixture of MLP experts has."""
    for name in ("d_model", "num_experts", "expert_size", "n_layers"):
        _require_positive_int(config, name)
    _require_k(config, "num_experts")
    _require_choice(config, "activation", ACTIVATIONS)


@dataclass(frozen=True)
class SigmaMoEConfig(LayerConfig):
    """σ-MoE (seed 001 §5): ``num_experts`` MLP experts of ``expert_size`` hidden units, ``k``
    of them per token, chosen by sigmoid scores.

    Fields
    - ``gate``: ``"sigmoid"`` (σ-MoE), or the Table 4 ablations ``"softmax"`` (softmax over all
      experts, then top-k, no renormalisation) and ``"softmax_renorm"`` (softmax renormalised
      over the k selected experts, App. A.1 Eq. 37-39).
    - ``entropy_weight``: γ, the weight of the batch-entropy regulariser (Eq. 34-35).
    - ``expert_dropout``: δ, the probability of dropping an expert for a token during
      training, without rescaling the others (Eq. 36).
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
    gate: str = "sigmoid"
    entropy_weight: float = 0.001
    expert_dropout: float = 0.0
    hidden_dropout: float = 0.0
    init: str = "sigma_moe"
    n_layers: int = 1

    def __post_init__(self) -> None:
        _check_experts(self)
        _require_choice(self, "gate", SIGMA_MOE_GATES)
        _require_choice(self, "init", SIGMA_MOE_INITS)
        _require_non_negative(self, "entropy_weight")
        _require_probability(self, "expert_dropout")
        _require_probability(self, "hidden_dropout")

    def cost(self) -> LayerCost:
        return self.to_moe_config().cost()

    @property
    def d_ff(self) -> int:
        """Hidden units over all experts: the d_ff of the MLP this layer approximates."""
        return self.num_experts * self.expert_size

    @classmethod
    def from_dense(cls, d_model: int, d_ff: int, num_experts: int, k: int, **kwargs: Any):
        """Split a dense MLP of width ``d_ff`` into ``num_experts`` equal experts (seed 001
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
                         router=SigmaRouterConfig(gate=self.gate,
                                                  entropy_weight=self.entropy_weight,
                                                  expert_dropout=self.expert_dropout),
                         hidden_dropout=self.hidden_dropout, init=self.init,
                         n_layers=self.n_layers)


@dataclass(frozen=True)
class MoEConfig(LayerConfig):
    """A mixture of ``num_experts`` two-layer MLP experts of ``expert_size`` hidden units, ``k``
    per token, chosen by any router (see :mod:`sparseffn.router_config`).

    Fields
    - ``router``: a router config, a dict with ``type`` (as in TOML) or a bare router name
      (``"sigma"``, ``"softmax"``, ``"noisy_topk"``, ``"switch"``, ``"gshard"``, ``"sbase"``,
      ``"dense_softmax"``, ``"hierarchical"``) for its defaults.
    - ``hidden_dropout``: dropout on the experts' hidden units (Switch's "expert dropout" of
      0.4 in Fedus et al.; seed 001 Table 4's "standard dropout").
    - ``init``: ``"sigma_moe"`` (experts like the dense MLP of width num_experts·expert_size
      they replace, selection rows of equal norm; seed 001 §5), ``"standard"`` (each
      expert's own fan-in) or ``"switch"`` (Fedus et al.: every matrix
      ``N(0, sqrt(0.1 / fan_in))``, i.e. ``sqrt(0.1/G)`` for the second expert layer).
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
    n_layers: int = 1

    def __post_init__(self) -> None:
        _check_experts(self)
        _require_choice(self, "init", MOE_INITS)
        _require_probability(self, "hidden_dropout")
        object.__setattr__(self, "router", router_config_from(self.router))
        self.router.check_layer(self.num_experts, self.k)

    def to_dict(self) -> dict[str, Any]:
        data = super().to_dict()
        data["router"] = self.router.to_dict()
        return data

    def cost(self) -> LayerCost:
        selection = self.router.num_params(self.d_model, self.num_experts)
        expert = 2 * self.d_model * self.expert_size
        return LayerCost(total_params=selection + self.num_experts * expert,
                         active_params=selection + self.k * expert,
                         flops=2 * selection + 2 * self.k * expert,
                         expert_flops=2 * self.k * expert)

    @property
    def d_ff(self) -> int:
        """Hidden units over all experts: the d_ff of the MLP this layer approximates."""
        return self.num_experts * self.expert_size


FFF_TRAIN_MODES = ("soft", "sparse")
FFF_EVAL_MODES = ("soft", "topk", "hard")


@dataclass(frozen=True)
class FFFConfig(LayerConfig):
    """A fast feed-forward tree (Belcak & Wattenhofer; seeds 003 §1.2-2.3 and 000): ``depth``
    levels of router nodes over ``2^depth`` leaf experts, each a two-layer MLP
    ``W2 act(W1 x + b1) + b2`` with ``leaf_width`` hidden units.

    Fields
    - ``d_out``: output width (None: d_model, the drop-in case; a classifier sets its classes).
    - ``node_width``, ``activation`` (the tree's ``a``), ``formulation``, explicit T/S: see
      :class:`~sparseffn.router_config.TreeRouterConfig`; ``bias`` applies to the nodes and
      the leaves.
    - ``leaf_activation``: ``"relu"`` or ``"gelu"`` inside the leaves.
    - ``dropout``: on the leaves' hidden units during training (as ``fastfeedforward``).
    - ``train_mode``: ``"soft"`` (every leaf weighted by R, as in the papers) or ``"sparse"``
      (the top-k leaves by R, through CVMM; beyond the papers).
    - ``eval_mode``: ``"soft"``, ``"topk"`` (k leaves by R), or ``"hard"`` (greedy descent,
      one leaf with weight 1: d node dot products per token); None: like training (soft ->
      soft, sparse -> topk).
    - ``k``: leaves per token in the sparse modes.
    - ``init``: ``"fff"`` (uniform ±1/sqrt(fan_in) everywhere, as ``fastfeedforward``) or
      ``"sigma_moe"`` (leaves like the dense MLP of width 2^depth·leaf_width, seed 001 §5;
      nodes by the σ-MoE selection init).
    """

    type_name: ClassVar[str] = "fff"

    d_model: int
    depth: int
    leaf_width: int
    d_out: int | None = None
    node_width: int = 1
    activation: str = "logsigmoid"
    formulation: str = "auto"
    leaf_activation: str = "relu"
    bias: bool = True
    dropout: float = 0.0
    train_mode: str = "soft"
    eval_mode: str | None = None
    k: int = 1
    renormalize: bool = False
    init: str = "fff"
    n_layers: int = 1
    t_matrix: Any = None
    s_matrix: Any = None

    def __post_init__(self) -> None:
        for name in ("d_model", "depth", "leaf_width", "node_width", "n_layers"):
            _require_positive_int(self, name)
        if self.depth > 24:
            raise ValueError(f"FFFConfig.depth must be at most 24 (2^24 leaves), got {self.depth}")
        if self.d_out is not None:
            _require_positive_int(self, "d_out")
        _require_choice(self, "leaf_activation", ACTIVATIONS)
        _require_choice(self, "train_mode", FFF_TRAIN_MODES)
        if self.eval_mode is not None:
            _require_choice(self, "eval_mode", FFF_EVAL_MODES)
        _require_choice(self, "init", ("fff", "sigma_moe"))
        _require_probability(self, "dropout")
        _require_bool(self, "bias")
        _require_k(self, "num_leaves")
        if self.formulation == "matrix" and self.depth > 14:
            raise ValueError(f"FFFConfig: formulation 'matrix' stores a dense T of 2^depth x "
                             f"2^(depth+1) floats; use 'levelwise' or 'auto' for depth "
                             f"{self.depth} > 14")
        router = self.router_config()   # validates activation, formulation, node_width, matrices
        if self.resolved_eval_mode == "hard" and router.explicit:
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
        """The tree router this layer's fields describe."""
        return TreeRouterConfig(activation=self.activation, formulation=self.formulation,
                                node_width=self.node_width, bias=self.bias,
                                renormalize=self.renormalize, t_matrix=self.t_matrix,
                                s_matrix=self.s_matrix,
                                init="fff" if self.init == "fff" else "layer")

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
        node_flops = 2 * self.d_model * self.node_width + (2 * self.node_width if self.node_width > 1 else 0)
        mode = self.resolved_eval_mode
        nodes_read = self.depth if mode == "hard" else num_nodes
        leaves_read = {"soft": self.num_leaves, "topk": self.k, "hard": 1}[mode]
        return LayerCost(total_params=router + self.num_leaves * leaf,
                         active_params=nodes_read * per_node + leaves_read * leaf,
                         flops=nodes_read * node_flops + leaves_read * leaf_flops,
                         expert_flops=leaves_read * leaf_flops)
