"""Balanced token-to-expert assignment for BASE / S-BASE (Csordás et al. 2023 §4, Eq. 33).

- :func:`sinkhorn_log_plan`: Sinkhorn's row/column normalisation (Sinkhorn 1964; Clark et al.
  2022), in log space;
- :func:`sinkhorn_topk`: each token's top-k of that plan (S-BASE's assignment): on CUDA the
  operator ``sparseffn::sinkhorn_topk`` (:mod:`~sparseffn.ops.triton_sinkhorn`, one kernel
  per iteration), elsewhere PyTorch ops that ``torch.compile`` fuses;
- :func:`capacity_rounding`: a balanced plan's scores turned into k experts per token with no
  expert over capacity;
- :func:`exact_balanced_assignment`: the linear assignment of Eq. 33 itself, extended to k
  distinct experts per token (a transportation problem; its constraint matrix is totally
  unimodular, so the simplex solution is integral). Needs SciPy; meant for small batches.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from . import kernels, triton_plan, triton_sinkhorn
from .sizes import exporting
from .cvmm import search_sorted, stable_sort_ids


def count_keys(keys: torch.Tensor, num_keys: int) -> torch.Tensor:
    """``bincount(keys, minlength=num_keys)`` for keys known to lie in ``[0, num_keys)``:
    int64 [num_keys], with a shape that does not depend on the data (no host read, no graph
    break under ``torch.compile``)."""
    counts = torch.zeros(num_keys, dtype=torch.int64, device=keys.device)
    return counts.scatter_add_(0, keys.reshape(-1), torch.ones_like(keys.reshape(-1)))


def positions_in_expert(experts: torch.Tensor, num_experts: int,
                        groups: torch.Tensor | None = None, num_groups: int | None = None
                        ) -> torch.Tensor:
    """The buffer position of each pair at its expert: how many earlier pairs (in the given
    order) of the same group chose the same expert.

    experts: int64 [P]; groups: optional int64 [P] group ids in [0, num_groups) (None: one
    group; num_groups None: at most P groups). Returns int64 [P]. One stable sort and a binary
    search (O(P log P)), no [P, E] one-hot, no scatter-add (no atomics on a GPU), nothing read
    on the host. One group on CUDA with Triton (at most ``triton_plan.MAX_EXPERTS``
    experts): the operator ``sparseffn::expert_positions``, the counting sort's two launches
    (:mod:`~sparseffn.ops.triton_plan`), the same positions.
    """
    if groups is None and not exporting() and triton_plan.usable(experts, num_experts):
        return expert_positions(experts, num_experts)
    if groups is None:
        key, bound = experts, num_experts
    else:
        key = groups * num_experts + experts
        bound = max(key.numel() if num_groups is None else num_groups, 1) * num_experts
    sorted_key, order = stable_sort_ids(key, bound)
    # where each pair's run of keys starts. Exported, where the search compares every key,
    # searched by id (experts × groups) rather than by pair: [bound, P] comparisons, not
    # [P, P]
    if exporting():
        ids = torch.arange(bound, device=key.device, dtype=sorted_key.dtype)
        first = search_sorted(sorted_key, ids).index_select(0, sorted_key.long())
    else:
        first = search_sorted(sorted_key, sorted_key)
    rank = torch.arange(key.numel(), device=key.device) - first
    return torch.empty_like(rank).scatter_(0, order, rank)


@kernels.operator("expert_positions")
def expert_positions(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The operator behind :func:`positions_in_expert` for one group: the counting sort where
    it takes the experts, else the sort and binary search (for a direct
    ``torch.ops.sparseffn.expert_positions`` call)."""
    if triton_plan.usable(experts, num_experts):
        return triton_plan.positions_in_expert(experts, num_experts)
    return positions_in_expert(experts, num_experts)     # (takes the sort: no recursion)


@expert_positions.register_fake
def _(experts, num_experts):
    return experts.new_empty(experts.shape[0], dtype=torch.int64)


