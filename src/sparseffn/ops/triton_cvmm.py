"""Triton kernels for the CVMM operators (``sparseffn::cvmm_rows``,
``sparseffn::expert_weight_grad``) on GPUs.

Both are grouped matrix products over expert-sorted rows (Csordás et al. 2023,
arXiv:2310.10837, App. B.1) with the gather of the input rows fused into the loads, in the
dataflow of ScatterMoE (Tan et al. 2024, arXiv:2403.08245) and SonicMoE (arXiv:2512.14080):

- ``cvmm_rows``: one program computes a [BLOCK_M, BLOCK_N] tile of one expert's rows. The
  rows are gathered from the source as they load (no ``[tokens·k, d]`` copy), the product is
  accumulated in fp32, and the epilogue applies the gate scale, a ReLU or a ReLU-derivative
  mask, computes the gate gradient's dot products, and stores each row at its slot (a
  permutation, so no atomics). Each token's k slots are then summed in slot order.
  When the inner size is small (m <= ``ROW_TILE_MAX_K``: an expert's hidden units in the
  second layer, or the input gradient of the first), a *row-tile* kernel runs instead: one
  program loads its [BLOCK_M, m] rows once and walks the output columns, so the rows are not
  re-read and the tile map not recomputed for every column tile (on an H100 at the Fig. 2
  shapes of Csordás et al., expert size 128: 0.60-0.68× the time of the tile kernel).
- ``expert_weight_grad``: one program computes a [BLOCK_M, BLOCK_N] tile of one expert's
  weight gradient ``Σ_r a_rᵀ b_r`` over that expert's rows (or over one of ``splits``
  ranges of them, when the tiles alone are too few to fill the GPU: split-K, the partial
  sums added in range order by the last of a tile's programs to finish, which an atomic
  count of arrivals names), gathering both sides as they load, in a fixed order: no atomic
  sums, the same result on every run.

Which tile of which expert a program computes is read off the per-expert counts inside the
kernel (a cumulative sum over at most ``MAX_EXPERTS`` experts), so nothing is read on the
host: the grid is ``ceil(P / BLOCK_M) + E + 1`` row tiles, enough for every expert's last
partial tile; the programs past the last expert write the zero rows of pairs dropped at
capacity, and any left over return at once.

Without a GPU, the kernels run on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1`` set before ``triton`` is imported; fp32 and fp16), which is how the
tests check them against the PyTorch implementations.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from .written import written_in_full

try:
    import triton
    import triton.language as tl
except ImportError:   # the package works without Triton: the PyTorch paths take over
    triton = None
    tl = None


def _why_kernels_cannot_be_defined() -> str | None:
    """None, or why this Triton cannot define the kernels here. Releases up to 3.3 (PyTorch
    2.6's and 2.7's) ask the GPU driver for a benchmarker the moment ``@triton.autotune``
    decorates a kernel, that is at import: on a machine without a GPU (under
    ``TRITON_INTERPRET=1`` too) they raise "0 active drivers", which would make ``import
    sparseffn`` fail. A stand-in kernel is decorated the same way to find out."""
    try:
        @triton.jit
        def stand_in(x):
            pass
        triton.autotune(configs=[triton.Config({})], key=[])(stand_in)
    except RuntimeError as error:
        return (f"Triton {getattr(triton, '__version__', '?')} cannot define its kernels "
                f"here: {error}")
    return None


# Why an installed Triton is not used (None where it is, or where none is installed).
UNUSABLE_REASON = None if triton is None else _why_kernels_cannot_be_defined()
if UNUSABLE_REASON is not None:     # as if it were not installed: the PyTorch paths run
    triton = None
    tl = None

# The in-kernel tile map holds the per-expert counts in registers: above this many experts the
# PyTorch implementation (``torch._grouped_mm``) runs instead.
MAX_EXPERTS = 2048
# Inner sizes up to this take the row-tile kernel (the whole [BLOCK_M, m] tile in registers).
ROW_TILE_MAX_K = 128
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_enabled = os.environ.get("SPARSEFFN_TRITON", "1") != "0"
# SPARSEFFN_TRITON_AUTOTUNE=0: one fixed tile shape per kernel instead of timing several at the
# first call of each problem shape (quicker start, e.g. for tests).
_AUTOTUNE = os.environ.get("SPARSEFFN_TRITON_AUTOTUNE", "1") != "0"


def available() -> bool:
    """True when Triton is importable and can define the kernels (``UNUSABLE_REASON``)."""
    return triton is not None


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def set_triton_enabled(enabled: bool) -> None:
    """Use the Triton kernels on GPUs (``True``, the default unless the environment sets
    ``SPARSEFFN_TRITON=0``) or the PyTorch implementation of every operator (``False``)."""
    global _enabled
    _enabled = bool(enabled)


def triton_enabled() -> bool:
    return _enabled and triton is not None


_on_cpu = False


def set_interpreter_for_cpu(enabled: bool) -> None:
    """Run the operators' CPU calls through these kernels in Triton's interpreter (for the
    tests: whole layers then train through the Triton code without a GPU). Needs
    ``TRITON_INTERPRET=1`` set before ``triton`` was imported."""
    global _on_cpu
    if enabled and not interpreting():
        raise RuntimeError("set_interpreter_for_cpu needs TRITON_INTERPRET=1 set before triton "
                           "is imported")
    _on_cpu = bool(enabled)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for launch grids (``triton.cdiv`` is a constexpr function in recent
    Triton, and its wrapper costs microseconds of host time per call)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1), for block sizes."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def usable(num_experts: int, *tensors: Optional[Tensor]) -> bool:
    """True when the Triton kernels take these tensors: Triton present and enabled, every
    tensor on a CUDA device (or on the CPU under :func:`set_interpreter_for_cpu`) in fp32,
    fp16 or bf16 (the index tensors aside), at most ``MAX_EXPERTS`` experts."""
    if not triton_enabled() or num_experts > MAX_EXPERTS:
        return False
    for t in tensors:   # a loop, not all(<generator>): this runs in every operator call
        if t is not None and not ((t.is_cuda or (_on_cpu and t.is_cpu)) and t.dtype in _DTYPES):
            return False
    return True


def on_kernel_device(t: Tensor) -> bool:
    """True when Triton is present and enabled and ``t`` is where the kernels run: a CUDA
    tensor, or a CPU tensor under :func:`set_interpreter_for_cpu` (any dtype)."""
    return triton_enabled() and (t.is_cuda or (_on_cpu and t.is_cpu))


if triton is not None:

    @triton.jit
    def _tile_of(counts_ptr, num_experts, pid, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
        """The expert of row tile ``pid`` and its rows ``[start, end)``; expert E for the
        tiles past the last expert, whose rows start at ``Σ counts + (pid - tiles)·BLOCK_M``
        (the rows of dropped pairs)."""
        e = tl.arange(0, BLOCK_E)
        real = e < num_experts
        count = tl.load(counts_ptr + e, mask=real, other=0).to(tl.int32)
        tiles = (count + BLOCK_M - 1) // BLOCK_M
        tiles_end = tl.cumsum(tiles, 0)
        rows_end = tl.cumsum(count, 0)
        expert = tl.sum((real & (tiles_end <= pid)).to(tl.int32), 0)
        mine = e == expert
        first_tile = tl.sum(tl.where(mine, tiles_end - tiles, 0), 0)
        first_row = tl.sum(tl.where(mine, rows_end - count, 0), 0)
        end = tl.sum(tl.where(mine, rows_end, 0), 0)
        past = expert >= num_experts
        total_tiles = tl.sum(tiles, 0)
        total_rows = tl.sum(count, 0)
        start = tl.where(past, total_rows + (pid - total_tiles) * BLOCK_M,
                         first_row + (pid - first_tile) * BLOCK_M)
        return expert, start, end, past

    def _tile_configs(fixed, tuned):
        """Autotuning candidates from ``(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)`` tuples:
        ``tuned``, or only ``fixed`` under SPARSEFFN_TRITON_AUTOTUNE=0, or one 16³ tile in
        the interpreter (where timing candidates means nothing)."""
        if interpreting():
            return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16})]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n, "BLOCK_K": k}, num_warps=warps,
                              num_stages=stages)
                for m, n, k, warps, stages in (tuned if _AUTOTUNE else [fixed])]

    # The configs under SPARSEFFN_TRITON_AUTOTUNE=0 (and those scripts/ptx_memory_ops.py
    # compiles): (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages); the row tile's without BLOCK_K.
    CVMM_UNTUNED = (128, 64, 64, 4, 3)
    WEIGHT_GRAD_UNTUNED = (64, 64, 64, 4, 3)
    ROW_TILE_UNTUNED = (64, 64, 4, 3)
    _CVMM_TILES = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
                   (64, 64, 64, 4, 4), (128, 256, 64, 8, 3), (64, 256, 32, 4, 4)]
    _WEIGHT_GRAD_TILES = [(128, 128, 64, 8, 3), (64, 128, 64, 4, 4), (128, 64, 64, 4, 4),
                          (64, 64, 64, 4, 4), (128, 128, 32, 8, 4)]

    @triton.jit
    def _row_tile(counts_ptr, num_experts, num_rows, in_idx_ptr, out_idx_ptr, pid,
                  HAS_IN_IDX: tl.constexpr, HAS_OUT_IDX: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_E: tl.constexpr):
        """Row tile ``pid`` of the CVMM kernels: its expert, whether it lies past the last
        expert, its sorted rows, the rows it writes (``live``) and computes (``computed``,
        none past the last expert), the source row each reads and the output row each is
        stored at."""
        expert, start, end, past = _tile_of(counts_ptr, num_experts, pid, BLOCK_M, BLOCK_E)
        rows = start + tl.arange(0, BLOCK_M)
        live = rows < tl.where(past, num_rows, end)
        computed = rows < tl.where(past, start, end)
        rows64 = rows.to(tl.int64)
        if HAS_IN_IDX:
            src_rows = tl.load(in_idx_ptr + rows, mask=computed, other=0).to(tl.int64)
        else:
            src_rows = rows64
        if HAS_OUT_IDX:
            dest = tl.load(out_idx_ptr + rows, mask=live, other=0).to(tl.int64)
        else:
            dest = rows64
        return expert, past, rows, rows64, live, computed, src_rows, dest

    @triton.jit
    def _dot_partial(acc, dot_ptr, stride_dot, rows64, cols, tile_ok):
        """<z_r, dot_with[r]> over one column tile, in fp32."""
        other = tl.load(dot_ptr + rows64[:, None] * stride_dot + cols[None, :],
                        mask=tile_ok, other=0.0)
        return tl.sum(acc * other.to(tl.float32), 1)

    @triton.jit
    def add_parts_if_last(parts_ptr, stride_parts, offsets, load_ok, store_ok, num_parts,
                          arrivals_ptr, out_ptr):
        """Run by each of the ``num_parts`` programs that store one float32 part of the same
        output block at ``parts_ptr + part · stride_parts + offsets``, after its store. The
        last one to arrive adds the parts in the order of their index, whichever program that
        is (so the same result on every run, and ``sum_partials``' result), rounds the sum
        once to ``out_ptr``'s dtype and stores it at ``out_ptr + offsets`` (zeros where only
        ``store_ok``); it then sets the block's arrival count back to zero, for the next
        launch (autotuning's reruns, CUDA graph replays). The pattern of a serial split-K's
        semaphore: the barrier orders every thread's part before the count's release, and the
        count's acquire orders the other parts before their loads, which bypass the
        multiprocessor's cache (``.cg``)."""
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
        if arrived == num_parts - 1:
            total = tl.zeros(offsets.shape, dtype=tl.float32)
            part_ptrs = parts_ptr + offsets
            for _ in range(num_parts):
                total += tl.load(part_ptrs, mask=load_ok, other=0.0, cache_modifier=".cg")
                part_ptrs += stride_parts
            tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=store_ok)
            tl.store(arrivals_ptr, 0)

    @triton.jit
    def _epilogue_store(acc, rows, rows64, live, computed, dest, cols, n, scale_ptr,
                        mask_ptr, stride_mask, out_ptr, stride_out, HAS_SCALE: tl.constexpr,
                        RELU: tl.constexpr, HAS_MASK: tl.constexpr):
        """Gate scale, ReLU and ReLU-derivative mask of one [BLOCK_M, BLOCK_N] product tile,
        stored at the rows' output rows (exact zeros for rows written but not computed)."""
        col_ok = cols < n
        tile_ok = computed[:, None] & col_ok[None, :]
        if HAS_SCALE:
            acc = acc * tl.load(scale_ptr + rows, mask=computed, other=0.0).to(tl.float32)[:, None]
        if RELU:   # max(y, 0) with NaN kept
            acc = tl.where(acc < 0, 0.0, acc)
        if HAS_MASK:
            keep = tl.load(mask_ptr + rows64[:, None] * stride_mask + cols[None, :],
                           mask=tile_ok, other=0.0)
            acc = tl.where(keep > 0, acc, 0.0)
        acc = tl.where(tile_ok, acc, 0.0)   # dropped rows: exact zeros
        tl.store(out_ptr + dest[:, None] * stride_out + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & col_ok[None, :])

    _CVMM_CONFIGS = _tile_configs(CVMM_UNTUNED, _CVMM_TILES)
    _WEIGHT_GRAD_CONFIGS = _tile_configs(WEIGHT_GRAD_UNTUNED, _WEIGHT_GRAD_TILES)

    # Every config writes its own column tiles' partial dots: zeroed between tuning runs (for
    # the sum in a second launch, which reads every row of them).
    @triton.autotune(configs=_CVMM_CONFIGS,
                     reset_to_zero=["dots_ptr"],
                     key=["m", "n", "HAS_IN_IDX", "HAS_OUT_IDX", "HAS_DOT", "HAS_MASK"])
    @triton.jit
    def _cvmm_kernel(src_ptr, stride_src, in_idx_ptr,
                     w_ptr, stride_we, stride_wk, stride_wn,
                     counts_ptr, num_experts, num_rows, m, n,
                     out_ptr, stride_out, out_idx_ptr, scale_ptr,
                     mask_ptr, stride_mask, dot_ptr, stride_dot, dots_ptr, arrivals_ptr,
                     dots_sum_ptr,
                     HAS_IN_IDX: tl.constexpr, HAS_OUT_IDX: tl.constexpr,
                     HAS_SCALE: tl.constexpr, RELU: tl.constexpr, HAS_MASK: tl.constexpr,
                     HAS_DOT: tl.constexpr, ADD_PARTS: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """One [BLOCK_M, BLOCK_N] tile of one row tile's products, over K in BLOCK_K steps;
        with ``ADD_PARTS``, the last of a row tile's column tiles to finish adds their dots
        into ``dots_sum``."""
        pid_n = tl.program_id(1)
        expert, past, rows, rows64, live, computed, src_rows, dest = _row_tile(
            counts_ptr, num_experts, num_rows, in_idx_ptr, out_idx_ptr, tl.program_id(0),
            HAS_IN_IDX, HAS_OUT_IDX, BLOCK_M, BLOCK_E)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n
        w_expert = w_ptr + tl.where(past, 0, expert).to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        k_end = tl.where(past, 0, m)
        for k0 in range(0, k_end, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < m
            a = tl.load(src_ptr + src_rows[:, None] * stride_src + ks[None, :],
                        mask=computed[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_expert + ks[:, None].to(tl.int64) * stride_wk
                        + cols[None, :].to(tl.int64) * stride_wn,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if HAS_DOT:   # this column tile's part of the dots, added below or outside
            partial = _dot_partial(acc, dot_ptr, stride_dot, rows64, cols,
                                   computed[:, None] & col_ok[None, :])
            tl.store(dots_ptr + pid_n * num_rows + rows64, partial, mask=computed)
            if ADD_PARTS:
                add_parts_if_last(dots_ptr, num_rows, rows64, computed, live,
                                  tl.num_programs(1), arrivals_ptr + tl.program_id(0),
                                  dots_sum_ptr)
        _epilogue_store(acc, rows, rows64, live, computed, dest, cols, n, scale_ptr, mask_ptr,
                        stride_mask, out_ptr, stride_out, HAS_SCALE, RELU, HAS_MASK)

    # (BLOCK_M, BLOCK_N, warps, stages) of the row-tile kernel; BLOCK_K is m rounded up.
    _ROW_TILES = [(128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 2)]

    def _row_tile_configs():
        if interpreting():
            return [triton.Config({"BLOCK_M": 16, "BLOCK_N": 16})]
        return [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=warps, num_stages=stages)
                for m, n, warps, stages in (_ROW_TILES if _AUTOTUNE else [ROW_TILE_UNTUNED])]

    # A config's column splits depend on its BLOCK_N, and each split writes its own row of
    # partial dots: zeroed between tuning runs, as for _cvmm_kernel.
    _ROW_TILE_CONFIGS = _row_tile_configs()

    @triton.autotune(configs=_ROW_TILE_CONFIGS, reset_to_zero=["dots_ptr"],
                     key=["m", "n", "HAS_IN_IDX", "HAS_OUT_IDX", "HAS_DOT", "HAS_MASK"])
    @triton.jit
    def _cvmm_row_tile_kernel(src_ptr, stride_src, in_idx_ptr,
                              w_ptr, stride_we, stride_wk, stride_wn,
                              counts_ptr, num_experts, num_rows, m, n,
                              out_ptr, stride_out, out_idx_ptr, scale_ptr,
                              mask_ptr, stride_mask, dot_ptr, stride_dot, dots_ptr,
                              arrivals_ptr, dots_sum_ptr,
                              HAS_IN_IDX: tl.constexpr, HAS_OUT_IDX: tl.constexpr,
                              HAS_SCALE: tl.constexpr, RELU: tl.constexpr,
                              HAS_MASK: tl.constexpr, HAS_DOT: tl.constexpr,
                              ADD_PARTS: tl.constexpr, PRECISION: tl.constexpr,
                              BLOCK_E: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_N: tl.constexpr):
        """The rows of one row tile (all m <= BLOCK_K inner columns, loaded once) times every
        column tile ``split, split + splits, ...`` (``splits`` = the grid's second size, > 1
        only when there are few row tiles); the gate-gradient dots are summed over this
        program's column tiles and stored once, as the partial sum of ``split`` (with
        ``ADD_PARTS``, added into ``dots_sum`` by the row tile's last split to finish)."""
        split = tl.program_id(1)
        splits = tl.num_programs(1)
        expert, past, rows, rows64, live, computed, src_rows, dest = _row_tile(
            counts_ptr, num_experts, num_rows, in_idx_ptr, out_idx_ptr, tl.program_id(0),
            HAS_IN_IDX, HAS_OUT_IDX, BLOCK_M, BLOCK_E)
        ks = tl.arange(0, BLOCK_K)
        k_ok = ks < m
        a = tl.load(src_ptr + src_rows[:, None] * stride_src + ks[None, :],
                    mask=computed[:, None] & k_ok[None, :], other=0.0)       # [BM, m], once
        w_expert = w_ptr + tl.where(past, 0, expert).to(tl.int64) * stride_we
        dot_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for n0 in range(split * BLOCK_N, n, splits * BLOCK_N):
            cols = n0 + tl.arange(0, BLOCK_N)
            col_ok = cols < n
            b = tl.load(w_expert + ks[:, None].to(tl.int64) * stride_wk
                        + cols[None, :].to(tl.int64) * stride_wn,
                        mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, input_precision=PRECISION)
            if HAS_DOT:
                dot_sum += _dot_partial(acc, dot_ptr, stride_dot, rows64, cols,
                                        computed[:, None] & col_ok[None, :])
            _epilogue_store(acc, rows, rows64, live, computed, dest, cols, n, scale_ptr,
                            mask_ptr, stride_mask, out_ptr, stride_out, HAS_SCALE, RELU,
                            HAS_MASK)
        if HAS_DOT:
            tl.store(dots_ptr + split * num_rows + rows64, dot_sum, mask=computed)
            if ADD_PARTS:
                add_parts_if_last(dots_ptr, num_rows, rows64, computed, live, splits,
                                  arrivals_ptr + tl.program_id(0), dots_sum_ptr)

    @triton.autotune(configs=_WEIGHT_GRAD_CONFIGS,
                     key=["ma", "nb", "splits", "HAS_A_IDX", "HAS_B_IDX", "HAS_SCALE"])
    @triton.jit
    def _weight_grad_kernel(a_ptr, stride_a, a_idx_ptr, b_ptr, stride_b, b_idx_ptr, scale_ptr,
                            counts_ptr, num_experts, ma, nb, ma_out, splits,
                            out_ptr, stride_os, stride_oe, stride_om, arrivals_ptr, sum_ptr,
                            HAS_A_IDX: tl.constexpr, HAS_B_IDX: tl.constexpr,
                            HAS_SCALE: tl.constexpr, ADD_PARTS: tl.constexpr,
                            PRECISION: tl.constexpr,
                            BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Tile (program 0) of expert (program 1)'s ``Σ_r a_rᵀ b_r`` over split (program 2)
        of its rows: the rows ``[start, end)`` cut into ``splits`` ranges of whole
        ``BLOCK_K`` steps (a range past the end sums nothing), stored at
        ``out[split, expert]``; with ``ADD_PARTS``, the last of a tile's ``splits`` programs
        to finish adds them into ``sum[expert]``. Only the first ``ma_out`` of the ``ma``
        output rows are stored (the rest, a padded weight's zero units, are read as a's
        columns but have no place in the output)."""
        expert = tl.program_id(1)
        split = tl.program_id(2)
        tiles_n = tl.cdiv(nb, BLOCK_N)
        pid_m = tl.program_id(0) // tiles_n
        pid_n = tl.program_id(0) % tiles_n
        e = tl.arange(0, BLOCK_E)
        count = tl.load(counts_ptr + e, mask=e < num_experts, other=0).to(tl.int32)
        start = tl.sum(tl.where(e < expert, count, 0), 0)
        end = start + tl.sum(tl.where(e == expert, count, 0), 0)
        per_split = tl.cdiv(tl.cdiv(end - start, splits), BLOCK_K) * BLOCK_K
        first = tl.minimum(start + split * per_split, end)
        last = tl.minimum(first + per_split, end)
        cols_a = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols_b = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        a_ok = cols_a < ma
        b_ok = cols_b < nb
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for r0 in range(first, last, BLOCK_K):
            rs = r0 + tl.arange(0, BLOCK_K)
            r_ok = rs < last
            if HAS_A_IDX:
                a_rows = tl.load(a_idx_ptr + rs, mask=r_ok, other=0).to(tl.int64)
            else:
                a_rows = rs.to(tl.int64)
            if HAS_B_IDX:
                b_rows = tl.load(b_idx_ptr + rs, mask=r_ok, other=0).to(tl.int64)
            else:
                b_rows = rs.to(tl.int64)
            a_t = tl.load(a_ptr + a_rows[None, :] * stride_a + cols_a[:, None],
                          mask=a_ok[:, None] & r_ok[None, :], other=0.0)        # [BM, BK]
            if HAS_SCALE:
                gate = tl.load(scale_ptr + rs, mask=r_ok, other=0.0).to(tl.float32)
                a_t = (a_t.to(tl.float32) * gate[None, :]).to(a_ptr.dtype.element_ty)
            b = tl.load(b_ptr + b_rows[:, None] * stride_b + cols_b[None, :],
                        mask=r_ok[:, None] & b_ok[None, :], other=0.0)          # [BK, BN]
            acc = tl.dot(a_t, b, acc, input_precision=PRECISION)
        offsets = (expert.to(tl.int64) * stride_oe + cols_a[:, None].to(tl.int64) * stride_om
                   + cols_b[None, :])
        tile_ok = (cols_a < ma_out)[:, None] & b_ok[None, :]
        tl.store(out_ptr + split.to(tl.int64) * stride_os + offsets,
                 acc.to(out_ptr.dtype.element_ty), mask=tile_ok)
        if ADD_PARTS:
            add_parts_if_last(out_ptr, stride_os, offsets, tile_ok, tile_ok, splits,
                              arrivals_ptr + expert * tl.num_programs(0) + tl.program_id(0),
                              sum_ptr)

    @triton.jit
    def _sum_partials_kernel(parts_ptr, out_ptr, numel, num_parts, BLOCK: tl.constexpr):
        """``out[i] = Σ_s parts[s, i]`` over float32 partial sums, added in the order of s,
        rounded to ``out``'s dtype once."""
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        ptrs = parts_ptr + offs      # 64-bit: S · numel may pass 2^31
        for _ in range(num_parts):
            acc += tl.load(ptrs, mask=ok, other=0.0)
            ptrs += numel
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _precision(dtype: torch.dtype) -> str:
    """fp32 products in full precision unless PyTorch's own matmuls may use TF32."""
    if dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32:
        return "tf32"
    return "ieee"


def _smallest(configs: list, block: str) -> int:
    """The smallest ``block`` size (``"BLOCK_M"`` ...) of a kernel's candidate tiles: what
    sizes a buffer indexed by the tile the autotuner picks."""
    return min(config.kwargs[block] for config in configs)


def arrival_counts(blocks: int, device: torch.device) -> Tensor:
    """Zeroed int32 counts, one per output block whose parts a kernel adds itself (see
    ``add_parts_if_last``); the kernel leaves them at zero again."""
    return torch.zeros(blocks, dtype=torch.int32, device=device)


def _block_e(num_experts: int) -> int:
    return max(16, next_power_of_2(max(1, num_experts)))


_SUM_BLOCK = 1024


@written_in_full()
def sum_partials(parts: Tensor, dtype: torch.dtype) -> Tensor:
    """``parts.sum(0).to(dtype)`` in one launch instead of two: float32 partial sums
    ``parts`` [S, ...] added in the order of their first index, the same result on every
    run, and rounded to ``dtype`` once; zeros for S = 0. The split parts of the kernels here
    are added inside them (``add_parts_if_last``, the same result) unless
    ``ADD_PARTS_IN_KERNEL`` is off."""
    out = parts.new_empty(parts.shape[1:], dtype=dtype)
    numel = out.numel()
    if parts.shape[0] == 0:
        return out.zero_()
    if numel:
        _sum_partials_kernel[(cdiv(numel, _SUM_BLOCK),)](
            parts.contiguous(), out, numel, parts.shape[0], BLOCK=_SUM_BLOCK)
    return out


def _rowwise(t: Tensor) -> Tensor:
    """``t`` with unit column stride (the kernels index rows by one stride)."""
    return t if t.stride(-1) == 1 else t.contiguous()


_SM_COUNT: dict = {}


def _multiprocessors(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs host time); 1 for
    the CPU interpreter."""
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def _row_tile_grid(rows: int, n: int, num_experts: int, device: torch.device):
    """The row-tile kernel's grid: every row tile (as ``_cvmm_kernel``'s first axis), and its
    columns split over as many programs as it takes to give each multiprocessor about two
    programs when the row tiles alone are fewer (small batches)."""
    sms = _multiprocessors(device)

    def grid(meta):
        row_tiles = cdiv(rows, meta["BLOCK_M"]) + num_experts + 1
        splits = min(cdiv(n, meta["BLOCK_N"]), max(1, cdiv(2 * sms, row_tiles)))
        return row_tiles, splits
    return grid


@written_in_full()
def cvmm_rows(src: Tensor, weight: Tensor, counts: Tensor, in_idx: Optional[Tensor],
              out_idx: Optional[Tensor], scale: Optional[Tensor], out_rows: int, group: int,
              relu: bool, mask_with: Optional[Tensor], dot_with: Optional[Tensor]
              ) -> tuple[Tensor, Tensor]:
    """``sparseffn::cvmm_rows`` in Triton (same arguments and results as the operator)."""
    dtype = torch.promote_types(src.dtype, weight.dtype)
    src, weight = _rowwise(src.to(dtype)), weight.to(dtype)
    num_experts, m, n = weight.shape
    rows = (in_idx if in_idx is not None else out_idx if out_idx is not None else src).shape[0]
    out = src.new_empty(rows, n)
    has_dot = dot_with is not None
    add_parts = has_dot and ADD_PARTS_IN_KERNEL
    row_tile = m <= ROW_TILE_MAX_K
    # Partial dots per column tile or column split (at most one per 16 columns), added by
    # the kernel into ``dots`` (one arrival count per row tile) or below; a 0-size buffer
    # when there are none.
    parts = (cdiv(n, 16) if n else 0) if has_dot else 0
    partial_dots = (src.new_empty if add_parts else src.new_zeros)(parts, rows,
                                                                   dtype=torch.float32)
    dots = src.new_empty(rows if has_dot else 0)
    arrivals = None
    if add_parts:
        smallest = _smallest(_ROW_TILE_CONFIGS if row_tile else _CVMM_CONFIGS, "BLOCK_M")
        arrivals = arrival_counts(cdiv(rows, smallest) + num_experts + 1, src.device)
    if rows and n:
        mask_with = None if mask_with is None else _rowwise(mask_with)
        dot_with = None if dot_with is None else _rowwise(dot_with)
        counts = counts.contiguous()
        args = (src, src.stride(0), in_idx,
                weight, weight.stride(0), weight.stride(1), weight.stride(2),
                counts, num_experts, rows, m, n,
                out, out.stride(0), out_idx, scale,
                mask_with, 0 if mask_with is None else mask_with.stride(0),
                dot_with, 0 if dot_with is None else dot_with.stride(0), partial_dots,
                arrivals, dots)
        flags = dict(HAS_IN_IDX=in_idx is not None, HAS_OUT_IDX=out_idx is not None,
                     HAS_SCALE=scale is not None, RELU=bool(relu),
                     HAS_MASK=mask_with is not None, HAS_DOT=has_dot, ADD_PARTS=add_parts,
                     PRECISION=_precision(dtype), BLOCK_E=_block_e(num_experts))
        if row_tile:
            _cvmm_row_tile_kernel[_row_tile_grid(rows, n, num_experts, src.device)](
                *args, BLOCK_K=max(16, next_power_of_2(m)), **flags)
        else:
            grid = lambda meta: (cdiv(rows, meta["BLOCK_M"]) + num_experts + 1,  # noqa: E731
                                 cdiv(n, meta["BLOCK_N"]))
            _cvmm_kernel[grid](*args, **flags)
    else:
        out.zero_()
        dots.zero_()
    if has_dot and not add_parts:
        dots = sum_partials(partial_dots, dtype)
    if out_idx is not None and group > 1:    # each token's slots, summed in slot order
        out = out.view(out_rows, group, n).sum(1)
    elif out_idx is not None and rows == 0:
        out = src.new_zeros(out_rows, n)
    return out, dots


# The weight gradient's split-K: each output tile sums one expert's rows, P / E of them (4,096
# at the LM's shapes, 8,192 at Fig. 2's d_model 512), in one program. When the tiles are few
# (8 experts of [256, 256]: 128 tiles of 64×64 for an H100's 132 multiprocessors), each
# multiprocessor runs one long loop and waits on its loads. The rows are then cut into
# ``splits`` ranges, computed by separate programs into float32 partial gradients that are
# summed in a fixed order by the last of a tile's programs to finish (no atomic sums: the
# same result on every run). Enough splits for about ``_WEIGHT_GRAD_PROGRAMS_PER_SM``
# programs a multiprocessor, each range at least ``_WEIGHT_GRAD_MIN_SPLIT_ROWS`` rows (of the
# mean expert) and at most ``_WEIGHT_GRAD_MAX_SPLITS`` ranges. ``WEIGHT_GRAD_SPLITS`` set to a
# number fixes the splits (benchmarks, tests).
WEIGHT_GRAD_SPLITS: Optional[int] = None
# Split parts (the weight gradient's ranges, the gate gradient's column tiles, the row
# scatter's pieces) are added by the last program of each output block to finish, in the
# order of their index: the result of ``sum_partials``, without its launch, at the cost of a
# memset of one int32 count a block. False adds them in a second launch (``sum_partials``),
# as before: for benchmarks that time the difference, and a way back should a GPU show a race.
ADD_PARTS_IN_KERNEL = True
_WEIGHT_GRAD_PROGRAMS_PER_SM = 4
_WEIGHT_GRAD_MIN_SPLIT_ROWS = 512
_WEIGHT_GRAD_MAX_SPLITS = 16


def weight_grad_splits(rows: int, num_experts: int, ma: int, nb: int,
                       device: torch.device) -> int:
    """How many ranges :func:`expert_weight_grad` cuts each expert's rows into (1: none), from
    what the host knows: the ``rows`` of all experts, the experts and the gradient's shape
    [ma, nb] (tiles counted at 64×64, the smallest tuned tile)."""
    if WEIGHT_GRAD_SPLITS is not None:
        return max(1, int(WEIGHT_GRAD_SPLITS))
    tiles = cdiv(ma, 64) * cdiv(nb, 64) * num_experts
    wanted = cdiv(_WEIGHT_GRAD_PROGRAMS_PER_SM * _multiprocessors(device), max(tiles, 1))
    longest = rows // (max(num_experts, 1) * _WEIGHT_GRAD_MIN_SPLIT_ROWS)
    return max(1, min(wanted, longest, _WEIGHT_GRAD_MAX_SPLITS))


@written_in_full()
def expert_weight_grad(a_src: Tensor, b_src: Tensor, counts: Tensor, a_idx: Optional[Tensor],
                       b_idx: Optional[Tensor], scale: Optional[Tensor],
                       rows: Optional[int] = None,
                       out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``sparseffn::expert_weight_grad`` in Triton (same arguments and result)."""
    dtype = torch.promote_types(a_src.dtype, b_src.dtype)
    a_src, b_src = _rowwise(a_src.to(dtype)), _rowwise(b_src.to(dtype))
    num_experts = counts.shape[0]
    ma, nb = a_src.shape[1], b_src.shape[1]
    ma_out = ma if rows is None else rows
    out_dtype = out_dtype or dtype
    if not (num_experts and ma_out and nb):
        return a_src.new_empty(num_experts, ma_out, nb, dtype=out_dtype)
    sorted_rows = (a_idx if a_idx is not None else b_idx if b_idx is not None else a_src
                   ).shape[0]
    splits = weight_grad_splits(sorted_rows, num_experts, ma, nb, a_src.device)
    # one split writes the gradient [E, ma_out, nb]; several write float32 partials [splits,
    # E, ma_out, nb], added into ``total`` by the kernel (one arrival count per output tile)
    # or after
    add_parts = splits > 1 and ADD_PARTS_IN_KERNEL
    total = arrivals = None
    if splits == 1:
        out = a_src.new_empty(num_experts, ma_out, nb, dtype=out_dtype)
        strides = (0, out.stride(0), out.stride(1))
    else:
        out = a_src.new_empty(splits, num_experts, ma_out, nb, dtype=torch.float32)
        strides = out.stride()[:3]
    if add_parts:
        total = a_src.new_empty(num_experts, ma_out, nb, dtype=out_dtype)
        tiles = (cdiv(ma, _smallest(_WEIGHT_GRAD_CONFIGS, "BLOCK_M"))
                 * cdiv(nb, _smallest(_WEIGHT_GRAD_CONFIGS, "BLOCK_N")))
        arrivals = arrival_counts(num_experts * tiles, a_src.device)
    grid = lambda meta: (cdiv(ma, meta["BLOCK_M"]) * cdiv(nb, meta["BLOCK_N"]),  # noqa: E731
                         num_experts, splits)
    _weight_grad_kernel[grid](
        a_src, a_src.stride(0), a_idx, b_src, b_src.stride(0), b_idx, scale,
        counts.contiguous(), num_experts, ma, nb, ma_out, splits, out, *strides, arrivals, total,
        HAS_A_IDX=a_idx is not None, HAS_B_IDX=b_idx is not None, HAS_SCALE=scale is not None,
        ADD_PARTS=add_parts, PRECISION=_precision(dtype), BLOCK_E=_block_e(num_experts))
    if splits == 1:
        return out
    return total if add_parts else sum_partials(out, out_dtype)
