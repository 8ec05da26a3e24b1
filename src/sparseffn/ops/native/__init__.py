"""Fused CPU kernels for CVMM and FFF trees, compiled on first use.

``cvmm_cpu.c`` gathers, multiplies and scatters in L2-sized chunks, so the ``[pairs, d_model]``
copies that the pure-PyTorch path materialises (k gathered inputs, k outputs before the sum)
never exist. It is plain C with OpenMP; the BLAS routines are the ``sgemm_`` that PyTorch
itself links (MKL in the x86 wheels) and, for bfloat16, MKL's ``gemm_bf16bf16f32`` (float32
accumulation; AMX or AVX-512 BF16 where the CPU has them), looked up at run time and passed in
as function pointers, so nothing links against PyTorch and the build takes about a second. On
AMD CPUs with AVX-512 BF16, where MKL multiplies bf16 at its float32 speed, the bf16 products
take the kernels' own GEMM instead (``bf16_gemm.h``, :func:`bf16_gemm` says which runs).
``fff_cpu.c`` holds the level-by-level expansion of fast feed-forward trees and their greedy
descent (ops/fff.py).
``rows_cpu.c`` holds the gathered-row products of single-row tables and the product-key top-k
(ops/rows.py, ops/product_keys.py). ``pairs_cpu.c`` applies MLP experts to a few tokens
without a dispatch plan (ops/expert_mlp.py: inference at small batches).

The package is three modules: :mod:`.build` compiles and loads the library, :mod:`.abi`
declares every C function from one table and checks every return code, and this module wraps
them for tensors, checking what the C code assumes (CPU, float32, strides). The operators of
:mod:`sparseffn.ops.kernels` call these wrappers; nothing else should.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..written import written_in_full
from .abi import call
from .build import (_load, available, bf16_available, bf16_gemm, native_enabled,
                    set_native_enabled, unavailable_reason)

__all__ = ["available", "bf16_available", "bf16_gemm", "cvmm_rows", "cvmm_usable", "fff_descend",
           "fff_expand", "fff_expand_backward",
           "gather_dot", "gather_sum", "mlp_pairs", "mlp_pairs_usable", "native_enabled",
           "product_key_topk", "rows_usable", "scatter_rows",
           "set_native_enabled", "topk_rows", "unavailable_reason", "usable", "weight_grad"]

# ---------------------------------------------------------------------------------------------
# Tensor-level wrappers. They check what the C code assumes (CPU, fp32 (bf16 too for the CVMM
# kernels), rows with unit column stride, a weight with a unit stride in one of its last two
# dims); `usable` and `cvmm_usable` say beforehand.

_INT_MAX = 2**31 - 1        # BLAS leading dimensions are C ints


def _l2_bytes() -> int:
    """Per-core L2 size from sysfs (1 MB when it cannot be read)."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if (index / "level").read_text().strip() != "2":
                continue
            size = (index / "size").read_text().strip().upper()
            scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            return int(size.rstrip("KM")) * scale
        except (OSError, ValueError):
            break
    return 1 << 20