def sinkhorn_log_plan(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """The log of the transport plan ``P = diag(u) exp(logits) diag(v)`` whose rows sum to 1
    (one unit per token) and whose columns approach ``T / E`` (an equal share per expert).

    logits: [T, E]; returns float32 [T, E] (rows exactly normalised, columns to within the
    Sinkhorn iteration's convergence). No gradient flows through it.

    A non-finite logit (from a non-finite input) is clamped first, NaN and -inf to ``-BOUND``,
    +inf to ``BOUND`` (``triton_sinkhorn.BOUND``, 2^120), and its token's row is shifted to a
    maximum of 0 (where rounding would otherwise lose the column step at that scale). So an
    all-NaN token ranks every expert alike, and the other tokens' plan stays finite, where
    one NaN would turn every entry NaN. Finite logits are taken as they are."""
    tokens, num_experts = logits.shape
    bound = triton_sinkhorn.BOUND
    log_plan = logits.detach().float().nan_to_num(nan=-bound).clamp(-bound, bound)
    if tokens == 0 or num_experts == 0:
        return log_plan
    at_bound = (log_plan.abs() == bound).any(1, keepdim=True)
    log_plan = log_plan - torch.where(at_bound, log_plan.amax(1, keepdim=True), 0.0)
    # log(T / E), as a tensor: under torch.compile(dynamic=True) math.log of the symbolic
    # token count would fix the count (a recompile for every batch size). Float32 is enough:
    # the row step that follows removes any constant added to every entry.
    column_target = log_plan.new_full((), tokens).log() - math.log(num_experts)
    for _ in range(iterations):
        log_plan = log_plan - torch.logsumexp(log_plan, dim=0, keepdim=True) + column_target
        log_plan = log_plan - torch.logsumexp(log_plan, dim=1, keepdim=True)
    return log_plan


def sinkhorn_topk(logits: torch.Tensor, iterations: int, k: int) -> torch.Tensor:
    """Each token's k largest entries of :func:`sinkhorn_log_plan` ``(logits, iterations)``,
    best first: S-BASE's training assignment (Clark et al. 2022). logits: [T, E]; returns
    int64 [T, k]. No gradient flows through it.

    On a CUDA tensor with Triton, the operator ``sparseffn::sinkhorn_topk``: ``iterations + 1``
    kernels on the plan's log-potentials, which never write the [T, E] plan (its entries may
    differ from this form's by float32 rounding, so near-ties may fall the other way).
    Elsewhere, the PyTorch ops of :func:`sinkhorn_log_plan` and a top-k, which
    ``torch.compile`` traces and fuses."""
    logits = logits.detach()
    if triton_sinkhorn.usable(logits):
        return _sinkhorn_topk_op(logits, iterations, k)
    return _sinkhorn_topk_torch(logits, iterations, k)


def _sinkhorn_topk_torch(logits: torch.Tensor, iterations: int, k: int) -> torch.Tensor:
    triton_sinkhorn.check_arguments(logits.shape[1], iterations, k)
    return torch.topk(sinkhorn_log_plan(logits, iterations), k, dim=1).indices


@kernels.operator("sinkhorn_topk")
def _sinkhorn_topk_op(logits: torch.Tensor, iterations: int, k: int) -> torch.Tensor:
    """The operator behind :func:`sinkhorn_topk`: the Triton kernels where they take the
    logits, else the PyTorch form (for a direct ``torch.ops.sparseffn.sinkhorn_topk`` call)."""
    if triton_sinkhorn.usable(logits):
        return triton_sinkhorn.sinkhorn_topk(logits, iterations, k)
    return _sinkhorn_topk_torch(logits, iterations, k)


@_sinkhorn_topk_op.register_fake
def _(logits, iterations, k):
    return logits.new_empty(logits.shape[0], k, dtype=torch.int64)


def _assignment_operator(name: str):
    """Decorator: an assignment ``fn(scores [T, E], k, capacity | None) -> int64 [T, k]`` run
    as the operator ``sparseffn::<name>``. Its loop or solver cannot be traced, so under
    ``torch.compile`` it is one opaque node; no gradient flows through an assignment."""
    def wrap(fn):
        @kernels.operator(name)
        def op(scores: torch.Tensor, k: int, capacity: int) -> torch.Tensor:
            return fn(scores, k, None if capacity < 0 else capacity)

        @op.register_fake
        def _(scores, k, capacity):
            return scores.new_empty(scores.shape[0], k, dtype=torch.int64)

        @functools.wraps(fn)
        def call(scores: torch.Tensor, k: int, capacity: int | None = None) -> torch.Tensor:
            return op(scores.detach(), k, -1 if capacity is None else capacity)
        return call
    return wrap


def balanced_capacity(tokens: int, k: int, num_experts: int) -> int:
    """Pairs per expert in a balanced assignment: ``ceil(tokens · k / num_experts)``."""
    return math.ceil(tokens * k / num_experts)


@_assignment_operator("capacity_rounding")
def capacity_rounding(scores: torch.Tensor, k: int, capacity: int | None = None
                      ) -> torch.Tensor:
    """k distinct experts per token, each expert taking at most ``capacity`` (default
    ``ceil(T·k/E)``) pairs, by deferred acceptance: every token short of k experts proposes to
    its best experts that have not turned it down; each expert keeps the highest-scoring
    ``capacity`` of the tokens it holds and the new proposers, and turns the rest down; repeat
    until nobody is turned down. A token that every expert with room has turned down (which
    takes an adversarial plan) is given its best remaining expert over capacity.

    scores: [T, E] (e.g. a Sinkhorn log plan); returns int64 [T, k], best first."""
    tokens, num_experts = scores.shape
    if k > num_experts:
        raise ValueError(f"cannot choose k={k} distinct experts of {num_experts}")
    capacity = balanced_capacity(tokens, k, num_experts) if capacity is None else capacity
    scores = scores.detach().float()
    if tokens == 0 or k == 0:
        return torch.zeros(tokens, k, dtype=torch.long, device=scores.device)
    held = torch.zeros(tokens, num_experts, dtype=torch.bool, device=scores.device)
    refused = torch.zeros_like(held)
    slot = torch.arange(k, device=scores.device)
    keep_count = min(capacity, tokens)
    while True:
        need = k - held.sum(1)                                                     # [T]
        open_scores = scores.masked_fill(held | refused, float("-inf"))
        best = torch.topk(open_scores, k, dim=1)
        propose = (slot < need.unsqueeze(1)) & ~torch.isinf(best.values)          # [T, k]
        if not bool(propose.any()):
            break
        candidates = held.clone()
        rows = torch.arange(tokens, device=scores.device).unsqueeze(1).expand(-1, k)
        candidates[rows[propose], best.indices[propose]] = True
        ranked = torch.topk(scores.masked_fill(~candidates, float("-inf")), keep_count, dim=0)
        kept = torch.zeros_like(held)
        kept.scatter_(0, ranked.indices, ~torch.isinf(ranked.values))
        kept &= candidates
        refused |= candidates & ~kept
        held = kept
    short = k - held.sum(1)
    for t in torch.nonzero(short > 0).flatten().tolist():   # over capacity, rare
        extra = torch.topk(scores[t].masked_fill(held[t], float("-inf")), int(short[t])).indices
        held[t, extra] = True
    ordered = scores.masked_fill(~held, float("-inf"))
    return torch.topk(ordered, k, dim=1).indices


@_assignment_operator("exact_balanced_assignment")
def exact_balanced_assignment(scores: torch.Tensor, k: int, capacity: int | None = None
                              ) -> torch.Tensor:
    """Maximise ``Σ_x Σ_{e ∈ E_x} scores[x, e]`` over sets E_x of k distinct experts per token,
    with every expert in at most ``capacity`` sets (default: the balanced
    ``ceil(T·k/E)``). Csordás et al. 2023 Eq. 33 for k = 1.

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
    from scipy.sparse import csr_matrix
    values = scores.detach().double().cpu().numpy()
    # A NaN or infinite score (a non-finite input) still gets an assignment: NaN and -inf rank
    # below every finite score, +inf above; the router's gate carries the NaN to that token.
    finite = values[np.isfinite(values)]
    low, high = (finite.min(), finite.max()) if finite.size else (0.0, 0.0)
    values = np.nan_to_num(values, nan=low - 1.0, neginf=low - 1.0, posinf=high + 1.0)
    n = tokens * num_experts                        # variable x[t, e] at t * E + e
    ones, columns = np.ones(n), np.arange(n)
    token_rows = csr_matrix((ones, (np.repeat(np.arange(tokens), num_experts), columns)),
                            shape=(tokens, n))      # Σ_e x[t, e] = k
    expert_rows = csr_matrix((ones, (np.tile(np.arange(num_experts), tokens), columns)),
                             shape=(num_experts, n))   # Σ_t x[t, e] ≤ C
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
