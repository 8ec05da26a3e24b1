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
- ``product_key_topk``: one program takes BLOCK_R rows and selects the top k of each half's
  scores by k rounds of (max, lowest index among equals). The k_a·k_b candidate sums
  fl(s_a[i] + s_b[j]) form a grid whose rows are non-increasing (the halves are sorted and
  rounding is monotone), so their top k is a k-way merge of the rows: k rounds over the k_a
  row heads instead of over all k_a·k_b candidates. The merge orders equal sums by row, not by
  full index; where a block of rows has equal sums among those taken, or a candidate left
  behind equal to the k-th, the block selects over the whole candidate tile instead, by
  (sum desc, full index asc). Either way the result is exactly that of the sort-based PyTorch
  implementation (same fp32 sums, same order), without sorting a [R, k²] candidate matrix.

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

# The product-key top-k keeps each half's scores (next power of two of n) and the k_a·k_b
# candidates of BLOCK_R rows in registers: beyond these sizes the PyTorch implementation runs.
MAX_SUBKEYS = 4096
MAX_TOPK = 64


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
                             SPLIT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr,
                             DOTS: tl.constexpr):
        """Program (row, column block, part): the sum over part ``part`` of the SPLIT equal
        pieces of the row's segment of sorted pairs; with SPLIT > 1 into out[part]. With
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

    @triton.jit
    def _dense_rows_kernel(idx_ptr, w_ptr, out_ptr, T, m, n, stride_idx, stride_w, stride_out,
                           BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        t_ok = ts < T
        ts64 = ts.to(tl.int64)
        acc = tl.zeros((BLOCK_T, BLOCK_N), dtype=tl.float32)
        for j in range(0, m):   # in slot order: the same sum on every run
            row = tl.load(idx_ptr + ts64 * stride_idx + j, mask=t_ok, other=-1)
            w = tl.load(w_ptr + ts64 * stride_w + j, mask=t_ok, other=0.0).to(tl.float32)
            acc += tl.where(row[:, None] == cols[None, :], w[:, None], 0.0)
        tl.store(out_ptr + ts64[:, None] * stride_out + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=t_ok[:, None] & (cols < n)[None, :])

    @triton.jit
    def _rank_key(x, BIG: tl.constexpr):
        """Scores as finite rank keys, as ``kernels.rankable`` maps them: NaN and -inf to
        -BIG (below every finite score), +inf to BIG."""
        x = tl.where(x != x, -BIG, x)
        return tl.minimum(tl.maximum(x, -BIG), BIG)

    @triton.jit
    def _half_topk(ptr, rows64, r_ok, stride, n, kk, BLOCK_R: tl.constexpr, N: tl.constexpr,
                   K: tl.constexpr, BIG: tl.constexpr):
        """Each row's top ``kk`` of its n scores by (value desc, index asc): keys [BR, K]
        (-inf past kk) and int32 indices [BR, K]."""
        cols = tl.arange(0, N)
        slots = tl.arange(0, K)
        s = tl.load(ptr + rows64[:, None] * stride + cols[None, :],
                    mask=r_ok[:, None] & (cols < n)[None, :], other=float("-inf"))
        s = tl.where((cols < n)[None, :], _rank_key(s, BIG), float("-inf"))
        vals = tl.full((BLOCK_R, K), float("-inf"), tl.float32)
        ids = tl.zeros((BLOCK_R, K), tl.int32)
        for r in range(0, kk):
            best = tl.max(s, 1)
            at = tl.min(tl.where(s == best[:, None], cols[None, :], N), 1)
            vals = tl.where(slots[None, :] == r, best[:, None], vals)
            ids = tl.where(slots[None, :] == r, at[:, None], ids)
            s = tl.where(cols[None, :] == at[:, None], float("-inf"), s)
        return vals, ids

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
    def _product_key_topk_kernel(a_ptr, b_ptr, idx_ptr, val_ptr, merged_ptr, R, n_a, n_b, k,
                                 ka, kb,
                                 stride_a, stride_b,
                                 BLOCK_R: tl.constexpr, NA: tl.constexpr, NB: tl.constexpr,
                                 KA: tl.constexpr, KB: tl.constexpr, K: tl.constexpr,
                                 BIG: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < R
        rows64 = rows.to(tl.int64)
        va, ia = _half_topk(a_ptr, rows64, r_ok, stride_a, n_a, ka, BLOCK_R, NA, KA, BIG)
        vb, ib = _half_topk(b_ptr, rows64, r_ok, stride_b, n_b, kb, BLOCK_R, NB, KB, BIG)
        # A k-way merge of the candidate grid's rows: row i (the i-th best of s_a) holds the
        # sums fl(s_a[i] + s_b[p]) over the k_b best s_b, non-increasing in p (rounding is
        # monotone). Each round takes the best head (lowest full index among equal heads) and
        # moves that row's head one column on: k rounds over k_a heads, not over k_a·k_b sums.
        no_index = n_a * n_b
        slots_b = tl.arange(0, KB)
        slots = tl.arange(0, K)
        first_b = tl.max(tl.where(slots_b[None, :] == 0, vb, float("-inf")), 1)
        first_ib = tl.sum(tl.where(slots_b[None, :] == 0, ib, 0), 1)
        head = va + first_b[:, None]                                          # [BR, KA]
        head_full = tl.where(head == float("-inf"), no_index, ia + n_a * first_ib[:, None])
        col = tl.zeros((BLOCK_R, KA), tl.int32)
        out = tl.zeros((BLOCK_R, K), tl.int32)
        best = tl.full((BLOCK_R,), float("nan"), tl.float32)
        tie = tl.zeros((BLOCK_R,), tl.int1)
        for r in range(0, k):
            previous = best
            best = tl.max(head, 1)
            tie = tie | (best == previous)
            at = tl.min(tl.where(head == best[:, None], head_full, no_index), 1)
            out = tl.where(slots[None, :] == r, at[:, None], out)
            took = head_full == at[:, None]                                   # one row each
            col = col + took.to(tl.int32)
            nxt = tl.sum(tl.where(took, col, 0), 1)
            nxt_b = tl.max(tl.where(slots_b[None, :] == nxt[:, None], vb, float("-inf")), 1)
            nxt_ib = tl.sum(tl.where(slots_b[None, :] == nxt[:, None], ib, 0), 1)
            row_a = tl.max(tl.where(took, va, float("-inf")), 1)
            row_ia = tl.sum(tl.where(took, ia, 0), 1)
            nxt_sum = row_a + nxt_b
            nxt_full = tl.where(nxt_sum == float("-inf"), no_index, row_ia + n_a * nxt_ib)
            head = tl.where(took, nxt_sum[:, None], head)
            head_full = tl.where(took, nxt_full[:, None], head_full)
        # The merge orders candidates of equal sum by row, not by full index. It is exact when
        # no two taken sums are equal and no candidate left behind equals the k-th sum; else
        # (ties: rounded, zero or NaN scores) this block takes the exact selection.
        tie = tie | (tl.max((head == best[:, None]).to(tl.int32), 1) > 0)
        exact = tl.max((tie & r_ok).to(tl.int32), 0)
        if exact > 0:
            out = _exact_candidate_topk(va, ia, vb, ib, n_a, n_b, k, BLOCK_R, KA, KB, K)
        taken = r_ok[:, None] & (slots < k)[None, :]
        tl.store(idx_ptr + rows64[:, None] * k + slots[None, :], out.to(tl.int64), mask=taken)
        # The values: the sums of the original scores (a NaN selected stays NaN), Eq. 15.
        s_a = tl.load(a_ptr + rows64[:, None] * stride_a + out % n_a, mask=taken, other=0.0)
        s_b = tl.load(b_ptr + rows64[:, None] * stride_b + out // n_a, mask=taken, other=0.0)
        tl.store(val_ptr + rows64[:, None] * k + slots[None, :], s_a + s_b, mask=taken)
        tl.store(merged_ptr + rows64, tl.zeros((BLOCK_R,), tl.int8) + (1 - exact).to(tl.int8),
                 mask=r_ok)


def _block(n: int, cap: int) -> int:
    return max(16, min(cap, next_power_of_2(max(1, n))))


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


def dense_rows(idx: Tensor, weights: Tensor, num_rows: int) -> Tensor:
    """``sparseffn::dense_rows`` in Triton: [T, num_rows] in the weights' dtype."""
    idx, weights = _rowwise(idx), _rowwise(weights)
    tokens, m = idx.shape
    out = weights.new_empty(tokens, num_rows)
    if tokens and num_rows:
        block_n = _block(num_rows, 64)
        grid = (cdiv(tokens, 32), cdiv(num_rows, block_n))
        _dense_rows_kernel[grid](idx, weights, out, tokens, m, num_rows, idx.stride(0),
                                 weights.stride(0), out.stride(0), BLOCK_T=32, BLOCK_N=block_n)
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
    _scatter_rows_kernel[(num_rows, cdiv(d, block_d), split)](
        order, offsets, weights, src, table if with_dots else src, out,
        dots if with_dots else out, max(1, idx.shape[1]), d, num_rows, src.stride(0),
        table.stride(0) if with_dots else 0, d if split > 1 else out.stride(0), SPLIT=split,
        BLOCK_P=block_p, BLOCK_D=block_d, DOTS=with_dots,
        num_warps=8 if block_d >= 2048 else 4)
    return out if split == 1 else out.sum(0).to(src.dtype)


