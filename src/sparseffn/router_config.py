"""Router configurations: one frozen dataclass per routing rule.

A :class:`~sparseffn.config.MoEConfig` holds one of these as its ``router`` field. Each
round-trips through a dict with a ``type`` field, so in TOML a router is a sub-table::

    [ffn]
    type = "moe"
    d_model = 512
    num_experts = 16
    expert_size = 128
    k = 1
    [ffn.router]
    type = "switch"
    capacity_factor = 1.25

``RouterConfig.check_layer(num_experts, k)`` rejects a router that cannot run with the
layer's ``num_experts`` and ``k`` (Switch is top-1, GShard top-2, a dense gate uses every
expert), naming what is allowed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from .ops.fff import SOFT_FORMULATIONS, TREE_ACTIVATIONS
from .validation import (from_typed_dict, matrix_tuple, require_bool, require_choice,
                         require_non_negative, require_positive_int, require_probability)

SIGMA_GATES = ("sigmoid", "softmax", "softmax_renorm")
SBASE_ASSIGNMENTS = ("sinkhorn", "exact")
SBASE_ROUNDINGS = ("topk", "capacity")
GSHARD_SECOND_EXPERT = ("random", "all")


def _require_capacity_factor(config: object) -> None:
    value = getattr(config, "capacity_factor")
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{type(config).__name__}.capacity_factor must be a non-negative number "
                         f"(0 or None: dropless), got {value!r}")


class RouterConfig:
    """Mixin for router configs: dict round trip under a registered ``type`` name."""

    type_name: ClassVar[str]
    _registry: ClassVar[dict[str, type]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        RouterConfig._registry[cls.type_name] = cls

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, **dataclasses.asdict(self)}  # type: ignore[call-overload]

    def check_layer(self, num_experts: int, k: int) -> None:
        """Raise ValueError if this router cannot select ``k`` of ``num_experts`` experts."""

    def num_params(self, d_model: int, num_experts: int) -> int:
        """Parameters of the selection network."""
        return num_experts * d_model

    def aux_loss_weights(self) -> dict[str, float]:
        """The weight of each auxiliary loss the router records."""
        return {}


def router_config_from(value: Any) -> RouterConfig:
    """A router config from a config object, a dict with ``type`` or a bare type name."""
    if isinstance(value, RouterConfig):
        return value
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict):
        raise ValueError(f"router must be a router config, a dict with 'type' or a router "
                         f"name, got {value!r}")
    return from_typed_dict(RouterConfig._registry, value, "router")


def _require_k(config: RouterConfig, k: int, allowed: int, why: str) -> None:
    if k != allowed:
        raise ValueError(f"{type(config).__name__} routes every token to {why}: the layer's k "
                         f"must be {allowed}, got k={k}")


@dataclass(frozen=True)
class SigmaRouterConfig(RouterConfig):
    """σ-MoE's selection (seed 001 §5): ``s = σ(W_s x)``, top-k, unnormalised.

    gate: ``"sigmoid"``, or Table 4's ablations ``"softmax"`` (softmax over all experts, then
      top-k) and ``"softmax_renorm"`` (softmax over the k selected, App. A.1 Eq. 37-39).
    entropy_weight: γ of the batch-entropy regulariser (Eq. 34-35).
    expert_dropout: δ of Eq. 36 (per token and expert, during training, no rescaling).
    """

    type_name: ClassVar[str] = "sigma"

    gate: str = "sigmoid"
    entropy_weight: float = 0.001
    expert_dropout: float = 0.0

    def __post_init__(self) -> None:
        require_choice(self, "gate", SIGMA_GATES)
        require_non_negative(self, "entropy_weight")
        require_probability(self, "expert_dropout")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"entropy": self.entropy_weight}


@dataclass(frozen=True)
class SoftmaxRouterConfig(RouterConfig):
    """Softmax top-k (seed 001 §3.3, Table 4): ``s = softmax(W x)`` over all experts, then
    top-k; with ``renormalize`` the k kept scores are renormalised to sum to one
    (``normtopk``, App. A.1 Eq. 37-39, the same as a softmax over the k selected logits).
    Regularised with the batch entropy of Eq. 35, as seed 001 does for its softmax variants."""

    type_name: ClassVar[str] = "softmax"

    renormalize: bool = False
    entropy_weight: float = 0.001
    expert_dropout: float = 0.0

    def __post_init__(self) -> None:
        require_bool(self, "renormalize")
        require_non_negative(self, "entropy_weight")
        require_probability(self, "expert_dropout")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"entropy": self.entropy_weight}


@dataclass(frozen=True)
class NoisyTopKRouterConfig(RouterConfig):
    """Shazeer et al. (2017) noisy top-k gating (seed 001 Eq. 27-28, seed 004).

    ``H(x) = W_g x + N(0,1) · softplus(W_noise x)`` during training,
    ``G(x) = softmax(KeepTopK(H(x), k))``.

    importance_weight: weight of ``CV(importance)²``, importance = Σ_x G(x) (Eq. 28).
    load_weight: weight of ``CV(load)²``, Shazeer's smooth estimate of the number of tokens
      per expert (the probability that each expert stays in the top k under new noise).
    noise_epsilon: added to the noise standard deviation (keeps it positive).
    train_noise: add the noise during training (never at evaluation).
    """

    type_name: ClassVar[str] = "noisy_topk"

    importance_weight: float = 0.01
    load_weight: float = 0.01
    noise_epsilon: float = 0.01
    train_noise: bool = True

    def __post_init__(self) -> None:
        require_non_negative(self, "importance_weight")
        require_non_negative(self, "load_weight")
        require_non_negative(self, "noise_epsilon")
        require_bool(self, "train_noise")

    def num_params(self, d_model: int, num_experts: int) -> int:
        return 2 * num_experts * d_model      # W_g and W_noise

    def aux_loss_weights(self) -> dict[str, float]:
        return {"importance": self.importance_weight, "load": self.load_weight}


@dataclass(frozen=True)
class SwitchRouterConfig(RouterConfig):
    """Switch Transformer routing (Fedus et al. 2022; seeds 001 §4, 002, 004).

    Top-1 after the softmax, not renormalised; each expert takes at most
    ``capacity = ceil(capacity_factor · tokens / num_experts)`` tokens, in token order; the
    rest are dropped (their expert output is zero, the residual carries them).
    ``capacity_factor`` 0 or None: dropless.

    balance_weight: weight of ``N_E · f·p`` (seed 001 Eq. 29-31); Switch uses 0.01.
    z_loss_weight: weight of the router z-loss ``mean(logsumexp(logits)²)`` (ST-MoE); 0: off.
    expert_dropout: seed 001's expert dropout (Eq. 36) applied to the selection; the other
      choice, Switch's high dropout inside the experts, is the layer's ``hidden_dropout``.
    jitter: multiply the router input by U(1-jitter, 1+jitter) during training (Switch's
      "input jitter"); 0: off.
    """

    type_name: ClassVar[str] = "switch"

    capacity_factor: float | None = 1.25
    balance_weight: float = 0.01
    z_loss_weight: float = 0.0
    expert_dropout: float = 0.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        _require_capacity_factor(self)
        require_non_negative(self, "balance_weight")
        require_non_negative(self, "z_loss_weight")
        require_probability(self, "expert_dropout")
        require_probability(self, "jitter")

    def check_layer(self, num_experts: int, k: int) -> None:
        _require_k(self, k, 1, "one expert (top-1)")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"balance": self.balance_weight, "z_loss": self.z_loss_weight}


@dataclass(frozen=True)
class GShardRouterConfig(RouterConfig):
    """GShard top-2 gating (Lepikhin et al. 2021; seed 004 Algorithm 1).

    Tokens are split into groups of ``group_size`` (None: the whole batch is one group). In
    each group every expert has a buffer of
    ``capacity = ceil(capacity_factor · 2 · group_size / num_experts)`` positions; the first
    choices fill it in token order, then the second choices, each dispatched only with
    probability ``min(1, 2 · g2)`` (``second_expert="random"``, during training; at
    evaluation and with ``"all"`` every second choice is dispatched). ``capacity_factor`` 0 or
    None: dropless.

    aux_weight: weight of the group auxiliary loss ``(1/E) Σ_e (c_e / S) · m_e`` (line 13).
    """

    type_name: ClassVar[str] = "gshard"

    capacity_factor: float | None = 1.0
    group_size: int | None = None
    second_expert: str = "random"
    aux_weight: float = 0.01

    def __post_init__(self) -> None:
        _require_capacity_factor(self)
        if self.group_size is not None:
            require_positive_int(self, "group_size")
        require_choice(self, "second_expert", GSHARD_SECOND_EXPERT)
        require_non_negative(self, "aux_weight")

    def check_layer(self, num_experts: int, k: int) -> None:
        _require_k(self, k, 2, "its top-2 experts")
        if num_experts < 2:
            raise ValueError(f"GShardRouterConfig needs at least 2 experts, got {num_experts}")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"gshard": self.aux_weight}


@dataclass(frozen=True)
class SBaseRouterConfig(RouterConfig):
    """BASE / S-BASE (seed 001 §4, Eq. 32-33): during training, a balanced assignment of the
    batch's tokens to experts; the selected experts are weighted by ``σ(W x)``; at evaluation
    plain top-k. Extended to k > 1 (seed 001 Table 4 "S-BASE, K=4").

    assignment: ``"sinkhorn"`` (Clark et al. 2022: Sinkhorn iterations on ``exp(W x)``, then
      the top-k of the balanced plan), or ``"exact"`` (the linear assignment of Eq. 33, each
      expert taking at most ``ceil(tokens · k / num_experts)`` tokens; solved with SciPy, for
      small batches).
    sinkhorn_iterations: number of row/column normalisations.
    rounding: how the Sinkhorn plan becomes k experts per token: ``"topk"`` (each token's k
      largest plan entries, as Clark et al. and seed 001; nearly balanced) or ``"capacity"``
      (deferred acceptance with at most ``ceil(T·k/E)`` pairs per expert: exactly balanced
      for k = 1, within a few % for k > 1; slower, see ``ops.assignment.capacity_rounding``).
    entropy_weight: γ of Eq. 35 (seed 001 regularises S-BASE with it, App. B Table 9).
    """

    type_name: ClassVar[str] = "sbase"

    assignment: str = "sinkhorn"
    sinkhorn_iterations: int = 8
    rounding: str = "topk"
    entropy_weight: float = 0.001

    def __post_init__(self) -> None:
        require_choice(self, "assignment", SBASE_ASSIGNMENTS)
        require_choice(self, "rounding", SBASE_ROUNDINGS)
        require_positive_int(self, "sinkhorn_iterations")
        require_non_negative(self, "entropy_weight")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"entropy": self.entropy_weight}


@dataclass(frozen=True)
class DenseGateRouterConfig(RouterConfig):
    """The classic gate (Jacobs et al. 1991; seed 004): ``g = softmax(V [x, 1])`` over all
    experts, every expert used (the layer's k must equal num_experts).

    margin: Eigen et al.'s deep-MoE rule (seed 004): during training an expert whose running
      total assignment exceeds the mean of all experts' by more than ``margin`` gets gate 0
      (the other gates are renormalised). None: off.
    """

    type_name: ClassVar[str] = "dense_softmax"

    margin: float | None = None

    def __post_init__(self) -> None:
        if self.margin is not None:
            require_non_negative(self, "margin")

    def check_layer(self, num_experts: int, k: int) -> None:
        _require_k(self, k, num_experts, "every expert")

    def num_params(self, d_model: int, num_experts: int) -> int:
        return num_experts * (d_model + 1)


@dataclass(frozen=True)
class HierarchicalRouterConfig(RouterConfig):
    """The hierarchical mixture's gate (Jordan & Jacobs 1994; seed 004): a tree of softmax
    gates on ``[x, 1]``, each with ``branching`` children, over ``branching ** depth`` leaf
    experts; a leaf's weight is the product of the gates on its path
    (``g_i · g_(j|i) · ...``). Every leaf is used (k must equal num_experts)."""

    type_name: ClassVar[str] = "hierarchical"

    branching: int = 2

    def __post_init__(self) -> None:
        require_positive_int(self, "branching")
        if self.branching < 2:
            raise ValueError(f"HierarchicalRouterConfig.branching must be at least 2, got "
                             f"{self.branching}")

    def depth(self, num_experts: int) -> int:
        depth = round(math.log(num_experts, self.branching)) if num_experts > 1 else 0
        if depth < 1 or self.branching ** depth != num_experts:
            raise ValueError(f"HierarchicalRouterConfig: num_experts={num_experts} must be a "
                             f"power of branching={self.branching} (branching ** depth, depth "
                             f">= 1)")
        return depth

    def num_gates(self, num_experts: int) -> int:
        """Internal nodes of the tree, each a softmax over ``branching`` children."""
        return (num_experts - 1) // (self.branching - 1)

    def check_layer(self, num_experts: int, k: int) -> None:
        self.depth(num_experts)
        _require_k(self, k, num_experts, "every leaf expert")

    def num_params(self, d_model: int, num_experts: int) -> int:
        return self.num_gates(num_experts) * self.branching * (d_model + 1)


TREE_FORMULATIONS = ("auto",) + SOFT_FORMULATIONS
TREE_INITS = ("fff", "layer")


def tree_depth(num_leaves: int, owner: str) -> int:
    """d for ``num_leaves = 2^d`` leaves (d >= 1); ValueError otherwise."""
    depth = int(num_leaves).bit_length() - 1 if isinstance(num_leaves, int) else -1
    if depth < 1 or (1 << depth) != num_leaves:
        raise ValueError(f"{owner}: a binary tree has 2^depth leaves (depth >= 1), so "
                         f"num_experts must be a power of two >= 2, got {num_leaves}")
    return depth


@dataclass(frozen=True)
class TreeRouterConfig(RouterConfig):
    """A fast feed-forward tree (Belcak & Wattenhofer; seeds 003 and 000) over
    ``num_experts = 2^depth`` leaf experts: ``2^depth - 1`` nodes with logits ``z = W x + b``,
    leaf probabilities ``R = softmax(T a(S z))`` (seed 003 Eq. 9), then top-k.

    activation: ``a``: ``"logsigmoid"`` (the original FFF, Eq. 8: R is the product of the
      sigmoids on the path), ``"softplus"`` (seed 003's default), ``"linear"``, ``"relu"``,
      ``"gelu"`` (seed 003 §2.3).
    formulation: how R is computed (all give the same R; see :mod:`sparseffn.ops.fff`):
      ``"orig"``, ``"logs"``, ``"matrix"``, ``"matrix_sparse"``, ``"levelwise"`` or
      ``"auto"`` (levelwise).
    node_width: 1: each node is one neuron, ``z_n = w_n·x + b_n`` (as in the
      ``fastfeedforward`` package and seed 003's router benchmark); h > 1: each node is a small
      MLP with h hidden ReLU units and one output (seed 003 §3.1 uses 8 or 16).
    bias: node biases.
    renormalize: rescale the k selected leaf probabilities to sum to one.
    t_matrix, s_matrix: explicit T [E, m] and S [m, n] of Eq. 9 instead of the tree's (the
      router then has n nodes and ``formulation`` must be ``"matrix"`` or ``"auto"``);
      ``T = S = I`` with ``activation="linear"`` is the softmax MoE router.
    init: ``"fff"``: uniform ±1/sqrt(d_model) for the node weights and biases, as in the
      ``fastfeedforward`` package; ``"layer"``: the layer's init scheme for the weights and zero
      biases.
    """

    type_name: ClassVar[str] = "tree"

    activation: str = "logsigmoid"
    formulation: str = "auto"
    node_width: int = 1
    bias: bool = True
    renormalize: bool = False
    t_matrix: Any = None
    s_matrix: Any = None
    init: str = "fff"

    def __post_init__(self) -> None:
        require_choice(self, "activation", TREE_ACTIVATIONS)
        require_choice(self, "formulation", TREE_FORMULATIONS)
        require_positive_int(self, "node_width")
        require_bool(self, "bias")
        require_bool(self, "renormalize")
        require_choice(self, "init", TREE_INITS)
        object.__setattr__(self, "t_matrix", matrix_tuple(self, "t_matrix"))
        object.__setattr__(self, "s_matrix", matrix_tuple(self, "s_matrix"))
        if (self.t_matrix is None) != (self.s_matrix is None):
            raise ValueError("TreeRouterConfig: give both t_matrix and s_matrix, or neither")
        if self.explicit:
            if len(self.t_matrix[0]) != len(self.s_matrix):
                raise ValueError(f"TreeRouterConfig: t_matrix has {len(self.t_matrix[0])} "
                                 f"columns but s_matrix has {len(self.s_matrix)} rows")
            if self.formulation not in ("auto", "matrix"):
                raise ValueError(f"TreeRouterConfig: explicit t_matrix/s_matrix need "
                                 f"formulation 'matrix' (or 'auto'), got {self.formulation!r}")
            if self.node_width != 1:
                raise ValueError("TreeRouterConfig: explicit t_matrix/s_matrix need node_width=1")

    @property
    def explicit(self) -> bool:
        """True when T and S are given rather than the tree's."""
        return self.t_matrix is not None

    def num_nodes(self, num_experts: int) -> int:
        return len(self.s_matrix[0]) if self.explicit else num_experts - 1

    def check_layer(self, num_experts: int, k: int) -> None:
        if self.explicit:
            if len(self.t_matrix) != num_experts:
                raise ValueError(f"TreeRouterConfig: t_matrix has {len(self.t_matrix)} rows "
                                 f"but the layer has num_experts={num_experts}")
        else:
            tree_depth(num_experts, "TreeRouterConfig")
        if not 1 <= k <= num_experts:
            raise ValueError(f"TreeRouterConfig: k must be in [1, num_experts={num_experts}], "
                             f"got {k}")

    def num_params(self, d_model: int, num_experts: int) -> int:
        nodes, h = self.num_nodes(num_experts), self.node_width
        if h == 1:
            return nodes * (d_model + int(self.bias))
        # hidden layer (weights + biases) and the output neuron (weights + bias)
        return nodes * (h * d_model + h + h + int(self.bias))
