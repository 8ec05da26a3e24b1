"""Layers over product-key retrieval: the product-key memory (PKM; Lample et al. 2019, Csordás et
al. 2023 §3.2) and PEER (He 2024 §3). Both are a :class:`ProductKeyRouter` in front of a table of
single rows, read with gathered-row kernels (``ops/rows.py``) that never copy the retrieved
rows out per token."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..activations import ACTIVATIONS
from ..init import dense_init_std
from ..registry import LayerConfig, LayerCost, config_argument, implements, renamed_fields
from ..routers.product_keys import (PEER_SCORES, PK_QUERIES, PK_QUERY_NORMS, ProductKeyRouter,
                                    ProductKeySpec)
from ..routing import RoutedFFN
from ..stores import NeuronExperts, ValueRows
from ..validation import (require_bool, require_choice, require_k, require_positive_int,
                          require_probability)
from .dense import DenseMLPConfig


PKM_SCORES = ("softmax", "relu")
PKM_INITS = ("lample", "dense")


def _check_product_keys(config: Any, num_keys_name: str) -> None:
    """Fields PKM and PEER share; ``key_dim`` None resolves to d_model; k is at most the
    field or property ``num_keys_name`` (n² keys)."""
    for name in ("d_model", "heads", "init_depth"):
        require_positive_int(config, name)
    if config.key_dim is not None:
        require_positive_int(config, "key_dim")
    if config.query_norm is not None:
        require_choice(config, "query_norm", PK_QUERY_NORMS)
    key_dim = config.d_model if config.key_dim is None else config.key_dim
    name = type(config).__name__
    if key_dim % 2:
        raise ValueError(f"{name}: the query is split into two halves, so key_dim (default "
                         f"d_model) must be even, got {key_dim}")
    require_k(config, num_keys_name)


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


@renamed_fields(n_layers="init_depth", activation="score")
@dataclass(frozen=True)
class PKMConfig(LayerConfig):
    """A product-key memory (Lample et al. 2019; Csordás et al. 2023 §3.2 and App. A.3):
    ``num_subkeys²``
    value rows, of which each of ``heads`` heads retrieves the top ``k`` by product-key score
    and adds them weighted by ``score`` of their scores (Eq. 14-15).

    Fields
    - ``num_subkeys``: n, the rows of each sub-key table; there are n² values (Csordás et al.'s
      small models: 46 for the d_ff-matched, 62 for the parameter-matched case).
    - ``score``: ``"softmax"`` over each head's k scores (Lample et al.) or ``"relu"``
      (Csordás et al.'s non-competing choice, Table 2).
    - ``query``: ``"identity"`` splits the input itself into the two half-queries (Csordás et al.
    2023
      App. A.3, the default); ``"linear"`` adds a query network per head (Lample et al.).
    - ``key_dim``: a head's query width (None: d_model; must be d_model for ``"identity"``).
    - ``query_norm``: None (Csordás et al. 2023), ``"batchnorm"`` (Lample et al.) or
    ``"layernorm"``.
    - ``init``: ``"lample"`` (sub-keys N(0, 1/sqrt(key_dim/2)), values N(0, 1/sqrt(d_model)))
      or ``"dense"`` (Csordás et al.'s unified view: keys like the dense W1, values like W2 of an
      MLP of width n²).
    - ``sparse_grad``: the values' gradient as a sparse tensor of the rows read (train them with
      ``torch.optim.SparseAdam``; see :func:`sparseffn.sparse_grad_parameters`).

    Values are shared by the heads; each head has its own sub-keys.
    """

    type_name: ClassVar[str] = "pkm"

    d_model: int
    num_subkeys: int
    heads: int = 4
    k: int = 32
    score: str = "softmax"
    query: str = "identity"
    key_dim: int | None = None
    query_norm: str | None = None
    init: str = "lample"
    sparse_grad: bool = False
    init_depth: int = 1

    def __post_init__(self) -> None:
        require_positive_int(self, "num_subkeys")
        require_bool(self, "sparse_grad")
        require_choice(self, "score", PKM_SCORES)
        require_choice(self, "query", PK_QUERIES)
        require_choice(self, "init", PKM_INITS)
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
                              self.query, self.query_norm, self.score)

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
        """The PKM that replaces a dense MLP of width ``d_ff`` (Csordás et al. 2023 App. A.3,
        Table 6).

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


