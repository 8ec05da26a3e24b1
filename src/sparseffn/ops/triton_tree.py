"""Triton kernels for fast feed-forward trees on GPUs (``sparseffn::fff_expand``,
``fff_expand_backward``, ``fff_descend``).

Tree layout as in :mod:`~sparseffn.ops.fff`: nodes in heap order (level l holds nodes
``[2^l - 1, 2^(l+1) - 1)``, node n's children 2n + 1 and 2n + 2), leaves left to right.

- ``expand``: the levelwise expansion of Chaunin & Mikhailovskiy's Eq. 7 (and the product of
  sigmoids of Eq. 3-6). One program holds BLOCK_T tokens' rows in registers and walks the d
  levels top-down (σ(z) computed in the kernel in mode 3), each level's 2^l values becoming
  the next level's 2^(l+1) by an interleave of the two children: O(L) work per token in one
  launch, where the PyTorch form launches several kernels per level (at small batches the
  launches are the cost). The children are computed exactly as the C kernel and the PyTorch
  path compute them (``left = cur·p``, ``right = cur - left`` ...), in fp32. Modes are
  ``kernels.FFF_*``.
- ``expand_backward``: the bottom-up sweep of the same cost. Each level's gradient row is
  split into its (left, right) children, the node's gradient written, and the pair summed
  into the parent's.
- ``descend``: greedy hard inference (Chaunin & Mikhailovskiy §1.2). One program takes
  BLOCK_T tokens through all d levels: at each level it reads the current node's weight row
  for each token (a gathered load), accumulates ``<x, w_node>`` in fp32 and turns. d dot
  products per token in one launch, instead of d gathers, products and compares.

Rows are kept whole in registers, so ``expand`` takes depths up to ``MAX_DEPTH``; deeper trees
take the PyTorch path. Without a GPU the kernels run on CPU tensors in Triton's interpreter
(see :mod:`~sparseffn.ops.triton_cvmm`).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import triton_cvmm
from .triton_cvmm import _rowwise, cdiv, next_power_of_2, tl, triton
from .written import written_in_full

# A row of 2^MAX_DEPTH leaf values (64 KiB in fp32) is the most one program keeps in registers.
MAX_DEPTH = 14
# Elements of a [BLOCK_T, L] block: small trees put several tokens in one program.
_BLOCK_ELEMENTS = 2048


def usable(depth: int, *tensors: Optional[Tensor]) -> bool:
    """True when these kernels take a tree of this depth and these tensors (Triton present
    and enabled; CUDA tensors, or CPU tensors under the interpreter; fp32, fp16 or bf16)."""
    return 1 <= depth <= MAX_DEPTH and triton_cvmm.usable(0, *tensors)


def descend_usable(*tensors: Optional[Tensor]) -> bool:
    """True when the descent kernel takes these tensors (any depth)."""
    return triton_cvmm.usable(0, *tensors)


if triton is not None:

    @triton.jit
    def _expand_kernel(a_ptr, z_ptr, out_ptr, T, stride_a, stride_z, stride_out,
                       DEPTH: tl.constexpr, MODE: tl.constexpr, BLOCK_T: tl.constexpr):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = ts < T
        ts64 = ts.to(tl.int64)
        if MODE == 0 or MODE == 3:
            values = tl.full((BLOCK_T, 1), 1.0, tl.float32)
        else:
            values = tl.zeros((BLOCK_T, 1), tl.float32)
        for level in tl.static_range(DEPTH):
            nodes = (1 << level) - 1 + tl.arange(0, 1 << level)
            mask = t_ok[:, None] & (nodes >= 0)[None, :]
            al = tl.load(a_ptr + ts64[:, None] * stride_a + nodes[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            if MODE == 0 or MODE == 3:    # product of sigmoids (Eq. 3-6): p = σ(z)
                if MODE == 3:
                    al = tl.sigmoid(al)
                left = values * al
                right = values - left
            elif MODE == 1:    # Eq. 7 with a(-z) = a(z) - z
                left = values + al
                zl = tl.load(z_ptr + ts64[:, None] * stride_z + nodes[None, :], mask=mask,
                             other=0.0).to(tl.float32)
                right = left - zl
            else:              # linear: a(-z) = -a(z)
                left = values + al
                right = values - al
            values = tl.interleave(left, right)            # [BLOCK_T, 2^(level+1)]
        leaves = tl.arange(0, 1 << DEPTH)
        tl.store(out_ptr + ts64[:, None] * stride_out + leaves[None, :],
                 values.to(out_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & (leaves >= 0)[None, :])

    @triton.jit
    def _expand_backward_kernel(g_ptr, leaf_ptr, d_ptr, out_ptr, T, stride_g, stride_leaf,
                                stride_d, stride_out, DEPTH: tl.constexpr, MODE: tl.constexpr,
                                BLOCK_T: tl.constexpr):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = ts < T
        ts64 = ts.to(tl.int64)
        leaves = tl.arange(0, 1 << DEPTH)
        row_mask = t_ok[:, None] & (leaves >= 0)[None, :]
        g = tl.load(g_ptr + ts64[:, None] * stride_g + leaves[None, :], mask=row_mask,
                    other=0.0).to(tl.float32)
        if MODE == 0 or MODE == 3:   # the log-space gradient: dLoss/dR_i · R_i
            g = g * tl.load(leaf_ptr + ts64[:, None] * stride_leaf + leaves[None, :],
                            mask=row_mask, other=0.0).to(tl.float32)
        for level in tl.static_range(DEPTH - 1, -1, -1):
            pairs = tl.reshape(g, (BLOCK_T, 1 << level, 2))
            g0, g1 = tl.split(pairs)                       # left, right children [BLOCK_T, 2^l]
            s = g0 + g1
            nodes = (1 << level) - 1 + tl.arange(0, 1 << level)
            mask = t_ok[:, None] & (nodes >= 0)[None, :]
            if MODE == 2:
                gz = g0 - g1
            else:
                dl = tl.load(d_ptr + ts64[:, None] * stride_d + nodes[None, :], mask=mask,
                             other=0.0).to(tl.float32)
                if MODE == 3:
                    dl = tl.sigmoid(dl)
                if MODE == 0 or MODE == 3:   # a'(z) = 1 - σ(z) for log-sigmoid
                    gz = s * (1.0 - dl) - g1
                else:
                    gz = s * dl - g1
            tl.store(out_ptr + ts64[:, None] * stride_out + nodes[None, :],
                     gz.to(out_ptr.dtype.element_ty), mask=mask)
            g = s

    @triton.jit
    def _descend_kernel(x_ptr, w_ptr, b_ptr, out_ptr, T, dim, depth, stride_x, stride_w,
                        HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
        ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        t_ok = ts < T
        ts64 = ts.to(tl.int64)
        node = tl.zeros((BLOCK_T,), tl.int64)
        for _ in range(0, depth):
            acc = tl.zeros((BLOCK_T, BLOCK_D), tl.float32)
            for d0 in range(0, dim, BLOCK_D):
                ds = d0 + tl.arange(0, BLOCK_D)
                mask = t_ok[:, None] & (ds < dim)[None, :]
                xv = tl.load(x_ptr + ts64[:, None] * stride_x + ds[None, :], mask=mask,
                             other=0.0).to(tl.float32)
                wv = tl.load(w_ptr + node[:, None] * stride_w + ds[None, :], mask=mask,
                             other=0.0).to(tl.float32)
                acc += xv * wv
            z = tl.sum(acc, 1)
            if HAS_BIAS:
                z += tl.load(b_ptr + node, mask=t_ok, other=0.0).to(tl.float32)
            # left (2n + 1) where z > 0, right otherwise (NaN included, as the C kernel)
            node = 2 * node + 2 - (z > 0).to(tl.int64)
        first_leaf = (tl.full((BLOCK_T,), 1, tl.int64) << depth) - 1
        tl.store(out_ptr + ts64, node - first_leaf, mask=t_ok)


def _block_tokens(depth: int) -> int:
    return max(1, _BLOCK_ELEMENTS >> depth)


def _num_warps(depth: int, block_t: int) -> int:
    return max(1, min(8, (block_t << depth) // 256))


@written_in_full()
def expand(node_values: Tensor, depth: int, mode: int, node_logits: Optional[Tensor]) -> Tensor:
    """``sparseffn::fff_expand`` in Triton: leaf values [T, 2^depth] in the node values' dtype
    from node values [T, 2^depth - 1] (and, in mode 1, the node logits)."""
    a = _rowwise(node_values)
    z = a if node_logits is None else _rowwise(node_logits)
    tokens = a.shape[0]
    out = a.new_empty(tokens, 1 << depth)
    if tokens:
        block_t = _block_tokens(depth)
        _expand_kernel[(cdiv(tokens, block_t),)](
            a, z, out, tokens, a.stride(0), z.stride(0), out.stride(0), DEPTH=depth, MODE=mode,
            BLOCK_T=block_t, num_warps=_num_warps(depth, block_t))
    return out


@written_in_full()
def expand_backward(grad_leaf: Tensor, leaf: Optional[Tensor], node_data: Optional[Tensor],
                    depth: int, mode: int) -> Tensor:
    """``sparseffn::fff_expand_backward`` in Triton: the gradient [T, 2^depth - 1] in the
    gradient's dtype."""
    g = _rowwise(grad_leaf)
    leaf = g if leaf is None else _rowwise(leaf)
    d = g if node_data is None else _rowwise(node_data)
    tokens = g.shape[0]
    out = g.new_empty(tokens, (1 << depth) - 1)
    if tokens:
        block_t = _block_tokens(depth)
        _expand_backward_kernel[(cdiv(tokens, block_t),)](
            g, leaf, d, out, tokens, g.stride(0), leaf.stride(0), d.stride(0), out.stride(0),
            DEPTH=depth, MODE=mode, BLOCK_T=block_t, num_warps=_num_warps(depth, block_t))
    return out


@written_in_full()
def descend(x: Tensor, weight: Tensor, bias: Optional[Tensor], depth: int,
            block_t: Optional[int] = None, block_d: Optional[int] = None) -> Tensor:
    """``sparseffn::fff_descend`` in Triton: int64 [T] leaves. Node logits are accumulated in
    fp32 whatever the inputs' dtype."""
    x, weight = _rowwise(x), _rowwise(weight)
    tokens, dim = x.shape
    out = torch.empty(tokens, dtype=torch.int64, device=x.device)
    if tokens:
        block_d = block_d or min(1024, next_power_of_2(max(dim, 16)))
        block_t = block_t or max(1, min(16, 4096 // block_d))
        _descend_kernel[(cdiv(tokens, block_t),)](
            x, weight, x if bias is None else bias.contiguous(), out, tokens, dim, depth,
            x.stride(0), weight.stride(0), HAS_BIAS=bias is not None, BLOCK_T=block_t,
            BLOCK_D=block_d, num_warps=4)
    return out
