"""Triton kernels for the gathered-row operators and the product-key top-k on GPUs
(``sparseffn::gather_dot``, ``gather_sum``, ``scatter_rows``, ``scatter_rows_dot``,
``product_key_topk``).

These are the arithmetic of the product-key memory (Lample et al. 2019; Csordás et al. 2023,
arXiv:2310.10837 §3.2, Eq. 14-15) and of PEER (He 2024, arXiv:2407.04153 §3.2), whose experts
are single rows of a table:

- ``gather_sum``: a weighted embedding bag. One program computes a [BLOCK_T, BLOCK_D] tile of
  the output, reading each of its tokens' m table rows in place (never a ``[T, m, d]`` copy)
  and accumulating in fp32.
- ``gather_dot``: one program computes the [BLOCK_T, BLOCK_M] dot products of a block of
  tokens with their gathered rows, walking d in BLOCK_D chunks.
- ``scatter_rows`` (the table gradient): a *sorted reverse index*. The T·m pairs are sorted
  by table row (a stable sort: within a row, pairs stay in (t, j) order) and each row's
  segment is found by a binary search of the sorted rows, all on the device; then one program
  per (row, column block) sums its row's pairs in that fixed order. No atomics: the result is
  the same on every run, and every output row is written (zeros where no pair lands).
- ``scatter_rows_dot``: the same kernel with the whole row in one program, which also writes
  each pair's dot with the row's table row (``gather_dot(src, table, idx)``) from the src row
  it loaded for the sum: both gradients of ``gather_sum`` from one read of each pair's row.
- ``dense_rows``: the pairs of each token as one dense row (``out[t, i] = Σ_{j: idx[t,j]=i}
  w[t, j]``), summed in slot order; for small tables (product sub-keys) the gradients are then
  two GEMMs with it.
- ``product_key_topk``: one program takes BLOCK_R rows. A (score, index) pair is one int64
  key whose integer order is (score desc, index asc), so selecting is sorting integers: each
  half's best K (k to a power of two) come from a bitonic top-k network. The candidate sums
  fl(s_a[i] + s_b[j]) of the i-th and j-th best form a grid that falls along its rows and
  columns (rounding is monotone), so cell (i, j) is beaten or tied by (i+1)(j+1) - 1 others
  and can be among the top k only if (i+1)(j+1) <= k, or by tying the k-th sum. The kernel
  keys (log2 K + 1)·K cells that cover those (row 0, then rows [2^a, 2^(a+1)) by columns
  [0, K/2^a)), instead of K², and takes their top k with the same network; a block of rows
  where the candidate after the k-th ties its sum (a cell left out might tie it too) selects
  over the whole K² grid instead. Either way the result is exactly that of the sort-based
  PyTorch implementation (same fp32 sums, same order). Every step is a fixed network of
  comparisons, not k rounds of reductions, each waiting for the last.

Out-of-range indices (which the operators check on the CPU and in debug mode) read as zero
rows here and land nowhere: a kernel never reads or writes outside its tensors.

Without a GPU the kernels run on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1``
set before ``triton`` is imported, see :mod:`~sparseffn.ops.triton_cvmm`), which is how the
tests check them against the PyTorch implementations.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import triton_cvmm
from .ids import id_dtype
from .triton_cvmm import _rowwise, cdiv, next_power_of_2, tl, triton
from .written import written_in_full

# The product-key top-k keeps each half's scores (next power of two of n) and the k_a·k_b
# candidates of BLOCK_R rows in registers: beyond these sizes the PyTorch implementation runs.
MAX_SUBKEYS = 4096
MAX_TOPK = 64
# Triton's own bitonic top-k (Triton 3.4 and later), whose swaps cost one comparison each
_TL_TOPK = tl is not None and hasattr(tl, "topk")


def _use_tl_topk() -> bool:
    """Whether the product-key top-k sorts with ``tl.topk``: where Triton has it and compiles
    the kernel. The interpreter runs the same network with min/max swaps instead, 5-7 times
    faster there (``tl.topk``'s swaps are a reduction it runs element by element in Python)."""
    return _TL_TOPK and not triton_cvmm.interpreting()


def usable(*tensors: Optional[Tensor]) -> bool:
    """True when these kernels take these tensors (Triton present and enabled, CUDA tensors,
    or CPU tensors under the interpreter, in fp32, fp16 or bf16)."""
    return triton_cvmm.usable(0, *tensors)


def product_key_topk_usable(scores_a: Tensor, scores_b: Tensor, k: int) -> bool:
    """The top-k kernel takes fp32 scores of at most ``MAX_SUBKEYS`` per half and k at most
    ``MAX_TOPK`` (the retrieval of :mod:`~sparseffn.ops.product_keys` scores in fp32)."""
    return (usable(scores_a, scores_b) and scores_a.dtype == scores_b.dtype == torch.float32
            and max(scores_a.shape[1], scores_b.shape[1]) <= MAX_SUBKEYS and k <= MAX_TOPK)


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(idx_ptr, w_ptr, table_ptr, out_ptr, T, m, d, num_rows,
                           stride_idx, stride_w, stride_table, stride_out,
                           BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        t_ok = ts < T
        d_ok = ds < d
        ts64 = ts.to(tl.int64)
        acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
        for j in range(0, m):
            row = tl.load(idx_ptr + ts64 * stride_idx + j, mask=t_ok, other=0).to(tl.int64)
            ok = t_ok & (row >= 0) & (row < num_rows)
            w = tl.load(w_ptr + ts64 * stride_w + j, mask=t_ok, other=0.0).to(tl.float32)
            v = tl.load(table_ptr + row[:, None] * stride_table + ds[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            acc += w[:, None] * v
        tl.store(out_ptr + ts64[:, None] * stride_out + ds[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _gather_dot_kernel(x_ptr, table_ptr, idx_ptr, out_ptr, T, m, d, num_rows,
                           stride_x, stride_table, stride_idx, stride_out,
                           BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        js = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        t_ok = ts < T
        pair_ok = t_ok[:, None] & (js < m)[None, :]
        ts64 = ts.to(tl.int64)
        rows = tl.load(idx_ptr + ts64[:, None] * stride_idx + js[None, :], mask=pair_ok,
                       other=0).to(tl.int64)                                  # [BT, BM]
        ok = pair_ok & (rows >= 0) & (rows < num_rows)
        acc = tl.zeros((BLOCK_T, BLOCK_M), dtype=tl.float32)
        for d0 in range(0, d, BLOCK_D):
            ds = d0 + tl.arange(0, BLOCK_D)
            d_ok = ds < d
            xv = tl.load(x_ptr + ts64[:, None] * stride_x + ds[None, :],
                         mask=t_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            tv = tl.load(table_ptr + rows[:, :, None] * stride_table + ds[None, None, :],
                         mask=ok[:, :, None] & d_ok[None, None, :], other=0.0).to(tl.float32)
            acc += tl.sum(tv * xv[:, None, :], axis=2)
        tl.store(out_ptr + ts64[:, None] * stride_out + js[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=pair_ok)

    @triton.jit
    def _scatter_rows_kernel(order_ptr, offsets_ptr, w_ptr, src_ptr, table_ptr, out_ptr,
                             dots_ptr, m, d, num_rows, stride_src, stride_table, stride_out,
                             arrivals_ptr, sum_ptr, SPLIT: tl.constexpr, ADD_PARTS: tl.constexpr,
                             BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, DOTS: tl.constexpr):
        """Program (row, column block, part): the sum over part ``part`` of the SPLIT equal
        pieces of the row's segment of sorted pairs; with SPLIT > 1 into out[part] (float32),
        and with ``ADD_PARTS`` added into ``sum`` by the last of the SPLIT to finish. With
        DOTS (one column block: BLOCK_D ≥ d), also ``dots[p] = <src[t], table[row]>`` for each
        pair p = t·m + j it visits, from the src row already loaded for the sum and the table
        row loaded once per program (``table_ptr`` and ``dots_ptr`` are unused without)."""
        row = tl.program_id(0)
        ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        part = tl.program_id(2)
        d_ok = ds < d
        first = tl.load(offsets_ptr + row)
        last = tl.load(offsets_ptr + row + 1)
        piece = tl.cdiv(tl.cdiv(last - first, SPLIT), BLOCK_P) * BLOCK_P
        start = first + part * piece
        end = tl.minimum(last, start + piece)
        if DOTS:
            v = tl.load(table_ptr + row.to(tl.int64) * stride_table + ds, mask=d_ok,
                        other=0.0).to(tl.float32)
        acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
        for p0 in range(start, end, BLOCK_P):
            ps = p0 + tl.arange(0, BLOCK_P)
            p_ok = ps < end
            pair = tl.load(order_ptr + ps, mask=p_ok, other=0).to(tl.int64)   # t·m + j
            w = tl.load(w_ptr + pair, mask=p_ok, other=0.0).to(tl.float32)
            t = pair // m
            s = tl.load(src_ptr + t[:, None] * stride_src + ds[None, :],
                        mask=p_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
            acc += w[:, None] * s
            if DOTS:
                tl.store(dots_ptr + pair,
                         tl.sum(s * v[None, :], 1).to(dots_ptr.dtype.element_ty), mask=p_ok)
        dest = out_ptr + (part.to(tl.int64) * num_rows + row) * stride_out + ds
        tl.store(dest, tl.sum(acc, 0).to(out_ptr.dtype.element_ty), mask=d_ok)
        if ADD_PARTS:
            triton_cvmm.add_parts_if_last(
                out_ptr, num_rows * stride_out, row.to(tl.int64) * stride_out + ds, d_ok, d_ok,
                SPLIT, arrivals_ptr + row * tl.num_programs(1) + tl.program_id(1), sum_ptr)

    @triton.jit
    def _dense_rows_kernel(idx_ptr, w_ptr, out_ptr, T, m, n, stride_idx, stride_w, stride_out,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_M: tl.constexpr):
        """Tokens [BLOCK_T] by columns [BLOCK_N] of out: each entry the sum of the weights of
        the token's pairs that name its column, added in slot order (the same sum on every
        run, and the CPU's ``scatter_add_``'s). The pairs are loaded BLOCK_M slots at a time
        as one [BLOCK_T, BLOCK_M] tile of indices and one of weights, and each slot's column
        taken out of the tiles in registers: all loads of a block are issued together, not
        two dependent loads per slot."""
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        js = tl.arange(0, BLOCK_M)
        t_ok = ts < T
        ts64 = ts.to(tl.int64)
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for first in range(0, m, BLOCK_M):
            slots = first + js
            ok = t_ok[:, None] & (slots < m)[None, :]
            rows = tl.load(idx_ptr + ts64[:, None] * stride_idx + slots[None, :], mask=ok,
                           other=-1)                                            # [BT, BM]
            ws = tl.load(w_ptr + ts64[:, None] * stride_w + slots[None, :], mask=ok,
                         other=0.0).to(tl.float32)
            for j in tl.static_range(BLOCK_M):   # slot first + j of every token
                pick = js[None, :] == j
                row = tl.max(tl.where(pick, rows, -1), 1)
                w = tl.sum(tl.where(pick, ws, 0.0), 1)
                acc += tl.where(row[:, None] == cols[None, :], w[:, None], 0.0)
        tl.store(out_ptr + ts64[:, None] * stride_out + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & (cols < n)[None, :])

    @triton.jit
    def _spread_rows_kernel(idx_ptr, w_ptr, out_ptr, T, m, n, stride_idx, stride_w, stride_out,
                            BLOCK_T: tl.constexpr, BLOCK_M: tl.constexpr):
        """Tokens [BLOCK_T]: each pair's row of out (zeros on entry) set to the sum of the
        weights of the token's pairs that name that row. Every pair of a row writes the same
        sum, so the order of the writes does not matter and nothing is read back: no atomics,
        the same result on every run."""
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        js = tl.arange(0, BLOCK_M)
        t_ok = ts < T
        pair_ok = t_ok[:, None] & (js < m)[None, :]
        ts64 = ts.to(tl.int64)
        rows = tl.load(idx_ptr + ts64[:, None] * stride_idx + js[None, :], mask=pair_ok,
                       other=-1).to(tl.int64)                                  # [BT, BM]
        w = tl.load(w_ptr + ts64[:, None] * stride_w + js[None, :], mask=pair_ok,
                    other=0.0).to(tl.float32)
        for j in range(0, m):
            row = tl.max(tl.where(js[None, :] == j, rows, -1), 1)             # [BT]
            total = tl.sum(tl.where(rows == row[:, None], w, 0.0), 1)
            ok = t_ok & (row >= 0) & (row < n)
            tl.store(out_ptr + ts64 * stride_out + row, total.to(out_ptr.dtype.element_ty),
                     mask=ok)

    @triton.jit
    def _rank_key(x, BIG: tl.constexpr):
        """Scores as finite rank keys, as ``kernels.rankable`` maps them: NaN and -inf to
        -BIG (below every finite score), +inf to BIG."""
        x = tl.where(x != x, -BIG, x)
        return tl.minimum(tl.maximum(x, -BIG), BIG)

    # Keys of the product-key top-k: int64 with the score's IEEE bits, in signed integer order,
    # in the high word and 2^31 - 1 - index in the low word, so that one integer comparison
    # (and one max or sort of plain integers) orders by (score desc, index asc). NO_KEY, the
    # int64 minimum, ranks below every key (that of a -inf score included).
    NO_KEY = tl.constexpr(-(1 << 63))

    @triton.jit
    def _score_key(score, index):
        """int64 [..] keys of fp32 scores (no NaN; -0.0 ranks as +0.0) and int32 indices."""
        score = tl.where(score == 0.0, 0.0, score)
        bits = score.to(tl.int32, bitcast=True)
        order = bits ^ ((bits >> 31) & 0x7FFFFFFF)     # IEEE bits, in signed integer order
        return (order.to(tl.int64) << 32) | (0x7FFFFFFF - index).to(tl.int64)

    @triton.jit
    def _key_score(key):
        order = (key >> 32).to(tl.int32)
        return (order ^ ((order >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True)

    @triton.jit
    def _key_index(key):
        return 0x7FFFFFFF - (key & 0x7FFFFFFF).to(tl.int32)

    @triton.jit
    def _cube_bit(N_DIMS: tl.constexpr, I: tl.constexpr):
        """0 and 1 along the I-th innermost axis of a [2] * N_DIMS hypercube."""
        return tl.reshape(tl.arange(0, 2), [1] * (N_DIMS - I - 1) + [2] + [1] * I)

    @triton.jit
    def _compare_swap(h, flip, I: tl.constexpr):
        """One bitonic compare-and-swap across the I-th innermost axis of hypercube h: the
        pair's smaller key to the 0 side where flip is 0, to the 1 side where it is 1."""
        N_DIMS: tl.constexpr = len(h.shape)
        low = tl.min(h, axis=N_DIMS - 1 - I, keep_dims=True)
        high = tl.max(h, axis=N_DIMS - 1 - I, keep_dims=True)
        return tl.where((_cube_bit(N_DIMS, I) ^ flip) != 0, high, low)

    @triton.jit
    def _bitonic_merge(h, STAGE: tl.constexpr, ORDER: tl.constexpr):
        """Merge the bitonic runs of 2^STAGE keys (ORDER 0 ascending, 1 descending, 2 runs
        alternating as the next stage needs)."""
        if ORDER == 2:
            flip = _cube_bit(len(h.shape), STAGE)
        else:
            flip = ORDER
        for step in tl.static_range(STAGE):
            h = _compare_swap(h, flip, STAGE - 1 - step)
        return h

    @triton.jit
    def _top_keys(keys, LOG_K: tl.constexpr, LOG_N: tl.constexpr, LOG_R: tl.constexpr,
                  TL_TOPK: tl.constexpr):
        """The 2^LOG_K largest of each row of keys [2^LOG_R, 2^LOG_N], largest first. A
        bitonic top-k (Shanbhag et al. 2018: sort runs of K, keep the larger of each pair of
        runs, merge, repeat): ``tl.topk`` where Triton has it and compiles (its swaps cost one
        comparison); otherwise (older Triton, and the interpreter, where ``tl.topk``'s
        swaps run element by element in Python) the same network with min/max swaps."""
        if LOG_K == 0:      # (Triton 3.6's tl.topk would reduce a one-row block to a scalar)
            return tl.max(keys, axis=1, keep_dims=True)
        elif TL_TOPK:
            return tl.topk(keys, 1 << LOG_K, dim=1)
        else:
            h = tl.reshape(keys, [2] * (LOG_R + LOG_N))
            for stage in tl.static_range(1, LOG_K + 1):
                h = _bitonic_merge(h, stage, 2 if stage < LOG_N else 1)
            for stage in tl.static_range(LOG_K + 1, LOG_N + 1):
                h = tl.max(h, axis=len(h.shape) - 1 - LOG_K)      # the larger run of a pair
                h = _bitonic_merge(h, LOG_K, 2 if stage < LOG_N else 1)
            return tl.reshape(h, (1 << LOG_R, 1 << LOG_K))

    @triton.jit
    def _half_top(ptr, rows64, r_ok, stride, n, k, BIG: tl.constexpr, LOG_K: tl.constexpr,
                  LOG_N: tl.constexpr, LOG_R: tl.constexpr, TL_TOPK: tl.constexpr):
        """Each row's k best of its n scores by (rank key desc, index asc), as keys [BR, K]
        (K = 2^LOG_K >= k); the slots past k and past n hold -inf. Only the k best may pair
        into candidates: a (k+1)-th could win a tie of rounded sums by its lower index, which
        the product-key top-k (every implementation) does not take."""
        cols = tl.arange(0, 1 << LOG_N)
        s = tl.load(ptr + rows64[:, None] * stride + cols[None, :],
                    mask=r_ok[:, None] & (cols < n)[None, :], other=float("-inf"))
        s = tl.where((cols < n)[None, :], _rank_key(s, BIG), float("-inf"))
        index = cols[None, :] + tl.zeros((1 << LOG_R, 1 << LOG_N), tl.int32)
        top = _top_keys(_score_key(s, index), LOG_K, LOG_N, LOG_R, TL_TOPK)
        slots = tl.arange(0, 1 << LOG_K)
        none = _score_key(tl.full((1, 1), float("-inf"), tl.float32), tl.zeros((1, 1), tl.int32))
        return tl.where((slots < k)[None, :], top, none)

    @triton.jit
    def _key_columns(keys, WIDTH: tl.constexpr, AT: tl.constexpr):
        """Columns [AT·WIDTH, (AT+1)·WIDTH) of keys [BR, N]: [BR, WIDTH]."""
        BR: tl.constexpr = keys.shape[0]
        N: tl.constexpr = keys.shape[1]
        blocks = tl.reshape(keys, (BR, N // WIDTH, WIDTH))
        at = tl.arange(0, N // WIDTH)
        return tl.max(tl.where((at == AT)[None, :, None], blocks, NO_KEY), 1)

    @triton.jit
    def _candidate_block(top_a, top_b, n_a, A: tl.constexpr, K: tl.constexpr):
        """Block A of the candidate grid as keys [BR, K] of (sum, full index): row 0 by every
        column for A = 0; rows [2^(A-1), 2^A) by columns [0, K / 2^(A-1)) for A >= 1."""
        BR: tl.constexpr = top_a.shape[0]
        if A == 0:
            rows_a = _key_columns(top_a, 1, 0)
            cols_b = top_b
        else:
            rows_a = _key_columns(top_a, 1 << (A - 1), 1)
            cols_b = _key_columns(top_b, K >> (A - 1), 0)
        # Eq. 15: the score of key i + n_a·j is s_a[i] + s_b[j] (-inf past a half's end)
        sums = _key_score(rows_a)[:, :, None] + _key_score(cols_b)[:, None, :]
        full = _key_index(rows_a)[:, :, None] + n_a * _key_index(cols_b)[:, None, :]
        return tl.reshape(_score_key(sums, full), (BR, K))

    @triton.jit
    def _exact_candidate_topk(va, ia, vb, ib, n_a, n_b, k, BLOCK_R: tl.constexpr,
                              KA: tl.constexpr, KB: tl.constexpr, K: tl.constexpr):
        """The top k of all k_a·k_b candidate sums by (sum desc, full index asc), by k rounds
        over the whole [BLOCK_R, KA·KB] candidate tile: int32 [BLOCK_R, K]."""
        # Eq. 15: the score of key i + n_a·j is s_a[i] + s_b[j]; invalid slots stay -inf
        sums = tl.reshape(va[:, :, None] + vb[:, None, :], (BLOCK_R, KA * KB))
        full = tl.reshape(ia[:, :, None] + n_a * ib[:, None, :], (BLOCK_R, KA * KB))
        no_index = n_a * n_b
        slots = tl.arange(0, K)
        out = tl.zeros((BLOCK_R, K), tl.int32)
        for r in range(0, k):
            best = tl.max(sums, 1)
            at = tl.min(tl.where(sums == best[:, None], full, no_index), 1)
            out = tl.where(slots[None, :] == r, at[:, None], out)
            sums = tl.where(full == at[:, None], float("-inf"), sums)
        return out

    @triton.jit
    def _product_key_topk_kernel(a_ptr, b_ptr, idx_ptr, val_ptr, cells_ptr, R, n_a, n_b, k,
                                 stride_a, stride_b, BLOCK_R: tl.constexpr, K: tl.constexpr,
                                 LOG_K: tl.constexpr, LOG_NA: tl.constexpr,
                                 LOG_NB: tl.constexpr, LOG_C: tl.constexpr,
                                 LOG_R: tl.constexpr, BIG: tl.constexpr,
                                 TL_TOPK: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < R
        rows64 = rows.to(tl.int64)
        top_a = _half_top(a_ptr, rows64, r_ok, stride_a, n_a, k, BIG, LOG_K, LOG_NA, LOG_R,
                          TL_TOPK)
        top_b = _half_top(b_ptr, rows64, r_ok, stride_b, n_b, k, BIG, LOG_K, LOG_NB, LOG_R,
                          TL_TOPK)
        # The candidate grid: (i, j) pairs the i-th best of half a with the j-th best of b. Its
        # sums fall along rows and columns (rounding is monotone), so the (i+1)(j+1) - 1 cells
        # (i', j') <= (i, j) sum to at least as much, and (i, j) can be among the top k only if
        # (i+1)(j+1) <= k, or by tying the k-th sum. Blocks A = 0..LOG_K cover those cells:
        # (LOG_K + 1)·K candidates, not K², whose top k by (sum desc, full index asc) is that of
        # the whole grid unless a cell left out ties the k-th sum (then the candidate after the
        # k-th ties it too).
        blocks = tl.arange(0, (1 << LOG_C) // K)
        cand = tl.full((BLOCK_R, (1 << LOG_C) // K, K), NO_KEY, tl.int64)
        for A in tl.static_range(LOG_K + 1):
            cand = tl.where((blocks == A)[None, :, None],
                            _candidate_block(top_a, top_b, n_a, A, K)[:, None, :], cand)
        cand = tl.reshape(cand, (BLOCK_R, 1 << LOG_C))
        top = _top_keys(cand, LOG_K, LOG_C, LOG_R, TL_TOPK)
        out = _key_index(top)
        slots = tl.arange(0, K)
        kth = tl.max(tl.where(slots[None, :] == k - 1, top, NO_KEY), 1)
        after = tl.max(tl.where(cand < kth[:, None], cand, NO_KEY), 1)
        tie = (after >> 32) == (kth >> 32)                       # equal sums
        exact = tl.max((tie & r_ok).to(tl.int32), 0)
        if exact > 0:       # rows with a tie at the k-th: select over the whole grid
            out = _exact_candidate_topk(_key_score(top_a), _key_index(top_a), _key_score(top_b),
                                        _key_index(top_b), n_a, n_b, k, BLOCK_R, K, K, K)
        taken = r_ok[:, None] & (slots < k)[None, :]
        tl.store(idx_ptr + rows64[:, None] * k + slots[None, :], out.to(tl.int64), mask=taken)
        # The values: the sums of the original scores (a NaN selected stays NaN), Eq. 15.
        s_a = tl.load(a_ptr + rows64[:, None] * stride_a + out % n_a, mask=taken, other=0.0)
        s_b = tl.load(b_ptr + rows64[:, None] * stride_b + out // n_a, mask=taken, other=0.0)
        tl.store(val_ptr + rows64[:, None] * k + slots[None, :], s_a + s_b, mask=taken)
        tl.store(cells_ptr + rows64, tl.zeros((BLOCK_R,), tl.int8) + (1 - exact).to(tl.int8),
                 mask=r_ok)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, next_power_of_2(max(1, n))))


@written_in_full()
def gather_sum(idx: Tensor, weights: Tensor, table: Tensor) -> Tensor:
    """``sparseffn::gather_sum`` in Triton: [T, d] in the table's dtype."""
    idx, weights, table = _rowwise(idx), _rowwise(weights), _rowwise(table)
    tokens, m = idx.shape
    d = table.shape[1]
    out = table.new_empty(tokens, d)
    if tokens and d:
        block_d = _block(d, 64)   # 16 × 64 tiles: the fastest on an H100 at d 256, m 128
        grid = (cdiv(tokens, 16), cdiv(d, block_d))
        _gather_sum_kernel[grid](idx, weights, table, out, tokens, m, d, table.shape[0],
                                 idx.stride(0), weights.stride(0), table.stride(0),
                                 out.stride(0), BLOCK_T=16, BLOCK_D=block_d)
    return out


@written_in_full()
def gather_dot(x: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """``sparseffn::gather_dot`` in Triton: [T, m] in the promoted dtype."""
    x, table, idx = _rowwise(x), _rowwise(table), _rowwise(idx)
    tokens, m = idx.shape
    out = x.new_empty(tokens, m, dtype=torch.promote_types(x.dtype, table.dtype))
    if tokens and m:
        block_m = _block(m, 16)
        grid = (cdiv(tokens, 16), cdiv(m, block_m))
        _gather_dot_kernel[grid](x, table, idx, out, tokens, m, x.shape[1], table.shape[0],
                                 x.stride(0), table.stride(0), idx.stride(0), out.stride(0),
                                 BLOCK_T=16, BLOCK_M=block_m, BLOCK_D=32)
    return out


# dense_rows loads its pairs this many slots at a time (one tile of indices and one of weights
# a block). It loaded them one slot at a time until the fifty-seventh session: two dependent
# loads a slot, 32 slots at PKM's k (an H200 profile of bench lm's PKM step, before the
# change: 1.05 of 10.18 ms in this kernel, 12 calls). 1 gives that kernel back, for A/B
# timing (scripts/gpu_lm_layers.py); the sums are the same either way.
DENSE_ROWS_SLOTS = 32


@written_in_full()
def dense_rows(idx: Tensor, weights: Tensor, num_rows: int) -> Tensor:
    """``sparseffn::dense_rows`` in Triton: [T, num_rows] in the weights' dtype."""
    idx, weights = _rowwise(idx), _rowwise(weights)
    tokens, m = idx.shape
    out = weights.new_empty(tokens, num_rows)
    if tokens and num_rows:
        block_n = _block(num_rows, 64)
        block_m = min(DENSE_ROWS_SLOTS, next_power_of_2(max(1, m)))
        grid = (cdiv(tokens, 32), cdiv(num_rows, block_n))
        _dense_rows_kernel[grid](idx, weights, out, tokens, m, num_rows, idx.stride(0),
                                 weights.stride(0), out.stride(0), BLOCK_T=32, BLOCK_N=block_n,
                                 BLOCK_M=block_m)
    return out


# spread_rows holds a block of tokens' pairs in registers: at most this many pairs a token
MAX_SPREAD_PAIRS = 1024


def spread_rows(idx: Tensor, weights: Tensor, num_rows: int, dtype: torch.dtype) -> Tensor:
    """What ``dense_rows`` computes, [T, num_rows] in ``dtype``, for a large table: zeros, then
    each pair's row written with the sum of its token's weights for that row (at most
    ``MAX_SPREAD_PAIRS`` pairs a token). Memory-bound in T·num_rows, where ``dense_rows``
    compares every slot with every column (T·num_rows·m), which suits sub-key tables of tens
    of rows. Out-of-range pairs land nowhere."""
    idx, weights = _rowwise(idx), _rowwise(weights)
    tokens, m = idx.shape
    out = torch.zeros(tokens, num_rows, device=weights.device, dtype=dtype)
    if tokens and m and num_rows:
        block_m = next_power_of_2(m)
        block_t = max(1, min(32, 4096 // block_m))
        _spread_rows_kernel[(cdiv(tokens, block_t),)](
            idx, weights, out, tokens, m, num_rows, idx.stride(0), weights.stride(0),
            out.stride(0), BLOCK_T=block_t, BLOCK_M=block_m)
    return out


def sorted_reverse_index(idx: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """The pairs of ``idx`` [T, m] grouped by table row, without reading anything on the host:
    ``order`` [T·m] (pair numbers t·m + j sorted by row, stable) and ``offsets``
    [num_rows + 1] (row i's pairs are ``order[offsets[i]:offsets[i+1]]``; pairs whose row is
    outside [0, num_rows) belong to no row). Both are int32 when they fit
    (:func:`fits_int32_index`; half the memory of int64), else int64. The rows are sorted as
    the narrowest integers that hold ``[-1, num_rows]`` (:func:`~.ids.id_dtype`: a radix sort
    makes one pass per key byte)."""
    flat = idx.reshape(-1)
    small = fits_int32_index(idx, num_rows)
    if small:
        flat = flat.clamp(-1, num_rows).to(id_dtype(-1, num_rows))
    sorted_rows, order = torch.sort(flat, stable=True)
    bounds = torch.arange(num_rows + 1, device=idx.device, dtype=sorted_rows.dtype)
    offsets = torch.searchsorted(sorted_rows, bounds, out_int32=small)
    return (order.to(torch.int32) if small else order), offsets


def fits_int32_index(idx: Tensor, num_rows: int) -> bool:
    """Whether :func:`sorted_reverse_index` numbers the pairs of ``idx`` and rows in int32."""
    return idx.numel() < 2 ** 31 - 1 and num_rows < 2 ** 31 - 1


# Aim for at least this many programs in scatter_rows: a table of few rows (product sub-keys)
# with many pairs each has its rows' segments split into equal pieces, summed afterwards.
_SCATTER_PROGRAMS = 2048


def scatter_rows(idx: Tensor, weights: Tensor, src: Tensor, num_rows: int,
                 row_index: Optional[tuple[Tensor, Tensor]] = None) -> Tensor:
    """``sparseffn::scatter_rows`` in Triton: a dense [num_rows, d] in src's dtype, every row
    written; the pairs of each row summed in a fixed order (the same result on every run).
    ``row_index``: :func:`sorted_reverse_index` of (idx, num_rows) when the caller has it
    (two tables read with the same pairs sort them once), else it is computed here."""
    return _scatter(idx, weights.contiguous(), _rowwise(src), num_rows, row_index)


# scatter_rows_dot keeps a whole row of d columns for BLOCK_P pairs in registers: up to
# _ROW_TILE values a program (BLOCK_P = _ROW_TILE / BLOCK_D, at least 1), d up to MAX_DOT_WIDTH.
MAX_DOT_WIDTH = 4096
_ROW_TILE = 4096


def scatter_rows_dot_usable(weights: Tensor, src: Tensor, table: Tensor) -> bool:
    """The fused kernel takes the tensors the other row kernels take (:func:`usable`) with rows
    of at most ``MAX_DOT_WIDTH`` columns: one program holds a whole row."""
    return usable(weights, src, table) and src.shape[-1] <= MAX_DOT_WIDTH


def scatter_rows_dot(idx: Tensor, weights: Tensor, src: Tensor, table: Tensor,
                     row_index: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor]:
    """``sparseffn::scatter_rows_dot`` in Triton: (the dense [N, d] ``scatter_rows`` of the
    pairs, in src's dtype; [T, m] ``gather_dot(src, table, idx)``, in the promoted dtype), from
    one pass over the pairs grouped by row. Out-of-range pairs belong to no row: their dots are
    0, as ``gather_dot`` reads such a row as zeros. ``row_index``: as for :func:`scatter_rows`."""
    table = _rowwise(table)
    dots = torch.zeros(idx.shape, device=table.device,
                       dtype=torch.promote_types(src.dtype, table.dtype))
    out = _scatter(idx, weights.contiguous(), _rowwise(src), table.shape[0], row_index,
                   table, dots)
    return out, dots


@written_in_full()
def _scatter(idx: Tensor, weights: Tensor, src: Tensor, num_rows: int,
             row_index: Optional[tuple[Tensor, Tensor]], table: Optional[Tensor] = None,
             dots: Optional[Tensor] = None) -> Tensor:
    """The launch of ``_scatter_rows_kernel`` behind both wrappers: the table gradient, and
    with ``table`` the dots written into ``dots`` (one column block a program)."""
    d = src.shape[1]
    if not (num_rows and d):
        return src.new_zeros(num_rows, d)
    order, offsets = row_index if row_index is not None else sorted_reverse_index(idx, num_rows)
    with_dots = table is not None
    block_d = _block(d, MAX_DOT_WIDTH if with_dots else 64)
    block_p = max(1, min(32, _ROW_TILE // block_d)) if with_dots else 32
    tiles = num_rows * cdiv(d, block_d)
    per_row = idx.numel() // num_rows
    split = max(1, min(64, _SCATTER_PROGRAMS // tiles, per_row // 256))
    out = src.new_empty(num_rows, d) if split == 1 else \
        torch.empty(split, num_rows, d, device=src.device, dtype=torch.float32)
    # the pieces added by the kernel (one arrival count per row and column block) or after
    add_parts = split > 1 and triton_cvmm.ADD_PARTS_IN_KERNEL
    total = src.new_empty(num_rows, d) if add_parts else None
    arrivals = triton_cvmm.arrival_counts(tiles, src.device) if add_parts else None
    _scatter_rows_kernel[(num_rows, cdiv(d, block_d), split)](
        order, offsets, weights, src, table if with_dots else src, out,
        dots if with_dots else out, max(1, idx.shape[1]), d, num_rows, src.stride(0),
        table.stride(0) if with_dots else 0, d if split > 1 else out.stride(0), arrivals,
        total, SPLIT=split, ADD_PARTS=add_parts, BLOCK_P=block_p, BLOCK_D=block_d,
        DOTS=with_dots, num_warps=8 if block_d >= 2048 else 4)
    if split == 1:
        return out
    return total if add_parts else triton_cvmm.sum_partials(out, src.dtype)


def product_key_topk(scores_a: Tensor, scores_b: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``sparseffn::product_key_topk`` in Triton, one launch (fp32 scores; see
    :func:`product_key_topk_usable`): (values [R, k], int64 indices [R, k]), the values being
    ``s_a[i] + s_b[j]`` of the original scores, NaN and -inf ranked last."""
    values, idx, _ = _product_key_topk_launch(scores_a, scores_b, k)
    return values, idx


def product_key_topk_indices(scores_a: Tensor, scores_b: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The kernel's int64 indices [R, k], and bool [R]: True where the row's top k came from
    the (log2 K + 1)·K candidate cells alone, False where a tie at the k-th sum in its block
    of rows sent the block to the exact selection over the whole grid."""
    _, idx, from_cells = _product_key_topk_launch(scores_a, scores_b, k)
    return idx, from_cells


@written_in_full()
def _product_key_topk_launch(scores_a: Tensor, scores_b: Tensor, k: int
                             ) -> tuple[Tensor, Tensor, Tensor]:
    scores_a, scores_b = _rowwise(scores_a), _rowwise(scores_b)
    rows, n_a = scores_a.shape
    n_b = scores_b.shape[1]
    idx = torch.empty(rows, k, dtype=torch.int64, device=scores_a.device)
    values = torch.empty(rows, k, dtype=scores_a.dtype, device=scores_a.device)
    from_cells = torch.ones(rows, dtype=torch.int8, device=scores_a.device)
    if rows and k:
        log = lambda n: next_power_of_2(n).bit_length() - 1     # noqa: E731
        log_k = log(k)
        # each half padded to at least K columns, so that both give K keys
        log_na, log_nb = max(log_k, log(n_a)), max(log_k, log(n_b))
        log_c = log((log_k + 1) << log_k)                         # candidates, to a power of 2
        # A program's rows hold 2^max(...) int64 keys each; one warp per 512 of them, and per
        # 2,048 values of the exact selection's [K·K] tile (int64 keys take two registers).
        held = 1 << max(log_c, log_na, log_nb)
        block_r = max(1, min(8, 512 // held))
        num_warps = max(1, min(8, max(block_r * held // 512,
                                      block_r * (1 << 2 * log_k) // 2048)))
        _product_key_topk_kernel[(cdiv(rows, block_r),)](
            scores_a, scores_b, idx, values, from_cells, rows, n_a, n_b, k,
            scores_a.stride(0), scores_b.stride(0), BLOCK_R=block_r, K=1 << log_k,
            LOG_K=log_k, LOG_NA=log_na, LOG_NB=log_nb, LOG_C=log_c,
            LOG_R=block_r.bit_length() - 1, BIG=float(torch.finfo(torch.float32).max / 4),
            TL_TOPK=_use_tl_topk(), num_warps=num_warps)
    return values, idx, from_cells.bool()