# A chunk of gathered rows takes a quarter of L2 (512 KB on this 2 MB-L2 Xeon, where 256 KB
# and 1 MB measured 2-3% slower and 64 KB 30% slower for a whole sigma-MoE step).
_CHUNK_BYTES = max(64 << 10, min(1 << 20, _l2_bytes() // 4))


def _chunk(width: int) -> int:
    return max(16, min(1024, _CHUNK_BYTES // (4 * max(width, 1))))


def usable(*tensors: torch.Tensor | None) -> bool:
    """True when the fused kernels are available and can take these tensors: CPU float32.

    Every kernel gives the same result for any thread count and schedule."""
    for t in tensors:   # is_cpu: a tenth of the time of device.type, in every operator call
        if t is not None and (not t.is_cpu or t.dtype != torch.float32):
            return False
    return available()


def cvmm_usable(*tensors: torch.Tensor | None, scale: torch.Tensor | None = None) -> bool:
    """True when :func:`cvmm_rows` and :func:`weight_grad` can take these tensors: CPU, all of
    one dtype, float32 or (where PyTorch's BLAS is MKL) bfloat16; ``scale`` any floating CPU
    tensor (it is read in float32)."""
    present = [t for t in tensors if t is not None]
    if scale is not None and (not scale.is_cpu or not scale.is_floating_point()):
        return False
    if any(not t.is_cpu or t.dtype != present[0].dtype for t in present):
        return False
    if present and present[0].dtype == torch.bfloat16:
        return bf16_available()
    return usable(*present)


def _written(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A CPU tensor for a C kernel to overwrite in full (every kernel writes every element of
    what it returns, tested), without deterministic mode's NaN fill (:mod:`..written`)."""
    with written_in_full():
        return torch.empty(*shape, dtype=dtype)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _standard(t: torch.Tensor) -> torch.Tensor:
    """A copy with row-major strides (``contiguous()`` may keep odd strides on size-1 dims)."""
    return torch.empty(t.shape, dtype=t.dtype).copy_(t)


def _rows(name: str, t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A [rows, width] matrix of ``dtype`` with unit column stride and a row stride >= width,
    as BLAS wants of a leading dimension (copied when it is not)."""
    if t.dim() != 2 or t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name} must be a {_name(dtype)} CPU matrix [rows, width], got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    if t.stride(1) == 1 and max(1, t.shape[1]) <= t.stride(0) < _INT_MAX:
        return t
    return _standard(t)


def _kernel_dtype(t: torch.Tensor) -> torch.dtype:
    """The element type the CVMM kernels read ``t`` as: bf16 where they take it, else float32
    (a tensor of any other dtype is then refused by name)."""
    return torch.bfloat16 if t.dtype == torch.bfloat16 and bf16_available() else torch.float32


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _weight(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, int, int, int]:
    """weight [E, m, n] as (tensor, expert stride, leading dimension, transposed): each
    expert's matrix row-major with row stride >= n, or the transpose of a row-major [n, m]
    with row stride >= m (copied when it is neither)."""
    if weight.dim() != 3 or weight.dtype != dtype or weight.device.type != "cpu":
        raise ValueError(f"weight must be a {_name(dtype)} CPU tensor [E, m, n], got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    _, m, n = weight.shape
    se, sr, sc = weight.stride()
    row_major = sc == 1 and max(1, n) <= sr < _INT_MAX
    col_major = sr == 1 and max(1, m) <= sc < _INT_MAX
    if not (row_major or col_major):
        weight = _standard(weight)
        se, sr, sc = weight.stride()
        row_major = True
    return (weight, se, sr, 0) if row_major else (weight, se, sc, 1)


def _index(idx: torch.Tensor | None) -> torch.Tensor | None:
    return None if idx is None else idx.to(torch.int64).contiguous()


def _counts(counts: torch.Tensor) -> torch.Tensor:
    return counts.to(torch.int64).contiguous()


def _sorted_rows(name: str, t: torch.Tensor | None, rows: int, width: int, dtype: torch.dtype):
    if t is None:
        return None
    if tuple(t.shape) != (rows, width) or t.dtype != dtype:
        raise ValueError(f"{name} must be {_name(dtype)} of shape {(rows, width)}, got "
                         f"{tuple(t.shape)} {t.dtype}")
    return t if t.is_contiguous() else _standard(t)


def cvmm_rows(src: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor,
              in_idx: torch.Tensor | None = None, out_idx: torch.Tensor | None = None,
              scale: torch.Tensor | None = None, out_rows: int | None = None, group: int = 1,
              dot_with: torch.Tensor | None = None, relu: bool = False,
              mask_with: torch.Tensor | None = None):
    """``y_r = scale[r] · z_r`` with ``z_r = src[in_idx[r]] @ weight[e(r)]``, for
    expert-sorted rows r.

    src: [R, m]; weight: [E, m, n] (a transposed view is fine); counts: [E] rows per expert
    (P in all); in_idx: int64 [P] rows of src (None: row r); scale: [P] in sorted order or
    None. Without ``out_idx`` returns the rows ``y`` [P, n]. With it (distinct slots
    ``s_r < out_rows · group``) returns ``out [out_rows, n]`` with
    ``out[i] = Σ_{r: s_r // group = i} y_r`` added in slot order (zero where no row lands): the
    same sum for any thread count, without locks or atomics. A slot out of range raises
    IndexError; repeated slots are not allowed (not checked: they race). With ``dot_with``
    [P, n] returns ``(y or out, dots)`` where ``dots[r] = <z_r, dot_with[r]>`` (the unscaled
    rows: a gate's gradient).

    Epilogues, without ``out_idx`` only: ``relu`` returns ``max(y, 0)``; ``mask_with`` [P, n]
    zeroes ``y`` where ``mask_with <= 0`` (backward through a ReLU whose output it is).

    src, weight, dot_with and mask_with are float32, or all bfloat16 (:func:`bf16_available`):
    then the products accumulate in float32, the scale, the epilogues, the dots and the sum
    over ``out_idx`` are applied in float32, and each output element is rounded to bf16 once
    (to nearest even, as PyTorch rounds). MKL's bf16 GEMM on AMX reads subnormal bf16 inputs
    (below 1.2e-38 in magnitude) as zero.
    """
    lib = _load()
    dtype = _kernel_dtype(src)
    src = _rows("src", src, dtype)
    weight, se, ld, trans = _weight(weight, dtype)
    counts, in_idx, out_idx = _counts(counts), _index(in_idx), _index(out_idx)
    scale = None if scale is None else scale.to(torch.float32).contiguous()
    E, m, n = weight.shape
    num_rows = int(counts.sum())
    if out_idx is None:
        out_rows = num_rows
    elif out_rows is None:
        raise ValueError("out_rows is required with out_idx")
    if out_idx is not None and (relu or mask_with is not None):
        raise ValueError("relu and mask_with apply to sorted output rows, not with out_idx")
    if group < 1:
        raise ValueError(f"group must be at least 1, got {group}")
    dot_with = _sorted_rows("dot_with", dot_with, num_rows, n, dtype)
    mask_with = _sorted_rows("mask_with", mask_with, num_rows, n, dtype)
    dots = _written(num_rows) if dot_with is not None else None
    # a scatter sums its rows into float32 whatever the dtype (rounded to bf16 after)
    out = _written(out_rows, n, dtype=dtype if out_idx is None else torch.float32)
    if num_rows and n:
        call(lib, "sf_cvmm", src.data_ptr(), src.stride(0), _ptr(in_idx), weight.data_ptr(), se,
                  ld, trans, counts.data_ptr(), E, m, n, out.data_ptr(), out_rows, _ptr(out_idx),
                  group, _ptr(scale), _ptr(dot_with), _ptr(dots), int(relu), _ptr(mask_with),
                  int(dtype == torch.bfloat16), torch.get_num_threads(),
                  _chunk(max(m, n)))
    else:
        out.zero_()
        if dots is not None:
            dots.zero_()
    out = out.to(dtype)
    return out if dot_with is None else (out, dots.to(dtype))


def weight_grad(a_src: torch.Tensor, b_src: torch.Tensor, counts: torch.Tensor,
                a_idx: torch.Tensor | None = None, b_idx: torch.Tensor | None = None,
                scale: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out[e] = A_eᵀ @ B_e`` with ``A = scale · a_src[a_idx]`` [P, ma] and
    ``B = b_src[b_idx]`` [P, nb], rows expert-sorted (None: no gather / no scale).
    Returns [E, ma, nb] in ``out_dtype`` (default the inputs'); an expert with no rows gets
    an exact zero matrix.

    a_src and b_src are float32, or both bfloat16 (:func:`bf16_available`): then a scaled row
    is rounded to bf16 once, the sums accumulate in float32 and the result is rounded once."""
    lib = _load()
    dtype = _kernel_dtype(a_src)
    a_src, b_src = _rows("a_src", a_src, dtype), _rows("b_src", b_src, dtype)
    counts, a_idx, b_idx = _counts(counts), _index(a_idx), _index(b_idx)
    scale = None if scale is None else scale.to(torch.float32).contiguous()
    E, ma, nb = counts.shape[0], a_src.shape[1], b_src.shape[1]
    out = _written(E, ma, nb)
    call(lib, "sf_weight_grad", a_src.data_ptr(), a_src.stride(0), _ptr(a_idx), _ptr(scale),
              b_src.data_ptr(), b_src.stride(0), _ptr(b_idx), counts.data_ptr(), E, ma, nb,
              out.data_ptr(), int(dtype == torch.bfloat16), torch.get_num_threads(),
              _chunk(ma + nb))
    return out.to(out_dtype or dtype)


# ---------------------------------------------------------------------------------------------
# FFF trees (fff_cpu.c). Node rows [T, N = 2^d - 1], leaf rows [T, L = 2^d].

def _unit_rows(name: str, t: torch.Tensor, width: int) -> torch.Tensor:
    if t.dim() != 2 or t.shape[1] != width or t.dtype != torch.float32 or not t.is_cpu:
        raise ValueError(f"{name} must be a float32 CPU matrix [rows, {width}], got "
                         f"{tuple(t.shape)} {t.dtype} on {t.device}")
    return t if t.stride(1) == 1 else t.contiguous()


def fff_expand(node_values: torch.Tensor, depth: int, mode: int,
               node_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Leaf values [T, 2^depth] from node values [T, 2^depth - 1], level by level (modes in
    fff_cpu.c: 0 sigmoid products, 1 sums with a(-z) = a(z) - z (needs ``node_logits``),
    2 sums with a(-z) = -a(z), 3 sigmoid products given the logits)."""
    lib = _load()
    nodes = (1 << depth) - 1
    a = _unit_rows("node_values", node_values, nodes)
    z = None if node_logits is None else _unit_rows("node_logits", node_logits, nodes)
    out = _written(a.shape[0], 1 << depth)
    if a.shape[0]:
        call(lib, "sf_fff_expand", a.data_ptr(), a.stride(0), _ptr(z),
                  0 if z is None else z.stride(0), a.shape[0], depth, mode, out.data_ptr(),
                  torch.get_num_threads())
    return out


def fff_expand_backward(grad_leaf: torch.Tensor, leaf: torch.Tensor | None,
                        node_data: torch.Tensor | None, depth: int, mode: int) -> torch.Tensor:
    """The gradient [T, 2^depth - 1] of :func:`fff_expand` with respect to the node logits
    (see ``sf_fff_expand_backward``)."""
    lib = _load()
    leaves, nodes = 1 << depth, (1 << depth) - 1
    g = _unit_rows("grad_leaf", grad_leaf, leaves)
    leaf = None if leaf is None else _unit_rows("leaf", leaf, leaves)
    d = None if node_data is None else _unit_rows("node_data", node_data, nodes)
    out = _written(g.shape[0], nodes)
    if g.shape[0]:
        call(lib, "sf_fff_expand_backward", g.data_ptr(), g.stride(0), _ptr(leaf),
                  0 if leaf is None else leaf.stride(0), _ptr(d), 0 if d is None else d.stride(0),
                  g.shape[0], depth, mode, out.data_ptr(), torch.get_num_threads())
    return out


def fff_descend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                depth: int) -> torch.Tensor:
    """Greedy descent: the leaf [T] (int64) each token reaches going left where
    ``<x, w_n> + b_n > 0``. x: [T, dim]; weight: [2^depth - 1, dim]; bias: [2^depth - 1]."""
    lib = _load()
    x = _unit_rows("x", x, x.shape[-1] if x.dim() == 2 else -1)
    weight = _unit_rows("weight", weight, x.shape[1])
    if weight.shape[0] != (1 << depth) - 1:
        raise ValueError(f"weight must have 2^depth - 1 = {(1 << depth) - 1} rows, got "
                         f"{weight.shape[0]}")
    bias = None if bias is None else bias.to(torch.float32).contiguous()
    out = _written(x.shape[0], dtype=torch.int64)
    if x.shape[0]:
        call(lib, "sf_fff_descend", x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                  _ptr(bias), x.shape[0], x.shape[1], depth, out.data_ptr(),
                  torch.get_num_threads())
    return out


# ---------------------------------------------------------------------------------------------
# Single-row tables (rows_cpu.c). A pair (t, j) reads row idx[t, j] of a table [N, d]. Each
# output element is summed by one thread in a fixed order.

def _pairs(idx: torch.Tensor) -> torch.Tensor:
    if idx.dim() != 2:
        raise ValueError(f"indices must be [rows, m], got {tuple(idx.shape)}")
    return idx.to(torch.int64).contiguous()


#: The element types the row kernels (gather_dot, gather_sum, scatter_rows) take.
ROW_DTYPES = (torch.float32, torch.bfloat16)


def rows_usable(*tensors: torch.Tensor | None) -> bool:
    """True when :func:`gather_dot`, :func:`gather_sum` and :func:`scatter_rows` can take these
    tensors: CPU, float32 or bfloat16 (a bf16 table or scatter source is read, and a bf16
    result written, by the kernels themselves; the other operands are read in float32)."""
    for t in tensors:
        if t is not None and (not t.is_cpu or t.dtype not in ROW_DTYPES):
            return False
    return available()


def _table(name: str, t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """A table [N, d] the row kernels read in place (float32 or bf16), and its bf16 flag."""
    bf = int(t.dtype == torch.bfloat16)
    return _rows(name, t, torch.bfloat16 if bf else torch.float32), bf


def _float_rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """``t`` [rows, width] as the float32 matrix the row kernels read (bf16 converted
    exactly)."""
    return _rows(name, t if t.dtype != torch.bfloat16 else t.float())


def gather_dot(x: torch.Tensor, table: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``out[t, j] = <x[t], table[idx[t, j]]>``, summed in float32. x: [T, d]; table: [N, d];
    idx: [T, m]. Returns [T, m] in the promoted dtype of x and table (rounded once)."""
    lib = _load()
    out_dtype = torch.promote_types(x.dtype, table.dtype)
    x, (table, bf), idx = _float_rows("x", x), _table("table", table), _pairs(idx)
    out = _written(*idx.shape)
    if out.numel():
        call(lib, "sf_gather_dot", x.data_ptr(), x.stride(0), table.data_ptr(), table.stride(0),
                  bf, idx.data_ptr(), idx.shape[0], idx.shape[1], x.shape[1], out.data_ptr(),
                  torch.get_num_threads())
    return out.to(out_dtype)


def gather_sum(idx: torch.Tensor, weights: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``out[t] = Σ_j weights[t, j] · table[idx[t, j]]``, summed in float32. idx, weights:
    [T, m]; table: [N, d]. Returns [T, d] in the table's dtype (rounded once)."""
    lib = _load()
    idx, (table, bf) = _pairs(idx), _table("table", table)
    weights = weights.to(torch.float32).contiguous()
    out = _written(idx.shape[0], table.shape[1], dtype=table.dtype)
    if idx.shape[0]:
        call(lib, "sf_gather_sum", idx.data_ptr(), weights.data_ptr(), idx.shape[0], idx.shape[1],
                  table.data_ptr(), table.stride(0), bf, table.shape[1], out.data_ptr(),
                  out.stride(0), torch.get_num_threads())
    return out


def scatter_rows(idx: torch.Tensor, weights: torch.Tensor, src: torch.Tensor,
                 num_rows: int) -> torch.Tensor:
    """``out[i] = Σ_{(t, j): idx[t, j] = i} weights[t, j] · src[t]``, summed in float32, a dense
    [num_rows, d] in src's dtype (rounded once) with zero rows where no pair lands. idx,
    weights: [T, m]; src: [T, d]."""
    lib = _load()
    src, bf = _table("src", src)
    idx = _pairs(idx)
    weights = weights.to(torch.float32).contiguous()
    out = _written(num_rows, src.shape[1], dtype=src.dtype)
    call(lib, "sf_scatter_rows", idx.data_ptr(), weights.data_ptr(), idx.shape[0], idx.shape[1],
              src.data_ptr(), src.stride(0), num_rows, src.shape[1], out.data_ptr(), bf,
              torch.get_num_threads())
    return out


def scatter_rows_dot(idx: torch.Tensor, weights: torch.Tensor, src: torch.Tensor,
                     table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`scatter_rows` of (idx, weights, src, N) and :func:`gather_dot` of (src, table,
    idx) from one read of each pair's src row, both summed in float32. src and table: [T, d]
    and [N, d], both float32 or both bf16. Returns ([N, d] in their dtype, [T, m] in it)."""
    if src.dtype != table.dtype:
        raise ValueError(f"scatter_rows_dot: src ({src.dtype}) and table ({table.dtype}) must "
                         f"have one dtype")
    lib = _load()
    (src, bf), (table, _) = _table("src", src), _table("table", table)
    idx = _pairs(idx)
    weights = weights.to(torch.float32).contiguous()
    out = _written(*table.shape, dtype=src.dtype)
    dots = _written(*idx.shape)
    call(lib, "sf_scatter_rows_dot", idx.data_ptr(), weights.data_ptr(), idx.shape[0],
         idx.shape[1], src.data_ptr(), src.stride(0), table.data_ptr(), table.stride(0),
         table.shape[0], table.shape[1], out.data_ptr(), dots.data_ptr(), bf,
         torch.get_num_threads())
    return out, dots.to(src.dtype)


def topk_rows(scores: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row of ``scores`` [R, n], ordered by (value desc, index
    asc): (values [R, k], int64 indices [R, k])."""
    lib = _load()
    s = _rows("scores", scores)
    vals = _written(s.shape[0], k)
    ids = _written(s.shape[0], k, dtype=torch.int64)
    if s.shape[0] and k:
        call(lib, "sf_topk_rows", s.data_ptr(), s.stride(0), s.shape[0], s.shape[1], k,
                  vals.data_ptr(), ids.data_ptr(), torch.get_num_threads())
    return vals, ids


def product_key_topk(scores_a: torch.Tensor, scores_b: torch.Tensor,
                     k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Csordás et al. 2023 Eq. 15 with top-k: the top k of ``scores_a[r, i] + scores_b[r, j]`` over all
    (i, j), full index ``i + n_a · j``, ordered by (sum desc, index asc), NaN and -inf ranked
    below every finite score and +inf above (as ``kernels.rankable`` maps them); the values are
    the sums of the original scores. scores_a: [R, n_a]; scores_b: [R, n_b]. Returns (values
    [R, k], int64 indices [R, k])."""
    lib = _load()
    a, b = _rows("scores_a", scores_a), _rows("scores_b", scores_b)
    vals = _written(a.shape[0], k)
    ids = _written(a.shape[0], k, dtype=torch.int64)
    if a.shape[0] and k:
        call(lib, "sf_pk_topk", a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), a.shape[0],
                  a.shape[1], b.shape[1], k, vals.data_ptr(), ids.data_ptr(),
                  torch.get_num_threads())
    return vals, ids


# ---------------------------------------------------------------------------------------------
# MLP experts for a few tokens (pairs_cpu.c)

#: Activation codes of ``sf_mlp_pairs`` by the names of ``sparseffn.activations``.
PAIR_ACTIVATIONS = {"relu": 0, "gelu": 1, "gelu_tanh": 2, "silu": 3, "quick_gelu": 4}


def mlp_pairs_usable(x: torch.Tensor, gates: torch.Tensor | None, w1: torch.Tensor,
                     w2: torch.Tensor, b1: torch.Tensor | None, b2: torch.Tensor | None,
                     w_gate: torch.Tensor | None, activation: str) -> bool:
    """True when :func:`mlp_pairs` takes these tensors: CPU float32 (:func:`usable`), an
    activation it knows, and the expert tensors (weights, biases) with a unit last stride, so
    that they are read in place."""
    if activation not in PAIR_ACTIVATIONS:
        return False
    for t in (w1, w2, b1, b2, w_gate):   # a loop, not all(<generator>): every decoding call
        if t is not None and t.stride(-1) != 1:
            return False
    return usable(x, gates, w1, w2, b1, b2, w_gate)


def _expert_rows(name: str, t: torch.Tensor | None, experts: int, rows: int, width: int
                 ) -> tuple[torch.Tensor | None, int, int]:
    """An expert tensor [E, rows, width] (or [E, width] with ``rows`` 0) in place, as
    (tensor, expert stride, row stride): float32 on the CPU with a unit last stride."""
    if t is None:
        return None, 0, 0
    shape = (experts, rows, width) if rows else (experts, width)
    if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_cpu or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a float32 CPU tensor of shape {shape} with a unit "
                         f"last stride, got {tuple(t.shape)} {t.dtype} on {t.device} with "
                         f"strides {t.stride()}")
    return t, t.stride(0), t.stride(1) if rows else 0


def mlp_pairs(x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor | None,
              w1: torch.Tensor, w2: torch.Tensor, activation: str = "relu",
              b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
              w_gate: torch.Tensor | None = None,
              keep: torch.Tensor | None = None) -> torch.Tensor:
    """``y[t] = Σ_j g[t, j] · f_{e[t, j]}(x[t])`` over each token's k experts, with
    ``f_e(x) = act(x W1_eᵀ + b1_e) W2_e + b2_e`` (gated: ``(act(x Wg_eᵀ) ⊙ (x W1_eᵀ + b1_e))
    W2_e + b2_e``), read from the weights in place (see ``pairs_cpu.c``).

    x: [T, m]; indices: [T, k] experts (in range: not checked here); gates: [T, k] or None
    (ones); w1, w_gate: [E, G, m]; w2: [E, G, n]; b1: [E, G]; b2: [E, n]; keep: bool [T, k]
    or None: pairs where it is False are never computed and add exactly zero. Every tensor
    float32 on the CPU, weights with a unit last stride. Returns float32 [T, n]."""
    lib = _load()
    if activation not in PAIR_ACTIVATIONS:
        raise ValueError(f"activation must be one of {tuple(PAIR_ACTIVATIONS)}, got "
                         f"{activation!r}")
    idx = _pairs(indices)
    tokens, k = idx.shape
    experts, width, m = w1.shape
    n = w2.shape[-1]
    x = _rows("x", x)
    if x.shape != (tokens, m):
        raise ValueError(f"x must be [{tokens}, {m}], got {tuple(x.shape)}")
    w1, w1_se, w1_sr = _expert_rows("w1", w1, experts, width, m)
    w2, w2_se, w2_sr = _expert_rows("w2", w2, experts, width, n)
    wg, wg_se, wg_sr = _expert_rows("w_gate", w_gate, experts, width, m)
    b1, b1_se, _ = _expert_rows("b1", b1, experts, 0, width)
    b2, b2_se, _ = _expert_rows("b2", b2, experts, 0, n)
    gates = None if gates is None else gates.to(torch.float32).reshape(tokens * k).contiguous()
    if keep is not None:
        if keep.dtype != torch.bool or tuple(keep.shape) != (tokens, k):
            raise ValueError(f"keep must be bool [{tokens}, {k}], got {keep.dtype} "
                             f"{tuple(keep.shape)}")
        keep = keep.contiguous()
    out = _written(tokens, n)
    if tokens and n:
        call(lib, "sf_mlp_pairs", x.data_ptr(), x.stride(0), idx.data_ptr(), _ptr(gates),
             _ptr(keep), tokens, k, w1.data_ptr(), w1_se, w1_sr, _ptr(wg), wg_se, wg_sr,
             _ptr(b1), b1_se, w2.data_ptr(), w2_se, w2_sr, _ptr(b2), b2_se, m, width, n,
             PAIR_ACTIVATIONS[activation], out.data_ptr(), torch.get_num_threads())
    return out
