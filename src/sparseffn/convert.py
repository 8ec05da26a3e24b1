"""Dense → sparse conversion: MoEfication (Zhang et al. 2022, arXiv:2110.01786), which
Csordás et al. 2023 (arXiv:2310.10837) cite as the way to make a *trained* dense MLP sparse
without pre-training it again.

A two-layer MLP ``y = W2 act(W1 x + b1) + b2`` of width ``d_ff`` is a sum over its hidden
units. Split the units into ``num_experts`` groups of ``d_ff / num_experts`` and the MLP is a
mixture of experts in which every expert is active; keeping only the ``k`` experts that matter
most for a token approximates it at ``k / num_experts`` of its FFN compute. A gated MLP
``W2 (act(Wg x) ⊙ W1 x)`` (Llama's SwiGLU) is a sum over its units in the same way; its
experts are gated too (``MoEConfig(gated=True)``). Three steps:

1. :func:`split_hidden_units` groups the units, by balanced k-means on their input weights
   (Zhang et al.'s parameter-clustering split) or on their activations over sample tokens
   (a k-means form of their co-activation split: units that fire on the same tokens land in
   the same expert).
2. :func:`moefy` copies the weights into a :class:`~sparseffn.MoE` with MoEfication's hard
   gate (a selected expert counts fully, ``SigmaRouterConfig(gate="hard")``) and the dense
   biases (``MoEConfig(bias=True)``); the router starts at the groups' centroids (their
   similarity selection). With ``k = num_experts`` the layer computes the dense MLP exactly.
3. :func:`fit_router` trains the router to predict each token's best experts on sample
   hidden states (their MLP selection: multi-label classification with binary
   cross-entropy), and :func:`distill` optionally fine-tunes the converted model against the
   dense one.

The opposite trade, :func:`upcycle`: sparse upcycling (Komatsuzaki et al. 2022,
arXiv:2212.05055) makes each expert a copy of the whole MLP, a larger mixture that starts as
the trained dense MLP.

:mod:`sparseffn.hf` applies both to every MLP of a Hugging Face model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn
from torch.nn import functional as F

from .activations import ACTIVATIONS, activation_fn
from .layers.dense import DenseMLP
from .layers.moe import MoE, MoEConfig
from .ops.assignment import capacity_rounding
from .routers.sigma import SigmaRouterConfig, SoftmaxRouterConfig

SPLIT_METHODS = ("weights", "activations")


@dataclass(frozen=True)
class DenseWeights:
    """The weights of ``y = act(x w1ᵀ + b1) w2ᵀ + b2``, in ``nn.Linear``'s layout, or with
    ``w_gate`` of the gated MLP ``y = (act(x w_gateᵀ) ⊙ (x w1ᵀ + b1)) w2ᵀ + b2`` (Shazeer 2020,
    arXiv:2002.05202; Llama's ``down(act(gate(x)) * up(x))`` has w1 = up, w_gate = gate).

    w1: [d_ff, d_model]; b1: [d_ff] or None; w2: [d_model, d_ff]; b2: [d_model] or None;
    activation: a name of :data:`sparseffn.activations.ACTIVATIONS`; w_gate: [d_ff, d_model]
    or None.
    """

    w1: torch.Tensor
    b1: torch.Tensor | None
    w2: torch.Tensor
    b2: torch.Tensor | None
    activation: str
    w_gate: torch.Tensor | None = None

    def __post_init__(self) -> None:
        d_ff, d_model = self.w1.shape
        if self.w2.shape != (d_model, d_ff):
            raise ValueError(f"DenseWeights: w2 must be [d_model, d_ff] = [{d_model}, {d_ff}], "
                             f"got {list(self.w2.shape)}")
        for name, bias, size in (("b1", self.b1, d_ff), ("b2", self.b2, d_model)):
            if bias is not None and bias.shape != (size,):
                raise ValueError(f"DenseWeights: {name} must have shape [{size}], "
                                 f"got {list(bias.shape)}")
        if self.w_gate is not None and self.w_gate.shape != self.w1.shape:
            raise ValueError(f"DenseWeights: w_gate must be [d_ff, d_model] = [{d_ff}, "
                             f"{d_model}], got {list(self.w_gate.shape)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"DenseWeights: activation must be one of {ACTIVATIONS}, "
                             f"got {self.activation!r}")

    @property
    def d_model(self) -> int:
        return self.w1.shape[1]

    @property
    def d_ff(self) -> int:
        return self.w1.shape[0]

    @property
    def gated(self) -> bool:
        return self.w_gate is not None

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``act(x w1ᵀ + b1)`` (gated: ``act(x w_gateᵀ) ⊙ (x w1ᵀ + b1)``): [N, d_ff] for x
        [N, d_model], in x's dtype (half-precision weights are cast to it, so float32 samples
        probe a bf16 model at full precision)."""
        b1 = None if self.b1 is None else self.b1.to(x.dtype)
        pre = F.linear(x, self.w1.to(x.dtype), b1)
        act = activation_fn(self.activation)
        return act(pre) if self.w_gate is None else act(F.linear(x, self.w_gate.to(x.dtype))) * pre

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """The dense MLP's output [N, d_model], in x's dtype (as :meth:`hidden`)."""
        b2 = None if self.b2 is None else self.b2.to(x.dtype)
        return F.linear(self.hidden(x), self.w2.to(x.dtype), b2)

    @classmethod
    def from_linears(cls, up: nn.Linear, down: nn.Linear, activation: str) -> "DenseWeights":
        """The weights of ``down(act(up(x)))``, detached (no copy)."""
        return cls(up.weight.detach(), _detached(up.bias), down.weight.detach(),
                   _detached(down.bias), activation)

    @classmethod
    def of(cls, module: nn.Module) -> "DenseWeights":
        """The weights of a :class:`~sparseffn.DenseMLP` (Hugging Face MLPs:
        :func:`sparseffn.hf.dense_weights`)."""
        if isinstance(module, DenseMLP):
            return cls.from_linears(module.up, module.down, module.config.activation)
        raise TypeError(f"DenseWeights.of: no dense MLP weights known for "
                        f"{type(module).__name__}; pass DenseWeights(w1, b1, w2, b2, activation)")


def _detached(p: torch.Tensor | None) -> torch.Tensor | None:
    return None if p is None else p.detach()


def _dense_weights(dense: DenseWeights | nn.Module) -> DenseWeights:
    return dense if isinstance(dense, DenseWeights) else DenseWeights.of(dense)


def _expert_size(d_ff: int, num_experts: int) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if d_ff % num_experts:
        raise ValueError(f"cannot split d_ff={d_ff} hidden units into {num_experts} equal "
                         f"experts: choose num_experts dividing {d_ff}")
    return d_ff // num_experts


def balanced_kmeans(points: torch.Tensor, num_clusters: int, *, iterations: int = 20,
                    seed: int = 0) -> torch.Tensor:
    """Cluster ``points`` [n, dim] into ``num_clusters`` clusters of exactly
    ``n / num_clusters`` points (Zhang et al. 2022 §3.1's balanced k-means): each step assigns
    the points to the nearest centroids under the size limit (deferred acceptance,
    :func:`~sparseffn.ops.assignment.capacity_rounding`), then moves each centroid to its
    points' mean. Returns the cluster of each point, int64 [n]."""
    n = points.shape[0]
    size = _expert_size(n, num_clusters)
    points = points.detach().float()
    generator = torch.Generator(device="cpu").manual_seed(seed)
    start = torch.randperm(n, generator=generator)[:num_clusters].to(points.device)
    centroids = points[start].clone()
    assignment = None
    for _ in range(iterations):
        distances = torch.cdist(points, centroids)                                # [n, C]
        new = capacity_rounding(-distances, 1, size)[:, 0]
        if assignment is not None and torch.equal(new, assignment):
            break
        assignment = new
        centroids = torch.zeros_like(centroids).index_add_(0, assignment, points) / size
    return assignment


def split_hidden_units(dense: DenseWeights | nn.Module, num_experts: int, *,
                       method: str = "weights", samples: torch.Tensor | None = None,
                       seed: int = 0) -> torch.Tensor:
    """Group the dense MLP's hidden units into ``num_experts`` experts of equal size.

    method: ``"weights"`` clusters the rows of ``w1`` (normalised to unit length, so units
      that respond to the same input direction group together; for a gated MLP each unit's
      normalised gate row and ``w1`` row side by side); ``"activations"`` clusters
      each unit's activations over ``samples`` [N, d_model] (hidden states the MLP sees), so
      that units active on the same tokens share an expert and few experts cover a token.
    Returns int64 [num_experts, d_ff / num_experts]: the hidden units of each expert, sorted.
    """
    dense = _dense_weights(dense)
    if method not in SPLIT_METHODS:
        raise ValueError(f"split method must be one of {SPLIT_METHODS}, got {method!r}")
    _expert_size(dense.d_ff, num_experts)
    if method == "weights":
        points = F.normalize(dense.w1.float(), dim=1)
        if dense.gated:
            points = torch.cat([F.normalize(dense.w_gate.float(), dim=1), points], dim=1)
    else:
        if samples is None or samples.dim() != 2 or samples.shape[1] != dense.d_model:
            raise ValueError(f'split method "activations" needs samples [N, {dense.d_model}] '
                             f"of the MLP's inputs")
        with torch.no_grad():
            points = F.normalize(dense.hidden(samples.float()).t(), dim=1)        # [d_ff, N]
    clusters = balanced_kmeans(points, num_experts, seed=seed)
    return torch.argsort(clusters * dense.d_ff + torch.arange(dense.d_ff, device=clusters.device)
                         ).view(num_experts, -1)


@torch.no_grad()
def moefy(dense: DenseWeights | nn.Module, num_experts: int, k: int, *,
          groups: torch.Tensor | None = None, method: str = "weights",
          samples: torch.Tensor | None = None, seed: int = 0) -> MoE:
    """A :class:`~sparseffn.MoE` made of the dense MLP's own hidden units.

    dense: a :class:`DenseWeights` or a :class:`~sparseffn.DenseMLP`.
    groups: int64 [num_experts, expert_size], the units of each expert (default:
      :func:`split_hidden_units` with ``method``, ``samples`` and ``seed``).
    The router (σ-MoE's linear selection with the hard gate, no regulariser) starts with each
    expert's row at the mean of its units' ``w1`` rows (of a gated MLP, ``w_gate`` rows: what
    decides whether a unit fires) — the expert's mean pre-activation, bias aside: a
    similarity selection; train it with
    :func:`fit_router`. With ``k = num_experts`` the output is the dense MLP's, up to
    rounding.
    """
    dense = _dense_weights(dense)
    expert_size = _expert_size(dense.d_ff, num_experts)
    if groups is None:
        groups = split_hidden_units(dense, num_experts, method=method, samples=samples, seed=seed)
    if groups.shape != (num_experts, expert_size) or not torch.equal(
            torch.sort(groups.reshape(-1)).values,
            torch.arange(dense.d_ff, device=groups.device)):
        raise ValueError(f"groups must be a partition of the {dense.d_ff} hidden units into "
                         f"[{num_experts}, {expert_size}]")
    biased = dense.b1 is not None or dense.b2 is not None
    config = MoEConfig(d_model=dense.d_model, num_experts=num_experts, expert_size=expert_size,
                       k=k, router=SigmaRouterConfig(gate="hard", entropy_weight=0.0),
                       activation=dense.activation, bias=biased, gated=dense.gated)
    with torch.device(dense.w1.device):
        layer = MoE(config).to(dense.w1.dtype)
    store = layer.store
    store.w1.copy_(dense.w1[groups])                                   # [E, G, d_model]
    store.w2.copy_(dense.w2.t()[groups])                               # [E, G, d_model]
    if dense.gated:
        store.w_gate.copy_(dense.w_gate[groups])                       # [E, G, d_model]
    if biased:
        store.b1.copy_(dense.b1[groups] if dense.b1 is not None else 0.0)
        store.b_out.copy_(dense.b2 if dense.b2 is not None else 0.0)
    # each expert's mean pre-activation (bias aside): a similarity selection to start from
    selecting = dense.w_gate if dense.gated else dense.w1
    layer.router.weight.copy_(selecting.float()[groups].mean(1))      # [E, d_model]
    return layer


@torch.no_grad()
def upcycle(dense: DenseWeights | nn.Module, num_experts: int, k: int, *,
            router=None) -> MoE:
    """A :class:`~sparseffn.MoE` whose ``num_experts`` experts are each a copy of the whole
    dense MLP: sparse upcycling (Komatsuzaki et al. 2022, arXiv:2212.05055), which starts a
    mixture of experts from a trained dense checkpoint instead of from scratch. Each token
    then uses ``k`` copies, so the layer holds ``num_experts`` times the MLP's parameters and
    computes ``k`` times its FLOPs (the opposite trade to :func:`moefy`, which divides the MLP).

    dense: a :class:`DenseWeights` or a :class:`~sparseffn.DenseMLP`.
    router: the router of the mixture, as :class:`~sparseffn.MoEConfig` takes it (a config,
      a dict with ``type``, or a name); default a softmax over the experts whose ``k`` kept
      gates are renormalised to sum to one (``SoftmaxRouterConfig(renormalize=True)``,
      Mixtral's top-k gate), freshly initialised. With it, and any router whose gates sum to
      one over the experts computed, the upcycled layer computes the dense MLP exactly at
      initialisation (up to rounding): the experts are equal and their gates sum to one.
      The experts then differ as training sends them different tokens.
    """
    dense = _dense_weights(dense)
    biased = dense.b1 is not None or dense.b2 is not None
    config = MoEConfig(d_model=dense.d_model, num_experts=num_experts, expert_size=dense.d_ff,
                       k=k, router=router if router is not None else
                       SoftmaxRouterConfig(renormalize=True),
                       activation=dense.activation, bias=biased, gated=dense.gated)
    with torch.device(dense.w1.device):
        layer = MoE(config).to(dense.w1.dtype)
    store = layer.store
    store.w1.copy_(dense.w1.expand_as(store.w1))                       # [E, d_ff, d_model]
    store.w2.copy_(dense.w2.t().expand_as(store.w2))                   # [E, d_ff, d_model]
    if dense.gated:
        store.w_gate.copy_(dense.w_gate.expand_as(store.w_gate))
    if biased:
        store.b1.copy_(dense.b1.expand_as(store.b1) if dense.b1 is not None else 0.0)
        store.b_out.copy_(dense.b2 if dense.b2 is not None else 0.0)
    return layer


@torch.no_grad()
def expert_importance(layer: MoE, x: torch.Tensor, *, chunk: int = 2048) -> torch.Tensor:
    """How much each expert adds to each token's output: ``‖f_e(x_t)‖`` [N, num_experts],
    the norm of expert e's contribution without the gate (what dropping it would change; the
    targets of :func:`fit_router`)."""
    store = layer.store
    out = []
    for part in torch.split(x, chunk):
        part = part.to(store.w1.dtype)
        hidden = torch.einsum("nd,egd->neg", part, store.w1)
        if store.b1 is not None:
            hidden = hidden + store.b1
        act = activation_fn(store.activation)
        hidden = act(hidden) if store.w_gate is None else \
            act(torch.einsum("nd,egd->neg", part, store.w_gate)) * hidden
        out.append(torch.einsum("neg,egd->ned", hidden, store.w2).norm(dim=-1).float())
    return torch.cat(out) if out else x.new_zeros(0, store.num_experts)


def _recall(logits: torch.Tensor, target: torch.Tensor, k: int) -> float:
    """Share of each token's k best experts that the router's top k contains."""
    if logits.shape[0] == 0:
        return float("nan")
    chosen = torch.zeros_like(target).scatter_(1, logits.topk(k, dim=1).indices, 1.0)
    return float((chosen * target).sum() / target.sum())


def fit_router(layer: MoE, samples: torch.Tensor, *, steps: int = 300, lr: float = 1e-2,
               batch_size: int = 1024, validation_fraction: float = 0.1, seed: int = 0
               ) -> dict[str, float]:
    """Train the router of a converted layer to pick each token's best experts (Zhang et al.
    2022 §3.2's MLP selection, with σ-MoE's linear router): targets are the top k experts by
    :func:`expert_importance`, the loss binary cross-entropy on the router's logits, Adam.

    samples: [N, d_model] inputs of the MLP (hidden states from real text). Only the router's
    weights change. Returns ``{"recall": …, "recall_before": …, "oracle_share": …}`` on the
    held-out ``validation_fraction``: the share of the true top-k experts the router finds
    after and before fitting, and the share of the total expert-output norm those true top-k
    carry (how much any k-expert selection can keep).
    """
    if samples.dim() != 2 or samples.shape[1] != layer.d_model:
        raise ValueError(f"fit_router: samples must be [N, {layer.d_model}], "
                         f"got {list(samples.shape)}")
    k = layer.config.k
    generator = torch.Generator(device="cpu").manual_seed(seed)
    order = torch.randperm(samples.shape[0], generator=generator).to(samples.device)
    held_out = int(samples.shape[0] * validation_fraction)
    valid, train = samples[order[:held_out]], samples[order[held_out:]]
    if train.shape[0] == 0:
        raise ValueError("fit_router: no training samples left after the validation split")

    def targets(x):
        importance = expert_importance(layer, x)
        top = importance.topk(k, dim=1).indices
        return torch.zeros_like(importance).scatter_(1, top, 1.0), importance

    train_y, _ = targets(train)
    valid_y, valid_importance = targets(valid)
    weight = layer.router.weight
    with torch.no_grad():
        recall_before = _recall(layer.router.logits(valid), valid_y, k)
    optimizer = torch.optim.Adam([weight], lr=lr)
    for _ in range(steps):
        index = torch.randint(0, train.shape[0], (min(batch_size, train.shape[0]),),
                              generator=generator).to(samples.device)
        logits = layer.router.logits(train[index])
        loss = F.binary_cross_entropy_with_logits(logits, train_y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    weight.grad = None
    with torch.no_grad():
        recall = _recall(layer.router.logits(valid), valid_y, k)
        oracle = float((valid_importance * valid_y).sum() / valid_importance.sum()) \
            if valid.shape[0] else float("nan")
    return {"recall": recall, "recall_before": recall_before, "oracle_share": oracle}


def distill(student: nn.Module, teacher: nn.Module, batches: Iterable, *,
            output: Callable[[nn.Module, object], torch.Tensor], steps: int, lr: float = 1e-4,
            parameters: Iterable[nn.Parameter] | None = None) -> list[float]:
    """Fine-tune ``student`` (the converted model) to reproduce ``teacher`` (the dense one):
    mean squared error between ``output(student, batch)`` and ``output(teacher, batch)``,
    AdamW on ``parameters`` (default: all of the student's that require gradients), for
    ``steps`` batches drawn from ``batches`` in turn (cycled). Returns the loss per step."""
    params = [p for p in (student.parameters() if parameters is None else parameters)
              if p.requires_grad]
    if not params:
        raise ValueError("distill: no trainable parameters")
    batches = list(batches)
    if not batches:
        raise ValueError("distill: no batches")
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    teacher.eval()
    was_training = student.training
    student.train()
    losses = []
    try:
        for step in range(steps):
            batch = batches[step % len(batches)]
            with torch.no_grad():
                target = output(teacher, batch)
            loss = F.mse_loss(output(student, batch), target)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    finally:
        student.train(was_training)
    return losses