@renamed_fields(n_layers="init_depth")
@dataclass(frozen=True)
class PEERConfig(LayerConfig):
    """PEER, parameter-efficient expert retrieval (He 2024 §3): ``num_experts = n²``
    single-neuron experts ``e_i(x) = σ(u_iᵀ x) v_i``; each of ``heads`` query networks
    retrieves its top ``k`` experts by product keys, and the layer returns
    ``Σ_heads Σ_{i ∈ I_h} g_i(x) e_i(x)`` with router scores ``g = score(q(x)ᵀ k_i)``.

    Fields
    - ``num_experts``: N, a perfect square (He 2024: 1024² = 1,048,576).
    - ``heads``, ``k``: h query networks, k experts each (He 2024: h·k = 128, e.g. 8 · 16).
    - ``activation``: σ of the experts, ``"gelu"`` (default) or ``"relu"``.
    - ``score``: ``"softmax"`` over each head's k scores (He 2024) or ``"sigmoid"``.
    - ``key_dim``: a head's query width, split into two halves (None: d_model).
    - ``query_norm``: None, ``"batchnorm"`` (He 2024's query BatchNorm) or ``"layernorm"``.
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
    init_depth: int = 1

    def __post_init__(self) -> None:
        require_positive_int(self, "num_experts")
        root = math.isqrt(self.num_experts)
        if root * root != self.num_experts:
            raise ValueError(f"PEERConfig.num_experts must be a perfect square (n² experts from "
                             f"two tables of n sub-keys), got {self.num_experts}; nearest are "
                             f"{root * root} and {(root + 1) ** 2}")
        require_choice(self, "activation", ACTIVATIONS)
        require_choice(self, "score", PEER_SCORES)
        require_probability(self, "dropout")
        require_bool(self, "sparse_grad")
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


@implements(PKMConfig)
class ProductKeyMemory(RoutedFFN):
    """``y = Σ_heads Σ_{i ∈ top-k} act(s_i) v_i`` (Lample et al. 2019; Csordás et al. 2023,
    arXiv:2310.10837, Eq. 14-15): each head retrieves the top k of ``num_subkeys²`` product
    keys and adds the matching value rows, weighted by the softmax (or ReLU) of their scores.
    A :class:`ProductKeyRouter` plus a :class:`~sparseffn.stores.ValueRows` store.

    Parameters: ``router.*`` (sub-keys, optional query network and norm) and ``store.values``
    [num_subkeys², d_model], shared by the heads.

    After each forward, ``routing_stats``: ``counts`` (per value row, how many (token, head)
    retrievals read it) and ``mass`` (their summed weights), over ``num_values`` rows.

    Initialisation (``init``): ``"lample"``: sub-keys N(0, 1/sqrt(key_dim/2)), values
    N(0, 1/sqrt(d_model)); ``"dense"``: each full key N(0, sqrt(2/(d_model init_depth))) per
    entry like the dense W1 rows, values like W2 of an MLP of width num_values (Csordás et al.
    2023, §5).

    forward(x: [..., d_model]) -> [..., d_model]
    """

    _renamed_parameters = {"values": "store.values"}

    def __init__(self, config: PKMConfig | None = None, **kwargs) -> None:
        config = config_argument(PKMConfig, config, kwargs, type(self).__name__)
        if config.init == "lample":
            key_std, value_std = None, 1 / math.sqrt(config.d_model)
        else:
            key_std = dense_init_std(config.d_model, config.init_depth)
            value_std = dense_init_std(config.num_values, config.init_depth)
        super().__init__(ProductKeyRouter(config.retrieval(), key_std=key_std),
                         ValueRows(config.num_values, config.d_model, std=value_std,
                                   sparse_grad=config.sparse_grad))
        self.config = config

    def extra_repr(self) -> str:
        cfg = self.config
        return f"d_model={cfg.d_model}, num_values={cfg.num_values}, score={cfg.score}"


@implements(PEERConfig)
class PEER(RoutedFFN):
    """``f(x) = Σ_heads Σ_{i ∈ I_h} g_i(x) σ(u_iᵀ x) v_i`` (He 2024, "Mixture of A Million
    Experts", arXiv:2407.04153, §3.2): ``num_experts`` single-neuron experts, the top k per
    head retrieved by product keys, router scores ``g = softmax`` (or sigmoid) of the retrieved
    keys' scores. A :class:`ProductKeyRouter` plus a :class:`~sparseffn.stores.NeuronExperts`
    store.

    Parameters: ``router.*`` (query networks, optional query norm, sub-keys) and the experts as
    two embedding tables ``store.w_in`` [N, d_model] (rows u_i) and ``store.w_out``
    [N, d_model] (rows v_i), shared by the heads, initialised ``N(0, sqrt(2/(d_model
    init_depth)))`` and ``N(0, sqrt(2/(heads·k init_depth)))``: Csordás et al.'s dense init for an
    MLP whose hidden layer is the heads·k retrieved neurons.

    After each forward, ``routing_stats``: ``counts`` (per expert, how many (token, head)
    retrievals chose it) and ``mass`` (their summed router scores).

    forward(x: [..., d_model]) -> [..., d_model]
    """

    _renamed_parameters = {"w_in": "store.w_in", "w_out": "store.w_out"}

    def __init__(self, config: PEERConfig | None = None, **kwargs) -> None:
        config = config_argument(PEERConfig, config, kwargs, type(self).__name__)
        store = NeuronExperts(config.num_experts, config.d_model, activation=config.activation,
                              dropout=config.dropout,
                              in_std=dense_init_std(config.d_model, config.init_depth),
                              out_std=dense_init_std(config.heads * config.k, config.init_depth),
                              sparse_grad=config.sparse_grad)
        super().__init__(ProductKeyRouter(config.retrieval()), store)
        self.config = config

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"d_model={cfg.d_model}, num_experts={cfg.num_experts}, heads={cfg.heads}, "
                f"k={cfg.k}, activation={cfg.activation}, score={cfg.score}")
