"""Auxiliary losses for routers. Each takes router logits or probabilities and returns a
scalar; the layers record them unweighted and :func:`sparseffn.aux_loss` applies weights."""

from __future__ import annotations

import math

import torch


def batch_entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """σ-MoE's regulariser (seed 001 Eq. 34-35): the *negative* entropy of the selection
    distribution averaged over the batch.

        p = (1/|B|) Σ_x softmax(W_s x)        (Eq. 34)
        L = Σ_e p[e] log p[e]                 (Eq. 35)

    Minimising L maximises the entropy of p, i.e. spreads usage over experts.
    logits: [tokens, num_experts]. Computed in log space (log of the mean of softmaxes)
    for stability; an empty batch gives 0.
    """
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    log_mean = torch.logsumexp(log_probs, dim=0) - math.log(logits.shape[0])  # log p, [E]
    return (log_mean.exp() * log_mean).sum()
