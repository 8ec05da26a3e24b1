"""Product-key retrieval as a router (Lample et al. 2019; Csordás et al. 2023 §3.2; He 2024 §3.2):
the query network, the optional query norm and the per-head sub-key tables, returning the
retrieved keys of every head as one :class:`~sparseffn.routing.Routing`.

Used by :class:`~sparseffn.layers.ProductKeyMemory` (the keys index value rows) and
:class:`~sparseffn.layers.PEER` (the keys index single-neuron experts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F

from ..ops.precision import autocast_dtype
from ..ops.product_keys import retrieve
from ..ops.sizes import exporting
from ..registry import RouterConfig, implements
from ..routing import Routing
from ..validation import require_choice, require_positive_int


PK_QUERIES = ("identity", "linear")
PK_QUERY_NORMS = ("batchnorm", "layernorm")
PEER_SCORES = ("softmax", "sigmoid")


@dataclass(frozen=True)
class ProductKeySpec:
    """Product-key retrieval as PKM and PEER use it (Csordás et al. 2023 §3.2, He 2024 §3.2).

    ``heads`` independent retrievals, each of the top ``k`` of ``num_subkeys²`` keys. A head's
    query has ``key_dim`` units, split into two halves scored against its two sub-key tables
    of ``num_subkeys`` rows each. ``query``: ``"identity"`` (the input itself, shared by all
    heads, as Csordás et al. 2023 App. A.3) or ``"linear"`` (a query network ``d_model -> heads ·
    key_dim``, without bias). ``query_norm``: None, ``"batchnorm"`` (Lample et al.; He 2024's
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


class QueryNorm(nn.Module):
    """BatchNorm over the query's units (Lample et al. 2019; He 2024's query BatchNorm), or
    LayerNorm over each half-query (as ``product-key-memory``), with an affine pair per unit.

    forward(q: [T, width]) -> [T, width]
    """

    def __init__(self, kind: str, width: int, half: int) -> None:
        super().__init__()
        self.kind, self.half = kind, half
        if kind == "batchnorm":
            self.norm = nn.BatchNorm1d(width)
        else:
            self.weight = nn.Parameter(torch.ones(width))
            self.bias = nn.Parameter(torch.zeros(width))

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.kind == "batchnorm":
            self.norm.reset_parameters()     # affine pair and running statistics
        else:
            self.weight.fill_(1.0)
            self.bias.zero_()

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        if self.kind == "batchnorm":
            if exporting() and not self.training:
                return self._running_norm(q)
            # an empty batch has no statistics to normalise by (and must not update them)
            return q if q.shape[0] == 0 else self.norm(q)
        halves = F.layer_norm(q.view(q.shape[0], q.shape[1] // self.half, self.half),
                              (self.half,))
        return halves.view(q.shape) * self.weight + self.bias

    def _running_norm(self, q: torch.Tensor) -> torch.Tensor:
        """The BatchNorm at inference, by its running statistics, written out: an exported
        program's token count may be data-dependent (the real tokens of a padded batch), and
        PyTorch's batch norm tests it (a guard the export stops on)."""
        norm = self.norm
        scale = torch.rsqrt(norm.running_var + norm.eps) * norm.weight
        return (q - norm.running_mean) * scale + norm.bias


class ProductKeyRouter(nn.Module):
    """``heads`` product-key retrievals of the top ``k`` of ``num_subkeys²`` keys each.

    Parameters: ``query`` (Linear d_model -> heads·key_dim, no bias; None for the identity
    query), ``query_norm`` (optional), ``keys_a`` and ``keys_b`` [heads, num_subkeys,
    key_dim/2]: the sub-keys scored against the first and the second half of each head's query.
    Key ``i + n·j`` of a head is ``[keys_a[h, i] | keys_b[h, j]]`` (Csordás et al. 2023 Eq. 15).

    forward(x: [T, d_model]) -> Routing with indices [T, heads·k] (head h's keys in columns
    h·k .. h·k + k - 1, best first) and weights [T, heads·k]: ``score`` of the retrieved
    scores (softmax over each head's k, relu or sigmoid). :meth:`retrieve` gives the raw
    scores and indices [T, heads, k].
    """

    def __init__(self, spec: ProductKeySpec, key_std: float | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.key_std = key_std
        self.d_model = spec.d_model
        self.num_experts = spec.num_subkeys ** 2     # the keys each head chooses among
        self.k = spec.heads * spec.k                 # keys retrieved per token, all heads
        self.half = spec.key_dim // 2
        if spec.query == "linear":
            self.query = nn.Linear(spec.d_model, spec.heads * spec.key_dim, bias=False)
        else:
            self.register_module("query", None)
        self.query_norm = (QueryNorm(spec.query_norm, spec.query_width, self.half)
                           if spec.query_norm else None)
        shape = (spec.heads, spec.num_subkeys, self.half)
        self.keys_a = nn.Parameter(torch.empty(shape))
        self.keys_b = nn.Parameter(torch.empty(shape))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Sub-keys N(0, key_std) (default 1/sqrt(key_dim/2): a half-score of unit variance
        for a unit-variance query); the query network N(0, 1/sqrt(d_model)); the query norm
        to its identity (unit scale, zero shift, fresh running statistics)."""
        std = 1 / math.sqrt(self.half) if self.key_std is None else self.key_std
        self.keys_a.normal_(0.0, std)
        self.keys_b.normal_(0.0, std)
        if self.query is not None:
            self.query.weight.normal_(0.0, 1 / math.sqrt(self.spec.d_model))
        if self.query_norm is not None:
            self.query_norm.reset_parameters()

    def aux_loss_weights(self) -> dict[str, float]:
        """Product-key retrieval has no auxiliary loss."""
        return {}

    def input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """Under autocast, with a linear query, the autocast dtype (the query is an
        ``nn.Linear``); with the identity query ``x`` is the query and is read as it comes."""
        return None if self.query is None else autocast_dtype(x)

    def retrieve(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Scores [T, heads, k] (differentiable) and int64 key indices [T, heads, k].
        x: [T, d_model]."""
        q = x if self.query is None else self.query(x)
        if self.query_norm is not None:
            q = self.query_norm(q)
        if self.query is not None:
            q = q.view(q.shape[0], self.spec.heads, self.spec.key_dim)
        return retrieve(q, self.keys_a, self.keys_b, self.spec.k)

    def forward(self, x: torch.Tensor) -> Routing:
        scores, indices = self.retrieve(x)
        if self.spec.score == "softmax":
            weights = torch.softmax(scores, dim=-1)
        elif self.spec.score == "relu":
            weights = F.relu(scores)
        else:
            weights = torch.sigmoid(scores)
        tokens = x.shape[0]
        width = self.spec.heads * self.spec.k
        return Routing(indices=indices.reshape(tokens, width), weights=weights.reshape(tokens, width))

    def extra_repr(self) -> str:
        s = self.spec
        return (f"heads={s.heads}, k={s.k}, num_subkeys={s.num_subkeys}, key_dim={s.key_dim}, "
                f"query={s.query}, score={s.score}")


@dataclass(frozen=True)
class ProductKeyRouterConfig(RouterConfig):
    """Product-key retrieval as the router of any :class:`~sparseffn.layers.MoE` (Lample et al.
    2019; He 2024 §3.2): the layer's ``num_experts`` must be a square n², and its ``k`` is split
    over ``heads`` retrievals of ``k / heads`` keys each (a token may get one expert from two
    heads: both pairs are computed). Scores cost O(√N · d) per token instead of O(N · d).

    heads: independent retrievals (query networks).
    key_dim: units of each head's query, split into two halves (even).
    query: ``"linear"`` (a query network per head, no bias) or ``"identity"`` (the input itself,
      shared by the heads; needs ``key_dim = d_model``).
    query_norm: None, ``"batchnorm"`` or ``"layernorm"``.
    score: ``"softmax"`` over each head's k scores, ``"relu"`` or ``"sigmoid"``.
    """

    type_name: ClassVar[str] = "product_keys"

    heads: int = 1
    key_dim: int = 32
    query: str = "linear"
    query_norm: str | None = None
    score: str = "softmax"

    def __post_init__(self) -> None:
        require_positive_int(self, "heads")
        require_positive_int(self, "key_dim")
        if self.key_dim % 2:
            raise ValueError(f"ProductKeyRouterConfig.key_dim must be even (two half-queries), "
                             f"got {self.key_dim}")
        require_choice(self, "query", PK_QUERIES)
        if self.query_norm is not None:
            require_choice(self, "query_norm", PK_QUERY_NORMS)
        require_choice(self, "score", ("softmax", "relu", "sigmoid"))

    def check_layer(self, num_experts: int, k: int) -> None:
        n = math.isqrt(num_experts)
        if n * n != num_experts or n < 1:
            raise ValueError(f"ProductKeyRouterConfig: num_experts must be a square n² (the keys "
                             f"are pairs of n sub-keys), got {num_experts}")
        if k % self.heads:
            raise ValueError(f"ProductKeyRouterConfig: the layer's k={k} must be a multiple of "
                             f"heads={self.heads} (each head retrieves k / heads experts)")

    def spec(self, d_model: int, num_experts: int, k: int) -> ProductKeySpec:
        return ProductKeySpec(d_model=d_model, num_subkeys=math.isqrt(num_experts),
                              heads=self.heads, k=k // self.heads, key_dim=self.key_dim,
                              query=self.query, query_norm=self.query_norm, score=self.score)

    def num_params(self, d_model: int, num_experts: int) -> int:
        return self.spec(d_model, num_experts, self.heads).num_params()


@implements(ProductKeyRouterConfig)
class ProductKeyTopK(ProductKeyRouter):
    """:class:`ProductKeyRouter` built from a :class:`ProductKeyRouterConfig` and a layer's
    ``num_experts`` and ``k``, as every registered router is; ``init`` scales the sub-keys like
    the layer's expert keys (``"sigma_moe"``/``"standard"``: N(0, sqrt(2/(d_model init_depth)))
    per entry of a full key) or as Lample et al. (``"switch"``: their default)."""

    def __init__(self, config: ProductKeyRouterConfig, d_model: int, num_experts: int, k: int,
                 init: str = "sigma_moe", init_depth: int = 1) -> None:
        config.check_layer(num_experts, k)
        if config.query == "identity" and config.key_dim != d_model:
            raise ValueError(f"ProductKeyRouterConfig: query='identity' splits the input itself, "
                             f"so key_dim must equal d_model={d_model}, got {config.key_dim}")
        key_std = None if init == "switch" else math.sqrt(2.0 / (d_model * init_depth))
        super().__init__(config.spec(d_model, num_experts, k), key_std=key_std)
        self.config = config
