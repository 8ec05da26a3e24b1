"""Auxiliary losses for routers. Each takes router logits or probabilities and returns a
scalar; the layers record them unweighted and :func:`sparseffn.aux_loss` applies weights."""

from __future__ import annotations

import math

import torch

from .ops.assignment import count_keys


def batch_entropy_loss(logits: torch.Tensor) -> torch.Tensor:
    """σ-MoE's regulariser (Csordás et al. 2023 Eq. 34-35): the *negative* entropy of the selection
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


def cv_squared(values: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """The squared coefficient of variation ``(std / mean)²`` of a vector (population
    variance), Shazeer et al.'s balance measure (Csordás et al. 2023 Eq. 28; Csordás et al. 2023
    writes CV as μ/σ,
    a typo for σ/μ). Zero for fewer than two values."""
    values = values.float()
    if values.numel() < 2:
        return values.new_zeros(())
    return values.var(unbiased=False) / (values.mean().square() + eps)


def switch_balance_loss(probs: torch.Tensor, top1: torch.Tensor) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Csordás et al. 2023 Eq. 29-31): ``N_E · f · p``.

    probs: [T, E] router probabilities ``softmax(W x)``; top1: int64 [T] the chosen expert
    (before any capacity dropping). ``f_i`` is the fraction of tokens choosing expert i
    (Eq. 29, no gradient), ``p_i`` the mean probability (Eq. 30). Equals 1 at perfect balance.
    """
    num_experts = probs.shape[-1]
    if probs.shape[0] == 0:
        return probs.new_zeros(())
    fraction = count_keys(top1, num_experts).float() / top1.numel()   # Eq. 29
    mean_prob = probs.float().mean(0)                                            # Eq. 30
    return num_experts * (fraction * mean_prob).sum()                            # Eq. 31


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's router z-loss ``mean_x (logsumexp_e logits[x, e])²``: keeps the logits small."""
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    return torch.logsumexp(logits.float(), dim=-1).square().mean()
