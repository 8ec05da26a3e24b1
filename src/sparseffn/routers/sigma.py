"""σ-MoE expert selection (Csordás et al. 2023 §5), its softmax ablations (Table 4) and softmax
top-k."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..losses import batch_entropy_loss
from ..registry import RouterConfig, implements
from ..routing import Routing
from ..validation import require_bool, require_choice, require_non_negative, require_probability
from .base import LinearRouter, ROUTER_PRECISIONS, drop_experts, selected_scores

SIGMA_GATES = ("sigmoid", "softmax", "softmax_renorm", "hard")


@dataclass(frozen=True)


class SigmaRouterConfig(RouterConfig):
    """σ-MoE's selection (Csordás et al. 2023 §5): ``s = σ(W_s x)``, top-k, unnormalised.

    gate: ``"sigmoid"``, or Table 4's ablations ``"softmax"`` (softmax over all experts, then
      top-k) and ``"softmax_renorm"`` (softmax over the k selected, App. A.1 Eq. 37-39);
      ``"hard"`` adds the selected experts with weight one, as MoEfication does (Zhang et al.
      2022, arXiv:2110.01786, §3.2; what :mod:`sparseffn.convert` builds), with the sigmoid's
      gradient passed straight through to the scores.
    entropy_weight: γ of the batch-entropy regulariser (Eq. 34-35).
    expert_dropout: δ of Eq. 36 (per token and expert, during training, no rescaling).
    precision: the selection product ``W x`` in ``"float32"`` (the default; Switch's
      "selective precision") or ``"autocast"`` (see
      :func:`~sparseffn.routers.base.selection_linear`).
    """

    type_name: ClassVar[str] = "sigma"

    gate: str = "sigmoid"
    entropy_weight: float = 0.001
    expert_dropout: float = 0.0
    precision: str = "float32"

    def __post_init__(self) -> None:
        require_choice(self, "precision", ROUTER_PRECISIONS)
        require_choice(self, "gate", SIGMA_GATES)
        require_non_negative(self, "entropy_weight")
        require_probability(self, "expert_dropout")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"entropy": self.entropy_weight}


@dataclass(frozen=True)


class SoftmaxRouterConfig(RouterConfig):
    """Softmax top-k (Csordás et al. 2023 §3.3, Table 4): ``s = softmax(W x)`` over all experts,
    then top-k; with ``renormalize`` the k kept scores are renormalised to sum to one
    (``normtopk``, App. A.1 Eq. 37-39, the same as a softmax over the k selected logits).
    Regularised with the batch entropy of Eq. 35, as Csordás et al. 2023 does for its softmax
    variants.

    precision: the selection product ``W x`` in ``"float32"`` (the default; Switch's
      "selective precision") or ``"autocast"`` (see
      :func:`~sparseffn.routers.base.selection_linear`).
    """

    type_name: ClassVar[str] = "softmax"

    renormalize: bool = False
    entropy_weight: float = 0.001
    expert_dropout: float = 0.0
    precision: str = "float32"

    def __post_init__(self) -> None:
        require_choice(self, "precision", ROUTER_PRECISIONS)
        require_bool(self, "renormalize")
        require_non_negative(self, "entropy_weight")
        require_probability(self, "expert_dropout")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"entropy": self.entropy_weight}


def select_topk(logits: torch.Tensor, k: int, gate: str, expert_dropout: float, training: bool
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of ``act(logits)`` with expert dropout; returns (indices [T, k], weights [T, k]).

    - ``gate="sigmoid"``: weights ``σ(logit)`` (Csordás et al. 2023 Eq. 25 with σ-MoE's sel);
    - ``gate="softmax"``: weights ``softmax(logits)`` over all experts, gathered, not
      renormalised (Table 4 "softmax (before top-k)");
    - ``gate="softmax_renorm"``: ``normtopk(softmax(logits))`` (App. A.1 Eq. 37-39), i.e. a
      softmax over the k selected logits; they sum to one;
    - ``gate="hard"``: weights exactly 1 (MoEfication, Zhang et al. 2022, arXiv:2110.01786:
      a selected expert's hidden units act as in the dense MLP they came from); the gradient
      that reaches them goes to ``σ(logit)`` (straight through), so fine-tuning still trains
      the selection.

    A dropped (token, expert) pair (Eq. 36) is never selected while k experts remain; if fewer
    than k survive, the extra slots get weight 0.
    """
    selection_logits, dropped = drop_experts(logits, expert_dropout, training)
    # Sigmoid and softmax are monotonic, so the top-k of the logits is the top-k of s.
    indices = torch.topk(selection_logits.detach(), k, dim=-1, sorted=False).indices
    kept = None if dropped is None else ~dropped.gather(1, indices)          # [T, k]
    chosen_logits = selected_scores(logits, indices)
    if gate == "sigmoid":
        weights = torch.sigmoid(chosen_logits)
    elif gate == "hard":   # s - sg(s) is exactly 0, so the weights are exactly 1
        scores = torch.sigmoid(chosen_logits)
        weights = 1.0 + (scores - scores.detach())
    elif gate == "softmax":
        weights = selected_scores(torch.softmax(logits, dim=-1), indices)
    else:  # softmax_renorm: softmax over the selected (and kept) logits
        shifted = (chosen_logits - chosen_logits.detach().amax(-1, keepdim=True)).exp()
        if kept is not None:
            shifted = shifted * kept
        weights = shifted / shifted.sum(-1, keepdim=True).clamp_min(1e-30)
    if kept is not None:
        weights = weights * kept   # only bites when fewer than k experts survive dropout
    return indices, weights


@implements(SigmaRouterConfig)
class SigmaRouter(LinearRouter):
    """Scores ``s = act(W_s x)`` and keeps the top-k experts per token (see
    :func:`select_topk`); the batch-entropy regulariser (Eq. 34-35) is
    ``aux_losses["entropy"]``. Scores are float32 whatever the input dtype.

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, k], weights [tokens, k])
    """

    @property
    def gate(self) -> str:
        return self.config.gate

    def forward(self, x: torch.Tensor) -> Routing:
        logits = self.logits(x)                                                 # [T, E]
        indices, weights = select_topk(logits, self.k, self.gate, self.config.expert_dropout,
                                       self.training)
        aux = {"entropy": batch_entropy_loss(logits, self.global_batch)} \
            if self.computes_aux_losses else {}
        return Routing(indices=indices, weights=weights, aux_losses=aux)


@implements(SoftmaxRouterConfig)
class SoftmaxRouter(SigmaRouter):
    """Softmax top-k (Csordás et al. 2023 §3.3): ``softmax(W x)``, top-k, renormalised over the k
    or not.
    Regularised like σ-MoE with the batch entropy (Eq. 35)."""

    @property
    def gate(self) -> str:
        return "softmax_renorm" if self.config.renormalize else "softmax"
