"""Auxiliary losses for routers. Each takes router logits or probabilities and returns a
scalar; the layers record them unweighted and :func:`sparseffn.aux_loss` applies weights.

The batch statistics in them (σ-MoE's mean selection distribution, Switch's f and p) are over
the tokens of this call, or, given ``batch`` (a :class:`BatchSum`), over the global batch of
all processes: ``batch.sum(local_sums)`` adds the processes' sums, differentiably, so every
process computes the loss of the global batch (what expert parallelism uses:
:func:`sparseffn.distributed.shard_experts`). Every process must then call it, even one with
no tokens.

The losses are computed in float32 whatever the input's dtype (float64 for float64 inputs:
:func:`~sparseffn.ops.precision.routing_dtype`), as the routing they are computed from is.
"""

from __future__ import annotations

import torch

from .ops.assignment import count_keys
from .ops.precision import routing_dtype


class BatchSum:
    """How a loss adds per-batch sums over the global batch: ``sum(t)`` returns the sum of
    ``t`` over all processes (differentiable). The identity here (one process)."""

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return values


def _full(t: torch.Tensor) -> torch.Tensor:
    """``t`` in float32, or in float64 when it is float64 (:func:`routing_dtype`)."""
    return t.to(routing_dtype(t.dtype))


def _global_mean(local_sums: torch.Tensor, tokens: int, batch: BatchSum) -> torch.Tensor:
    """Σ over every process's tokens / their number, for ``local_sums`` [n] over this
    process's ``tokens``; zeros when no process has a token."""
    local_sums = _full(local_sums)
    total = batch.sum(torch.cat([local_sums, local_sums.new_full((1,), tokens)]))
    return total[:-1] / total[-1].clamp_min(1.0)


def batch_entropy_loss(logits: torch.Tensor, batch: BatchSum | None = None) -> torch.Tensor:
    """σ-MoE's regulariser (Csordás et al. 2023 Eq. 34-35): the *negative* entropy of the selection
    distribution averaged over the batch.

        p = (1/|B|) Σ_x softmax(W_s x)        (Eq. 34)
        L = Σ_e p[e] log p[e]                 (Eq. 35)

    Minimising L maximises the entropy of p, i.e. spreads usage over experts.
    logits: [tokens, num_experts], any magnitude (the softmax subtracts each row's maximum).
    ``p log p`` is taken as 0 where p underflows (below 1.2e-38), with a finite gradient; an
    empty batch gives 0. With ``batch``, p is the mean over the global batch.

    Four operators (softmax, mean, clamped log, dot): the same value to float32 rounding as
    log space (log-softmax, logsumexp over tokens, exp), at half the time or less, on every
    forward of every σ-MoE layer (15 → 8 µs at 1 token, 234 → 91 µs at 4,096, 2 CPU cores).
    """
    return usage_entropy_loss(torch.softmax(_full(logits), dim=-1), batch)      # Eq. 34


def usage_entropy_loss(probs: torch.Tensor, batch: BatchSum | None = None) -> torch.Tensor:
    """Eq. 35 of Csordás et al. 2023 for any per-token distribution over experts: ``Σ_e p[e]
    log p[e]`` with ``p`` the batch mean of ``probs`` [tokens, num_experts] (rows summing to
    one; e.g. a fast feed-forward tree's leaf distribution R). The negative entropy of the
    batch's usage: minimising it spreads the mass over the experts. ``p log p`` is 0 where p
    underflows, with a finite gradient; an empty batch gives 0; with ``batch``, p is the mean
    over the global batch. Returns a float32 scalar (float64 for float64 ``probs``)."""
    if batch is not None:
        p = _global_mean(_full(probs).sum(0), probs.shape[0], batch)
    elif probs.shape[0] == 0:
        return probs.new_zeros((), dtype=routing_dtype(probs.dtype))
    else:
        p = _full(probs).mean(0)
    return torch.dot(p, p.clamp_min(torch.finfo(p.dtype).tiny).log())


def cv_squared(values: torch.Tensor, eps: float = 1e-10) -> torch.Tensor:
    """The squared coefficient of variation ``(std / mean)²`` (population variance) of each
    row, Shazeer et al.'s balance measure (Csordás et al. 2023 Eq. 28, which writes CV as μ/σ,
    a typo for σ/μ). values: [..., n]; returns float32 (float64 for float64 values) [...] (a
    scalar for a vector), zero for rows of fewer than two values."""
    values = _full(values)
    if values.dim() == 0 or values.shape[-1] < 2:
        return values.new_zeros(values.shape[:-1])
    return values.var(-1, unbiased=False) / (values.mean(-1).square() + eps)


def switch_balance_loss(probs: torch.Tensor, top1: torch.Tensor, batch: BatchSum | None = None
                        ) -> torch.Tensor:
    """Switch Transformer's load-balancing loss (Csordás et al. 2023 Eq. 29-31): ``N_E · f · p``.

    probs: [T, E] router probabilities ``softmax(W x)``; top1: int64 [T] the chosen expert
    (before any capacity dropping). ``f_i`` is the fraction of tokens choosing expert i
    (Eq. 29, no gradient), ``p_i`` the mean probability (Eq. 30). Equals 1 at perfect balance.
    With ``batch``, f and p are over the global batch.
    """
    num_experts = probs.shape[-1]
    if batch is not None:
        probs = _full(probs)
        counts = count_keys(top1, num_experts).to(probs.dtype)
        mean = _global_mean(torch.cat([counts, probs.sum(0)]), probs.shape[0], batch)
        return num_experts * (mean[:num_experts] * mean[num_experts:]).sum()
    if probs.shape[0] == 0:
        return probs.new_zeros(())
    mean_prob = _full(probs).mean(0)                                             # Eq. 30
    # Eq. 31 with Eq. 29's fractions f_i = |{t : top1_t = i}| / T folded in:
    # Σ_i f_i p_i = (1/T) Σ_t p_{top1_t}, a gather instead of counting the tokens per expert.
    return num_experts * mean_prob[top1.reshape(-1)].mean()


def router_z_loss(logits: torch.Tensor, batch: BatchSum | None = None) -> torch.Tensor:
    """ST-MoE's router z-loss ``mean_x (logsumexp_e logits[x, e])²``: keeps the logits small
    (the mean over the global batch with ``batch``)."""
    if batch is not None:
        squares = torch.logsumexp(_full(logits), dim=-1).square().sum()
        return _global_mean(squares.reshape(1), logits.shape[0], batch)[0]
    if logits.shape[0] == 0:
        return logits.new_zeros(())
    return torch.logsumexp(_full(logits), dim=-1).square().mean()
