"""Triton kernels for S-BASE's balanced assignment on GPUs (``sparseffn::sinkhorn_topk``).

S-BASE (Clark et al. 2022; Csordás et al. 2023, arXiv:2310.10837 §4) assigns a training
batch's tokens to experts by the top-k of each token's row of the Sinkhorn plan
``P = diag(u) exp(L) diag(v)`` (Sinkhorn 1964), whose rows sum to 1 and whose columns approach
``T / E``. The PyTorch form (:func:`~sparseffn.ops.assignment.sinkhorn_log_plan`) rewrites the
[T, E] log plan twice per iteration; on a GPU each half-iteration is a reduction over the
other axis, a few kernels each, so 8 iterations cost tens of launches per layer.

Here the plan is kept as its log-potentials, ``log P[t, e] = L[t, e] + a[t] + b[e]``:

- a row step is ``a[t] = -logsumexp_e(L[t, e] + b[e])``, local to a token;
- a column step is ``b[e] = log(T / E) - logsumexp_t(L[t, e] + a[t])``, a reduction over the
  whole batch.

So one iteration is one pass over L: a program takes a range of tokens, computes each one's
``a[t]`` from b, and writes its running column (max, Σ exp) of ``L + a``; the next launch
combines those partials into the next b (every program does it: they are at most
``MAX_PROGRAMS`` × E numbers). The first pass starts from ``a = 0``, as the PyTorch form's
first column step does. The assignment needs only b: ``a[t]`` is constant along a token's
row, so the row's top-k of ``L + a + b`` is that of ``L + b``. The last launch combines the
partials and takes each token's top-k there, by (value desc, expert asc) with the int64 keys
of :mod:`~sparseffn.ops.triton_rows`. In all: ``iterations + 1`` launches, each reading L once
(fp32 arithmetic whatever L's dtype), no [T, E] plan written, no host read.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (see
:mod:`~sparseffn.ops.triton_cvmm`).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from . import triton_cvmm
from .triton_cvmm import _rowwise, cdiv, next_power_of_2, tl, triton
from .written import written_in_full

# Elements of a [BLOCK_T, BLOCK_E] block of logits in registers; more experts than this take
# the PyTorch path.
_BLOCK_ELEMENTS = 4096
MAX_EXPERTS = _BLOCK_ELEMENTS
# Programs per pass: each writes E partials, which every program of the next pass combines.
MAX_PROGRAMS = 128
# Non-finite logits are clamped to ±BOUND (NaN to -BOUND), and their rows shifted to a maximum
# of 0, as the PyTorch form does: a power of two far below float32's maximum, so sums of a few
# such terms stay finite.
BOUND = 2.0 ** 120


def check_arguments(num_experts: int, iterations: int, k: int) -> None:
    """ValueError unless k distinct experts of ``num_experts`` can be chosen after at least
    one iteration (the checks of every ``sinkhorn_topk`` path)."""
    if k > num_experts:     # (the kernel would read a padding column's index for the rest)
        raise ValueError(f"cannot choose k={k} distinct experts of {num_experts}")
    if iterations < 1:
        raise ValueError(f"sinkhorn_topk needs at least one iteration, got {iterations}")


def usable(logits: Optional[Tensor]) -> bool:
    """True when the kernels take these logits [T, E] (Triton present and enabled; a CUDA
    tensor, or a CPU tensor under the interpreter; fp32, fp16 or bf16; E <= MAX_EXPERTS)."""
    return (logits is not None and logits.dim() == 2 and logits.shape[1] <= MAX_EXPERTS
            and triton_cvmm.usable(0, logits))


if triton is not None:
    # (value desc, index asc) as one int64 key, as the product-key top-k orders its keys
    from .triton_rows import NO_KEY, _key_index, _score_key

    @triton.jit
    def _row_shifted(x, col_ok, BOUND: tl.constexpr):
        """Logits [BLOCK_T, BLOCK_E] as the PyTorch form takes them: in fp32, NaN and -inf as
        -BOUND, +inf as BOUND, and a row holding any of those less its maximum; -inf in the
        padding columns."""
        x = x.to(tl.float32)
        x = tl.where(x != x, -BOUND, x)
        x = tl.where(col_ok[None, :], tl.minimum(tl.maximum(x, -BOUND), BOUND), float("-inf"))
        at_bound = tl.max((tl.abs(x) == BOUND).to(tl.int32), 1) > 0
        return x - tl.where(at_bound, tl.max(x, 1), 0.0)[:, None]

    @triton.jit
    def _merge_columns(top, total, m, s):
        """A running column (max, Σ exp) [BLOCK_E] with a block's terms ``s · exp(m)``
        [rows, BLOCK_E] added, rescaled to the new max (a column whose terms are all -inf
        keeps max -inf and Σ 0). Returns (max, Σ exp)."""
        new_top = tl.maximum(top, tl.max(m, 0))
        shift = tl.where(new_top == float("-inf"), 0.0, new_top)
        return new_top, total * tl.exp(top - shift) + tl.sum(s * tl.exp(m - shift[None, :]), 0)

    @triton.jit
    def _column_potentials(max_ptr, sum_ptr, num_partials, column_target,
                           BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
        """b [BLOCK_E] = column_target - logsumexp over the partial (max, Σ exp) pairs
        [num_partials, BLOCK_E] of the previous pass."""
        cols = tl.arange(0, BLOCK_E)
        top = tl.full((BLOCK_E,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_E,), tl.float32)
        for start in range(0, num_partials, BLOCK_P):
            ps = start + tl.arange(0, BLOCK_P)
            at = ps[:, None] * BLOCK_E + cols[None, :]
            ok = (ps < num_partials)[:, None]
            m = tl.load(max_ptr + at, mask=ok, other=float("-inf"))
            s = tl.load(sum_ptr + at, mask=ok, other=0.0)
            top, total = _merge_columns(top, total, m, s)
        # a padding column (no tokens, Σ = 0) gets b = 0; its logits are -inf
        has = total > 0
        return tl.where(has, column_target - top - tl.log(tl.where(has, total, 1.0)), 0.0)

    @triton.jit
    def _sinkhorn_pass_kernel(logits_ptr, stride_t, max_in, sum_in, max_out, sum_out, T, E,
                              rows_per_program, num_partials, column_target,
                              FIRST: tl.constexpr, BOUND: tl.constexpr, BLOCK_T: tl.constexpr,
                              BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr):
        """One Sinkhorn iteration's column reduction over this program's tokens: the running
        column max and Σ exp of ``L + a`` (a = 0 in the FIRST pass, else each token's row
        potential under the previous pass's b), written to row ``program_id`` of the
        partials."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK_E)
        col_ok = cols < E
        if FIRST:
            b = tl.zeros((BLOCK_E,), tl.float32)
        else:
            b = _column_potentials(max_in, sum_in, num_partials, column_target, BLOCK_E,
                                   BLOCK_P)
        top = tl.full((BLOCK_E,), float("-inf"), tl.float32)
        total = tl.zeros((BLOCK_E,), tl.float32)
        start = pid * rows_per_program
        for offset in range(0, rows_per_program, BLOCK_T):
            ts = start + offset + tl.arange(0, BLOCK_T)
            ok = (ts < T)[:, None] & col_ok[None, :]
            x = tl.load(logits_ptr + ts.to(tl.int64)[:, None] * stride_t + cols[None, :],
                        mask=ok, other=0.0)
            x = _row_shifted(x, col_ok, BOUND)
            if FIRST:
                y = x
            else:    # the row step: a[t] = -logsumexp_e(L[t, e] + b[e])
                z = tl.where(col_ok[None, :], x + b[None, :], float("-inf"))
                z_max = tl.max(z, 1)
                a = -(z_max + tl.log(tl.sum(tl.exp(z - z_max[:, None]), 1)))
                y = x + a[:, None]
            y = tl.where(ok, y, float("-inf"))
            top, total = _merge_columns(top, total, y, 1.0)
        tl.store(max_out + pid * BLOCK_E + cols, top)
        tl.store(sum_out + pid * BLOCK_E + cols, total)

    @triton.jit
    def _sinkhorn_topk_kernel(logits_ptr, stride_t, max_in, sum_in, idx_ptr, T, E, k,
                              num_partials, column_target, BOUND: tl.constexpr,
                              BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                              BLOCK_P: tl.constexpr):
        """Each token's k best experts of ``L + b`` (b from the last pass's partials), best
        first, ties to the lower expert: int64 [T, k]."""
        cols = tl.arange(0, BLOCK_E)
        col_ok = cols < E
        b = _column_potentials(max_in, sum_in, num_partials, column_target, BLOCK_E, BLOCK_P)
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = ts < T
        ts64 = ts.to(tl.int64)
        x = tl.load(logits_ptr + ts64[:, None] * stride_t + cols[None, :],
                    mask=t_ok[:, None] & col_ok[None, :], other=0.0)
        plan = _row_shifted(x, col_ok, BOUND) + b[None, :]
        keys = _score_key(plan, cols[None, :] + tl.zeros((BLOCK_T, BLOCK_E), tl.int32))
        keys = tl.where(col_ok[None, :], keys, NO_KEY)
        for j in range(k):
            best = tl.max(keys, 1)
            tl.store(idx_ptr + ts64 * k + j, _key_index(best).to(tl.int64), mask=t_ok)
            keys = tl.where(keys == best[:, None], NO_KEY, keys)     # taken


def _blocks(num_experts: int) -> tuple[int, int]:
    block_e = next_power_of_2(num_experts)
    return block_e, max(1, min(256, _BLOCK_ELEMENTS // block_e))


@written_in_full()
def sinkhorn_topk(logits: Tensor, iterations: int, k: int,
                  max_programs: int = MAX_PROGRAMS) -> Tensor:
    """``sparseffn::sinkhorn_topk`` in Triton: each token's k best experts of the Sinkhorn
    plan after ``iterations`` column-then-row normalisations, best first. logits: [T, E]
    (any float dtype, computed in fp32); returns int64 [T, k]. ``max_programs`` caps the
    programs of a pass (the tests lower it to give each program several blocks of tokens)."""
    check_arguments(logits.shape[1], iterations, k)
    logits = _rowwise(logits)
    tokens, num_experts = logits.shape
    out = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    if tokens == 0 or k == 0:
        return out
    block_e, block_t = _blocks(num_experts)
    block_t = min(block_t, next_power_of_2(tokens))
    row_blocks = cdiv(tokens, block_t)
    rows_per_program = cdiv(row_blocks, min(row_blocks, max_programs)) * block_t
    programs = cdiv(tokens, rows_per_program)
    block_p = max(1, min(next_power_of_2(programs), _BLOCK_ELEMENTS // block_e))
    # partials[i % 2] = (column max, column Σ exp) [programs, BLOCK_E] of pass i
    partials = torch.empty(2, 2, programs, block_e, dtype=torch.float32, device=logits.device)
    column_target = math.log(tokens / num_experts)
    for i in range(iterations):
        read, write = partials[(i + 1) % 2], partials[i % 2]
        _sinkhorn_pass_kernel[(programs,)](
            logits, logits.stride(0), read[0], read[1], write[0], write[1], tokens,
            num_experts, rows_per_program, programs, column_target, FIRST=i == 0, BOUND=BOUND,
            BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_P=block_p)
    last = partials[(iterations - 1) % 2]
    _sinkhorn_topk_kernel[(cdiv(tokens, block_t),)](
        logits, logits.stride(0), last[0], last[1], out, tokens, num_experts, k, programs,
        column_target, BOUND=BOUND, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_P=block_p)
    return out