def product_key_topk(scores_a: Tensor, scores_b: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``sparseffn::product_key_topk`` in Triton, one launch (fp32 scores; see
    :func:`product_key_topk_usable`): (values [R, k], int64 indices [R, k]), the values being
    ``s_a[i] + s_b[j]`` of the original scores, NaN and -inf ranked last."""
    values, idx, _ = _product_key_topk_launch(scores_a, scores_b, k)
    return values, idx


def product_key_topk_indices(scores_a: Tensor, scores_b: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The kernel's int64 indices [R, k], and bool [R]: True where the row's top k came from
    the merge alone, False where a tie in its block of rows sent the block to the exact
    selection."""
    _, idx, merged = _product_key_topk_launch(scores_a, scores_b, k)
    return idx, merged


def _product_key_topk_launch(scores_a: Tensor, scores_b: Tensor, k: int
                             ) -> tuple[Tensor, Tensor, Tensor]:
    scores_a, scores_b = _rowwise(scores_a), _rowwise(scores_b)
    rows, n_a = scores_a.shape
    n_b = scores_b.shape[1]
    idx = torch.empty(rows, k, dtype=torch.int64, device=scores_a.device)
    values = torch.empty(rows, k, dtype=scores_a.dtype, device=scores_a.device)
    merged = torch.ones(rows, dtype=torch.int8, device=scores_a.device)
    if rows and k:
        ka, kb = min(k, n_a), min(k, n_b)
        NA, NB = next_power_of_2(n_a), next_power_of_2(n_b)
        KA, KB = next_power_of_2(ka), next_power_of_2(kb)
        # One warp per program, its BLOCK_R rows' half scores (and, for blocks with ties, the
        # candidates [BLOCK_R, KA·KB]) in its registers (~2K values each): the reductions stay
        # inside the warp. Measured on an H100 with the exact selection alone (65,536 rows,
        # n 62, k 32): 0.96 ms with one warp, 1.5 ms with four.
        held = max(KA * KB, NA, NB)
        block_r = max(1, min(8, 2048 // held))
        _product_key_topk_kernel[(cdiv(rows, block_r),)](
            scores_a, scores_b, idx, values, merged, rows, n_a, n_b, k, ka, kb,
            scores_a.stride(0), scores_b.stride(0), num_warps=max(1, held // 2048),
            BLOCK_R=block_r, NA=NA, NB=NB, KA=KA, KB=KB, K=next_power_of_2(k),
            BIG=float(torch.finfo(torch.float32).max / 4))
    return values, idx, merged.bool()
