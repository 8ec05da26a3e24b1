"""Expert-choice routing (Zhou et al. 2022, "Mixture-of-Experts with Expert Choice Routing",
arXiv:2202.09368): each expert chooses its tokens, instead of each token its experts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..losses import router_z_loss
from ..registry import RouterConfig, implements
from ..routing import Routing
from ..validation import require_choice, require_non_negative
from .base import LinearRouter, ROUTER_PRECISIONS, selected_scores

EXPERT_CHOICE_EVAL_ROUTINGS = ("expert_choice", "top_k")


@dataclass(frozen=True)
class ExpertChoiceRouterConfig(RouterConfig):
    """Expert-choice routing (Zhou et al. 2022, arXiv:2202.09368): ``S = softmax(X W_g)``
    over the experts, then each expert takes the ``capacity = ceil(k · tokens / num_experts)``
    tokens of the batch with the largest score for it (``TopK(Sᵀ)``), each with weight
    ``S[token, expert]``. The layer's ``k`` is the paper's capacity factor ``c``: on average a
    token is processed by ``k`` experts, but one token may get up to ``num_experts`` and
    another none (its output is then zero, and the residual carries it). Every expert gets
    exactly ``capacity`` tokens, so no balancing loss is needed.

    A token's experts depend on the other tokens of the batch, the later ones of a sequence
    included (Zhou et al. name this among their limitations: it does not suit autoregressive
    decoding):

    eval_routing: ``"expert_choice"`` (the default: evaluation routes as training does, over
      the tokens evaluated together, so a model with it generates without a KV cache) or
      ``"top_k"`` (in evaluation mode each token takes its own k experts of largest ``S``,
      with weights ``S``; a token's output then depends on that token alone, and generation
      can use a KV cache).
    z_loss_weight: weight of ST-MoE's router z-loss ``mean(logsumexp(W x)²)``; 0 (the
      default, as in Zhou et al.): computed but not trained on.
    precision: the selection product ``W x`` in ``"float32"`` (the default; Switch's
      "selective precision") or ``"autocast"`` (see
      :func:`~sparseffn.routers.base.selection_linear`).
    """

    type_name: ClassVar[str] = "expert_choice"

    eval_routing: str = "expert_choice"
    z_loss_weight: float = 0.0
    precision: str = "float32"

    def __post_init__(self) -> None:
        require_choice(self, "precision", ROUTER_PRECISIONS)
        require_choice(self, "eval_routing", EXPERT_CHOICE_EVAL_ROUTINGS)
        require_non_negative(self, "z_loss_weight")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"z_loss": self.z_loss_weight}


def expert_choice_capacity(tokens: int, k: int, num_experts: int) -> int:
    """Each expert's number of tokens, ``ceil(k · tokens / num_experts)``: Zhou et al. 2022's
    ``n · c / e`` for ``n`` tokens, ``e`` experts and capacity factor ``c`` (this layer's
    ``k``), rounded up so that the experts together serve at least ``k`` pairs a token. 0 for
    no tokens, and never more than ``tokens`` (``k <= num_experts``)."""
    return (k * tokens + num_experts - 1) // num_experts


def choose_tokens(scores: torch.Tensor, capacity: int) -> torch.Tensor:
    """Which (token, expert) pairs the experts choose: each expert (a column of ``scores``
    [T, E]) its ``capacity`` tokens of largest score (``G, I = TopK(Sᵀ, k)`` of Zhou et al.
    2022, whose ``k`` is this ``capacity``). Returns bool [T, E].

    Each token's rank in its expert's column, compared with the capacity, rather than a
    ``topk`` of ``capacity``: an exported program serves every token count, and ``topk``'s
    checks of a count computed from the input's size were guards that ``torch.export``
    could not prove (``ceil(k T / E) <= T``). (Not a stable sort: ONNX has none for floats.)"""
    tokens = scores.shape[0]
    order = torch.sort(scores.detach(), dim=0, descending=True).indices          # [T, E]
    positions = torch.arange(tokens, device=scores.device).unsqueeze(1).expand_as(order)
    # (out of place: under torch.func.vmap the positions are unbatched and order is batched)
    rank = torch.zeros_like(order).scatter(0, order, positions)
    return rank < capacity


@implements(ExpertChoiceRouterConfig)
class ExpertChoiceRouter(LinearRouter):
    """``S = softmax(W x)`` [T, E]; expert e processes the ``capacity`` tokens of largest
    ``S[:, e]`` with weight ``S[t, e]`` (Zhou et al. 2022), so ``y_t = Σ_{e chose t}
    S[t, e] · f_e(x_t)``.

    The routing has a slot for every expert: ``indices`` [T, E] (``arange(E)`` for each
    token), ``weights`` [T, E] (``S`` where chosen, else 0) and ``dispatched`` [T, E] (the
    experts' choices), so the store computes exactly ``E · capacity`` pairs, about ``k`` a
    token. In evaluation mode with ``eval_routing="top_k"`` it is each token's top k
    instead: ``indices`` and ``weights`` [T, k].

    Aux loss: ``z_loss`` (ST-MoE; weight 0 by default). Stats: ``capacity`` and
    ``unrouted_fraction``, the fraction of tokens that no expert chose.

    forward(x: [tokens, d_model]) -> Routing
    """

    @property
    def routes_tokens_alone_in_eval(self) -> bool:
        """True only with ``eval_routing="top_k"``: expert choice ranks a token against the
        others evaluated with it."""
        return self.config.eval_routing == "top_k"

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.logits(x)                                                # [T, E]
        probs = torch.softmax(logits, dim=-1)
        aux = {"z_loss": router_z_loss(logits, self.global_batch)} \
            if self.computes_aux_losses else {}
        if not self.training and self.config.eval_routing == "top_k":
            indices = torch.topk(probs.detach(), self.k, dim=-1, sorted=False).indices
            return Routing(indices=indices, weights=selected_scores(probs, indices),
                           aux_losses=aux)
        tokens = x.shape[0]
        capacity = expert_choice_capacity(tokens, self.k, self.num_experts)
        chosen = choose_tokens(probs, capacity)                                # [T, E]
        weights = torch.where(chosen, probs, torch.zeros((), dtype=probs.dtype,
                                                         device=probs.device))
        indices = torch.arange(self.num_experts, device=x.device).expand(tokens, -1)
        unrouted = (~chosen.any(-1)).float().mean() if tokens else torch.zeros(
            (), device=x.device)
        stats = {"unrouted_fraction": unrouted,
                 "capacity": torch.full((), torch.sym_float(capacity), device=x.device)}
        return Routing(indices=indices, weights=weights, dispatched=chosen, aux_losses=aux,
                       stats=stats)
