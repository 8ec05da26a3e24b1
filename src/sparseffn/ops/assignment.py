"""Balanced token-to-expert assignment for BASE / S-BASE (seed 001 §4, Eq. 33).

- :func:`sinkhorn_log_plan`: Sinkhorn's row/column normalisation (Sinkhorn 1964; Clark et al.
  2022), in log space;
- :func:`exact_balanced_assignment`: the linear assignment of Eq. 33 itself, extended to k
  distinct experts per token (a transportation problem; its constraint matrix is totally
  unimodular, so the simplex solution is integral). Needs SciPy; meant for small batches.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def sinkhorn_log_plan(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """The log of the transport plan ``P = diag(u) exp(logits) diag(v)`` whose rows sum to 1
    (one unit per token) and whose columns approach ``T / E`` (an equal share per expert).

    logits: [T, E]; returns float32 [T, E] (rows exactly normalised, columns to within the
    Sinkhorn iteration's convergence). No gradient flows through it."""
    tokens, num_experts = logits.shape
    log_plan = logits.detach().float()
    if tokens == 0:
        return log_plan
    column_target = math.log(tokens / num_experts)
    for _ in range(iterations):
        log_plan = log_plan - torch.logsumexp(log_plan, dim=0, keepdim=True) + column_target
        log_plan = log_plan - torch.logsumexp(log_plan, dim=1, keepdim=True)
    return log_plan


def balanced_capacity(tokens: int, k: int, num_experts: int) -> int:
    """Pairs per expert in a balanced assignment: ``ceil(tokens · k / num_experts)``."""
    return math.ceil(tokens * k / num_experts)


def exact_balanced_assignment(scores: torch.Tensor, k: int, capacity: int | None = None
                              ) -> torch.Tensor:
    """Maximise ``Σ_x Σ_{e ∈ E_x} scores[x, e]`` over sets E_x of k distinct experts per token,
    with every expert in at most ``capacity`` sets (default: the balanced
    ``ceil(T·k/E)``). Seed 001 Eq. 33 for k = 1.

    scores: [T, E]; returns int64 [T, k] expert ids (ascending per token)."""
    try:
        from scipy.optimize import linprog
    except ImportError:   # pragma: no cover - depends on the environment
        raise ImportError("the exact balanced assignment needs SciPy: pip install scipy "
                          "(or install sparseffn[assign])") from None
    tokens, num_experts = scores.shape
    if tokens == 0:
        return torch.zeros(0, k, dtype=torch.long, device=scores.device)
    capacity = balanced_capacity(tokens, k, num_experts) if capacity is None else capacity
    if capacity * num_experts < tokens * k or k > num_experts:
        raise ValueError(f"no assignment of {k} distinct experts to each of {tokens} tokens "
                         f"fits {num_experts} experts of capacity {capacity}")
    values = scores.detach().double().cpu().numpy()
    n = tokens * num_experts                        # variable x[t, e] at t * E + e
    rows = np.repeat(np.arange(tokens), num_experts)
    token_rows = np.zeros((tokens, n))
    token_rows[rows, np.arange(n)] = 1.0            # Σ_e x[t, e] = k
    expert_rows = np.zeros((num_experts, n))
    expert_rows[np.tile(np.arange(num_experts), tokens), np.arange(n)] = 1.0   # Σ_t x ≤ C
    result = linprog(-values.reshape(-1), A_ub=expert_rows, b_ub=np.full(num_experts, capacity),
                     A_eq=token_rows, b_eq=np.full(tokens, k), bounds=(0.0, 1.0),
                     method="highs-ds")
    if result.status != 0:   # pragma: no cover - the problem is feasible by construction
        raise RuntimeError(f"balanced assignment failed: {result.message}")
    chosen = result.x.reshape(tokens, num_experts) > 0.5
    if not np.allclose(result.x, np.round(result.x), atol=1e-6):   # pragma: no cover
        raise RuntimeError("balanced assignment: the simplex returned a fractional vertex")
    indices = np.nonzero(chosen)[1].reshape(tokens, k)
    return torch.from_numpy(indices).to(device=scores.device, dtype=torch.long)
