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
import math
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


PK_QUERIES = ("identity", "linear")
PK_QUERY_NORMS = ("batchnorm", "layernorm")
PKM_ACTIVATIONS = ("softmax", "relu")
PKM_INITS = ("lample", "dense")
PEER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class ProductKeySpec:
    """Product-key retrieval as PKM and PEER use it (seed 001 §3.2, seed 002 §3.2).

    ``heads`` independent retrievals, each of the top ``k`` of ``num_subkeys²`` keys. A head's
    query has ``key_dim`` units, split into two halves scored against its two sub-key tables
    of ``num_subkeys`` rows each. ``query``: ``"identity"`` (the input itself, shared by all
    heads, as seed 001 App. A.3) or ``"linear"`` (a query network ``d_model -> heads ·
    key_dim``, without bias). ``query_norm``: None, ``"batchnorm"`` (Lample et al.; seed 002's
    query BatchNorm) or ``"layernorm"`` (each half-query, as ``product-key-memory``). ``score``:
    how the k retrieved scores become weights (``"softmax"`` over each head's k, ``"relu"``,
    ``"sigmoid"``).
    """

    d_model: int
    num_subkeys: int
    heads: int
    k: int
    key_dim: int
    query: str
    query_norm: str | None
    score: str

    @property
    def query_width(self) -> int:
        """Units of the (normalised) query: one shared query, or one per head."""
        return self.key_dim if self.query == "identity" else self.heads * self.key_dim

    def num_params(self) -> int:
        """Query network, query norm (two affine vectors) and sub-keys (two tables of
        ``num_subkeys`` half-keys per head)."""
        query = self.d_model * self.heads * self.key_dim if self.query == "linear" else 0
        norm = 2 * self.query_width if self.query_norm else 0
        return query + norm + self.heads * self.num_subkeys * self.key_dim

    def flops(self) -> int:
        """Per token: the query network and every sub-key score (the O(√N · d) of retrieval;
        the k² candidate sums and the top-k are not counted)."""
        query = 2 * self.d_model * self.heads * self.key_dim if self.query == "linear" else 0
        return query + 2 * self.heads * self.num_subkeys * self.key_dim


def _check_product_keys(config: Any, num_keys_name: str) -> None:
    """Fields PKM and PEER share; ``key_dim`` None resolves to d_model; k is at most the
    field or property ``num_keys_name`` (n² keys)."""
    for name in ("d_model", "heads", "n_layers"):
        _require_positive_int(config, name)
    if config.key_dim is not None:
        _require_positive_int(config, "key_dim")
    if config.query_norm is not None:
        _require_choice(config, "query_norm", PK_QUERY_NORMS)
    key_dim = config.d_model if config.key_dim is None else config.key_dim
    name = type(config).__name__
    if key_dim % 2:
        raise ValueError(f"{name}: the query is split into two halves, so key_dim (default "
                         f"d_model) must be even, got {key_dim}")
    _require_k(config, num_keys_name)


def _subkeys_within(spec: ProductKeySpec, params_per_key: int, budget: int, what: str) -> int:
    """The most sub-keys n for which retrieval (``spec`` with n sub-keys) plus n² keys of
    ``params_per_key`` parameters each (a value row, or an expert's two rows) fit ``budget``."""
    def params(n: int) -> int:
        return dataclasses.replace(spec, num_subkeys=n).num_params() + n * n * params_per_key
    return _largest_fitting(params, budget, what)


def _largest_fitting(params_of, budget: int, what: str) -> int:
    """The largest n >= 1 with ``params_of(n) <= budget`` (params_of increasing)."""
    if params_of(1) > budget:
        raise ValueError(f"{what}: even one sub-key exceeds the budget of {budget} parameters")
    low, high = 1, 2
    while params_of(high) <= budget:
        low, high = high, high * 2
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if params_of(mid) <= budget else (low, mid)
    return low


