"""σ-MoE expert selection (seed 001 §5) and its softmax ablations (Table 4)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import SigmaMoEConfig
from ..init import dense_init_std, equal_norm_rows_
from ..losses import batch_entropy_loss
from ..routing import Routing


class SigmaRouter(nn.Module):
    """Scores ``s = act(W_s x)`` and keeps the top-k experts per token.

    - ``gate="sigmoid"``: σ-MoE, ``s = σ(W_s x)``; no competition between experts.
    - ``gate="softmax"``: ``s = softmax(W_s x)`` over all experts, then top-k, no renormalisation
      (Table 4 "softmax (before top-k)").
    - ``gate="softmax_renorm"``: ``normtopk(softmax(W_s x))`` (App. A.1 Eq. 37-39), i.e. a
      softmax over the k selected logits (Table 4 "softmax (after top-k)").

    Expert dropout (Eq. 36): during training each (token, expert) pair is dropped with
    probability δ. A dropped expert is never selected for that token (while k experts
    remain), and the kept experts' scores are *not* rescaled. Scores are computed in float32
    whatever the input dtype. The batch-entropy regulariser (Eq. 34-35) is returned as
    ``aux_losses["entropy"]``.

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, k], weights [tokens, k])
    """

    def __init__(self, config: SigmaMoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.d_model))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        std = dense_init_std(self.config.d_model, self.config.n_layers)
        if self.config.init == "sigma_moe":
            equal_norm_rows_(self.weight, std)
        else:
            self.weight.normal_(0.0, std)

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.config
        with torch.autocast(device_type=x.device.type, enabled=False):
            logits = nn.functional.linear(x.float(), self.weight.float())   # [T, E]
        selection_logits = logits
        dropped = None
        if self.training and cfg.expert_dropout > 0:
            dropped = torch.rand_like(logits) < cfg.expert_dropout             # m = 0 (Eq. 36)
            selection_logits = logits.masked_fill(dropped, float("-inf"))
        # Sigmoid and softmax are monotonic, so the top-k of the logits is the top-k of s.
        indices = torch.topk(selection_logits.detach(), cfg.k, dim=-1, sorted=False).indices
        kept = None if dropped is None else ~dropped.gather(1, indices)       # [T, k]
        chosen_logits = logits.gather(1, indices)
        if cfg.gate == "sigmoid":
            weights = torch.sigmoid(chosen_logits)
        elif cfg.gate == "softmax":
            weights = torch.softmax(logits, dim=-1).gather(1, indices)
        else:  # softmax_renorm: softmax over the selected (and kept) logits
            shifted = (chosen_logits - chosen_logits.detach().amax(-1, keepdim=True)).exp()
            if kept is not None:
                shifted = shifted * kept
            weights = shifted / shifted.sum(-1, keepdim=True).clamp_min(1e-30)
        if kept is not None:
            weights = weights * kept   # only bites when fewer than k experts survive dropout
        return Routing(indices=indices, weights=weights,
                       aux_losses={"entropy": batch_entropy_loss(logits)})
