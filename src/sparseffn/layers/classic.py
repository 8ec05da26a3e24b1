"""The classic mixtures, with every expert evaluated:

- :class:`MixtureOfExperts`: Jacobs et al. (1991), a softmax gate on ``[x, 1]`` over
  experts, for classification (softmax experts) and regression (linear-Gaussian experts);
- :class:`HierarchicalMixtureOfExperts`: Jordan & Jacobs (1994), a gate over gates, any depth;
- :class:`DeepMixtureOfExperts`: Eigen et al. (2013), stacked mixtures with the running-usage
  margin rule, then a softmax classifier.

Each is a :class:`~sparseffn.routing.SparseFFN`: it records its gate's usage statistics like
every other layer, and its gate is an ordinary router returning a
:class:`~sparseffn.routing.Routing` (all experts, weighted by the gate).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from ..registry import RouterConfig, build_router
from ..routers.classic import DenseGateRouterConfig, HierarchicalRouterConfig
from ..routing import SparseFFN

TASKS = ("classification", "regression")


class ExpertBank(nn.Module):
    """``num_experts`` small networks evaluated together: affine ``[x, 1] W_i`` experts
    (``hidden = 0``) or two-layer ``W2_i act([x, 1] W1_i) + b2_i`` experts, each followed by
    ``output_activation`` (``None`` or ``"relu"``).

    forward(x: [T, in_features]) -> [T, num_experts, out_features]
    """

    def __init__(self, num_experts: int, in_features: int, out_features: int, hidden: int = 0,
                 output_activation: str | None = None) -> None:
        super().__init__()
        self.hidden, self.output_activation = hidden, output_activation
        widths = [in_features, hidden, out_features] if hidden else [in_features, out_features]
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(num_experts, a, b)) for a, b in zip(widths, widths[1:]))
        self.biases = nn.ParameterList(
            nn.Parameter(torch.empty(num_experts, b)) for b in widths[1:])
        self.reset_parameters()

    def no_weight_decay_parameters(self) -> list[nn.Parameter]:
        """The per-expert biases (see :func:`sparseffn.param_groups`)."""
        return list(self.biases)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for weight, bias in zip(self.weights, self.biases):   # nn.Linear's default, per expert
            bound = 1.0 / math.sqrt(weight.shape[1])
            weight.uniform_(-bound, bound)
            bias.uniform_(-bound, bound)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("ti,eio->teo", x, self.weights[0]) + self.biases[0]
        if self.hidden:
            h = torch.einsum("teh,eho->teo", torch.relu(h), self.weights[1]) + self.biases[1]
        return torch.relu(h) if self.output_activation == "relu" else h


class GatedMixture(SparseFFN):
    """``y = Σ_i g_i(x) f_i(x)`` with a dense gate (every expert evaluated).

    router: :class:`DenseGateRouterConfig` (a softmax on ``[x, 1]``, optionally with the
    deep-MoE margin rule) or :class:`HierarchicalRouterConfig` (a tree of gates).

    forward(x: [..., in_features]) -> [..., out_features]
    """

    def __init__(self, in_features: int, out_features: int, num_experts: int,
                 router: RouterConfig | None = None, expert_hidden: int = 0,
                 expert_activation: str | None = None) -> None:
        super().__init__()
        router = router if router is not None else DenseGateRouterConfig()
        if not isinstance(router, (DenseGateRouterConfig, HierarchicalRouterConfig)):
            raise ValueError(f"{type(self).__name__} evaluates every expert and needs a dense "
                             f"gate (DenseGateRouterConfig or HierarchicalRouterConfig), got "
                             f"{type(router).__name__}")
        for name, value in (("in_features", in_features), ("out_features", out_features),
                            ("num_experts", num_experts)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{type(self).__name__}: {name} must be a positive integer, "
                                 f"got {value!r}")
        self.d_model, self.out_features, self.num_experts = in_features, out_features, num_experts
        self.router = build_router(router, in_features, num_experts, num_experts,
                                   init="standard")
        self.experts = ExpertBank(num_experts, in_features, out_features, expert_hidden,
                                  expert_activation)
        self.aux_loss_weights = dict(self.router.aux_loss_weights())
        self._init_usage(num_experts)

    def gates_and_outputs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, in_features] -> (gates [T, E], expert outputs [T, E, out_features])."""
        routing = self.router(x)
        self._record_routing(routing, self.num_experts)
        return routing.weights.to(x.dtype), self.experts(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._start_forward(x)
        gates, outputs = self.gates_and_outputs(x.reshape(-1, self.d_model))
        y = torch.einsum("te,teo->to", gates, outputs)
        return y.reshape(*x.shape[:-1], self.out_features)


class MixtureOfExperts(GatedMixture):
    """Jacobs et al. (1991): ``P(y|x) = Σ_i g_i(x) P_i(y|x)``, the gate a softmax
    on ``[x, 1]``, every expert evaluated.

    - ``task="classification"``: expert i predicts ``ŷ_i = softmax(W_i [x, 1])`` over
      ``out_features`` classes; the mixture ``ŷ = Σ_i g_i ŷ_i``. ``forward`` returns
      ``log ŷ`` [..., classes], so ``F.nll_loss(model(x), y)`` is the mixture's negative
      log-likelihood.
    - ``task="regression"``: expert i predicts the mean ``μ_i = W_i [x, 1]`` of a unit-variance
      Gaussian; ``forward`` returns the mixture mean ``Σ_i g_i μ_i``, and :meth:`loss` the
      mixture's negative log-likelihood ``-log Σ_i g_i exp(-|y - μ_i|² / 2)`` (up to a
      constant), which lets experts specialise (Jacobs et al.'s objective).

    ``expert_hidden > 0`` makes each expert a two-layer ReLU network instead of affine.
    """

    def __init__(self, in_features: int, out_features: int, num_experts: int,
                 task: str = "classification", expert_hidden: int = 0,
                 router: RouterConfig | None = None) -> None:
        if task not in TASKS:
            raise ValueError(f"{type(self).__name__}: task must be one of {TASKS}, got {task!r}")
        super().__init__(in_features, out_features, num_experts, router, expert_hidden)
        self.task = task

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._start_forward(x)
        gates, outputs = self.gates_and_outputs(x.reshape(-1, self.d_model))
        if self.task == "classification":   # log Σ_i g_i softmax(o_i)
            log_gates = gates.clamp_min(1e-30).log().unsqueeze(-1)
            y = torch.logsumexp(log_gates + torch.log_softmax(outputs, dim=-1), dim=1)
        else:
            y = torch.einsum("te,teo->to", gates, outputs)
        return y.reshape(*x.shape[:-1], self.out_features)

    def loss(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mixture's mean negative log-likelihood. target: int64 [...] class ids
        (classification) or [..., out_features] values (regression)."""
        if self.task == "classification":
            log_probs = self(x).reshape(-1, self.out_features)
            return F.nll_loss(log_probs, target.reshape(-1))
        self._start_forward(x)
        gates, means = self.gates_and_outputs(x.reshape(-1, self.d_model))
        target = target.reshape(-1, 1, self.out_features)
        log_likelihood = gates.clamp_min(1e-30).log() - 0.5 * (target - means).square().sum(-1)
        return -torch.logsumexp(log_likelihood, dim=1).mean()


class HierarchicalMixtureOfExperts(MixtureOfExperts):
    """Jordan & Jacobs (1994): ``P(y|x) = Σ_i g_i Σ_j g_(j|i) ... P_ij...(y)``, a tree
    of softmax gates with ``branching`` children per node and ``branching ** depth`` leaf
    experts (see :class:`~sparseffn.routers.HierarchicalRouter`)."""

    def __init__(self, in_features: int, out_features: int, branching: int = 2,
                 depth: int = 2, task: str = "classification", expert_hidden: int = 0) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"HierarchicalMixtureOfExperts: depth must be a positive integer, "
                             f"got {depth!r}")
        router = HierarchicalRouterConfig(branching=branching)
        super().__init__(in_features, out_features, branching ** depth, task, expert_hidden,
                         router)


class DeepMixtureOfExperts(nn.Module):
    """Eigen, Ranzato & Sutskever (2013): stacked mixtures of ReLU experts and a
    softmax classifier,

        z¹ = Σ_i g¹_i(x) f¹_i(x),   z² = Σ_j g²_j(z¹) f²_j(z¹),   F(x) = softmax(f³(z²)),

    with ``len(hidden)`` mixtures of ``num_experts`` experts each. ``margin`` applies the
    running-usage rule to every gate during training (see
    :class:`~sparseffn.routers.DenseGateRouter`). ``forward`` returns log-probabilities.

    forward(x: [..., in_features]) -> [..., num_classes]
    """

    def __init__(self, in_features: int, num_classes: int, hidden: tuple[int, ...] = (64, 64),
                 num_experts: int = 4, margin: float | None = None) -> None:
        super().__init__()
        widths = [in_features, *hidden]
        router = DenseGateRouterConfig(margin=margin)
        self.mixtures = nn.ModuleList(
            GatedMixture(a, b, num_experts, router, expert_activation="relu")
            for a, b in zip(widths, widths[1:]))
        self.classifier = nn.Linear(widths[-1], num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for mixture in self.mixtures:
            x = mixture(x)
        return torch.log_softmax(self.classifier(x), dim=-1)