@dataclass(frozen=True)
class PKMConfig(LayerConfig):
    """A product-key memory (Lample et al. 2019; seed 001 §3.2 and App. A.3): ``num_subkeys²``
    value rows, of which each of ``heads`` heads retrieves the top ``k`` by product-key score
    and adds them weighted by ``activation`` of their scores (Eq. 14-15).

    Fields
    - ``num_subkeys``: n, the rows of each sub-key table; there are n² values (seed 001's
      small models: 46 for the d_ff-matched, 62 for the parameter-matched case).
    - ``activation``: ``"softmax"`` over each head's k scores (Lample et al.) or ``"relu"``
      (seed 001's non-competing choice, Table 2).
    - ``query``: ``"identity"`` splits the input itself into the two half-queries (seed 001
      App. A.3, the default); ``"linear"`` adds a query network per head (Lample et al.).
    - ``key_dim``: a head's query width (None: d_model; must be d_model for ``"identity"``).
    - ``query_norm``: None (seed 001), ``"batchnorm"`` (Lample et al.) or ``"layernorm"``.
    - ``init``: ``"lample"`` (sub-keys N(0, 1/sqrt(key_dim/2)), values N(0, 1/sqrt(d_model)))
      or ``"dense"`` (seed 001's unified view: keys like the dense W1, values like W2 of an MLP
      of width n²).
    - ``sparse_grad``: the values' gradient as a sparse tensor of the rows read (train them with
      ``torch.optim.SparseAdam``; see :func:`sparseffn.sparse_grad_parameters`).

    Values are shared by the heads; each head has its own sub-keys.
    """

    type_name: ClassVar[str] = "pkm"

    d_model: int
    num_subkeys: int
    heads: int = 4
    k: int = 32
    activation: str = "softmax"
    query: str = "identity"
    key_dim: int | None = None
    query_norm: str | None = None
    init: str = "lample"
    sparse_grad: bool = False
    n_layers: int = 1

    def __post_init__(self) -> None:
        _require_positive_int(self, "num_subkeys")
        _require_bool(self, "sparse_grad")
        _require_choice(self, "activation", PKM_ACTIVATIONS)
        _require_choice(self, "query", PK_QUERIES)
        _require_choice(self, "init", PKM_INITS)
        _check_product_keys(self, "num_values")
        if self.query == "identity" and self.key_dim not in (None, self.d_model):
            raise ValueError(f"PKMConfig: query 'identity' uses the input as the query, so "
                             f"key_dim must be d_model={self.d_model} (or None), got "
                             f"{self.key_dim}; set query='linear' for another width")

    @property
    def num_values(self) -> int:
        return self.num_subkeys ** 2

    def retrieval(self) -> ProductKeySpec:
        return ProductKeySpec(self.d_model, self.num_subkeys, self.heads, self.k,
                              self.d_model if self.key_dim is None else self.key_dim,
                              self.query, self.query_norm, self.activation)

    def cost(self) -> LayerCost:
        """Every sub-key is read (scored); ``heads · k`` value rows are."""
        keys = self.retrieval()
        values = self.heads * self.k * self.d_model
        return LayerCost(total_params=keys.num_params() + self.num_values * self.d_model,
                         active_params=keys.num_params() + values,
                         flops=keys.flops() + 2 * values, expert_flops=2 * values)

    @classmethod
    def from_dense(cls, d_model: int, d_ff: int, match: str = "params", dense_bias: bool = False,
                   **fields: Any) -> "PKMConfig":
        """The PKM that replaces a dense MLP of width ``d_ff`` (seed 001 App. A.3, Table 6).

        ``match="values"``: the fewest sub-keys with at least ``d_ff`` values (n = ⌈√d_ff⌉;
        46 for d_ff 2053). ``match="params"``: the most sub-keys whose PKM has at most the
        dense MLP's parameters (62 for d_model 412, d_ff 2053, 4 heads). ``fields`` are the
        other PKMConfig fields."""
        if match not in ("params", "values"):
            raise ValueError(f"PKMConfig.from_dense: match must be 'params' or 'values', got "
                             f"{match!r}")
        if match == "values":
            return cls(d_model=d_model, num_subkeys=math.isqrt(max(d_ff, 1) - 1) + 1, **fields)
        budget = DenseMLPConfig(d_model=d_model, d_ff=d_ff, bias=dense_bias).cost().total_params
        probe = cls(d_model=d_model, num_subkeys=max(1, math.isqrt(budget // d_model)), **fields)
        n = _subkeys_within(probe.retrieval(), d_model, budget, "PKMConfig.from_dense")
        return probe.replace(num_subkeys=n)


@dataclass(frozen=True)
class PEERConfig(LayerConfig):
    """PEER, parameter-efficient expert retrieval (seed 002 §3): ``num_experts = n²``
    single-neuron experts ``e_i(x) = σ(u_iᵀ x) v_i``; each of ``heads`` query networks
    retrieves its top ``k`` experts by product keys, and the layer returns
    ``Σ_heads Σ_{i ∈ I_h} g_i(x) e_i(x)`` with router scores ``g = score(q(x)ᵀ k_i)``.

    Fields
    - ``num_experts``: N, a perfect square (seed 002: 1024² = 1,048,576).
    - ``heads``, ``k``: h query networks, k experts each (seed 002: h·k = 128, e.g. 8 · 16).
    - ``activation``: σ of the experts, ``"gelu"`` (default) or ``"relu"``.
    - ``score``: ``"softmax"`` over each head's k scores (seed 002) or ``"sigmoid"``.
    - ``key_dim``: a head's query width, split into two halves (None: d_model).
    - ``query_norm``: None, ``"batchnorm"`` (seed 002's query BatchNorm) or ``"layernorm"``.
    - ``dropout``: on the experts' hidden units during training.
    - ``sparse_grad``: the expert tables' gradients as sparse tensors of the rows read (train
      them with ``torch.optim.SparseAdam``; see :func:`sparseffn.sparse_grad_parameters`): a
      step then touches what the batch retrieved, not all 2·N·d_model weights.

    The experts are two embedding tables ``w_in`` (u_i) and ``w_out`` (v_i), [N, d_model],
    shared by the heads; each head has its own query network and sub-keys.
    """

    type_name: ClassVar[str] = "peer"

    d_model: int
    num_experts: int
    heads: int = 8
    k: int = 16
    activation: str = "gelu"
    score: str = "softmax"
    key_dim: int | None = None
    query_norm: str | None = None
    dropout: float = 0.0
    sparse_grad: bool = False
    n_layers: int = 1

    def __post_init__(self) -> None:
        _require_positive_int(self, "num_experts")
        root = math.isqrt(self.num_experts)
        if root * root != self.num_experts:
            raise ValueError(f"PEERConfig.num_experts must be a perfect square (n² experts from "
                             f"two tables of n sub-keys), got {self.num_experts}; nearest are "
                             f"{root * root} and {(root + 1) ** 2}")
        _require_choice(self, "activation", ACTIVATIONS)
        _require_choice(self, "score", PEER_SCORES)
        _require_probability(self, "dropout")
        _require_bool(self, "sparse_grad")
        _check_product_keys(self, "num_experts")

    @property
    def num_subkeys(self) -> int:
        return math.isqrt(self.num_experts)

    def retrieval(self) -> ProductKeySpec:
        return ProductKeySpec(self.d_model, self.num_subkeys, self.heads, self.k,
                              self.d_model if self.key_dim is None else self.key_dim,
                              "linear", self.query_norm, self.score)

    def cost(self) -> LayerCost:
        """Every sub-key is read; ``heads · k`` experts (2 · d_model each) are."""
        keys = self.retrieval()
        experts = self.heads * self.k * 2 * self.d_model
        return LayerCost(total_params=keys.num_params() + 2 * self.num_experts * self.d_model,
                         active_params=keys.num_params() + experts,
                         flops=keys.flops() + 2 * experts, expert_flops=2 * experts)

    @classmethod
    def from_dense(cls, d_model: int, d_ff: int, dense_bias: bool = False,
                   **fields: Any) -> "PEERConfig":
        """The PEER with the most experts (n²) whose parameters do not exceed a dense MLP of
        width ``d_ff``. ``fields`` are the other PEERConfig fields."""
        budget = DenseMLPConfig(d_model=d_model, d_ff=d_ff, bias=dense_bias).cost().total_params
        probe = cls(d_model=d_model, num_experts=max(1, math.isqrt(budget // (2 * d_model))) ** 2,
                    **fields)
        n = _subkeys_within(probe.retrieval(), 2 * d_model, budget, "PEERConfig.from_dense")
        return probe.replace(num_experts=n * n)
