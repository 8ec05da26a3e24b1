"""CVMM: conditional vector-matrix multiplication (seed 001 App. B.1, Eq. 40).

``CVMM(V, S, M)[n] = V[n] @ M[S[n]]``: every row is multiplied by the matrix its index
selects. A mixture-of-experts layer is two CVMMs with an activation between them::

    plan = DispatchPlan.build(indices, num_experts)        # indices: [..., k]
    hidden = cvmm(x, plan, w1)                               # [..., k, expert_size]
    y = cvmm(torch.relu(hidden), plan, w2, gates=weights)    # [..., d_model]

How it runs (the same on every device): the ``(token, slot)`` pairs are sorted by expert once
(:class:`DispatchPlan`), the rows are gathered into that order, each expert's contiguous block
is multiplied by its matrix (:func:`grouped_mm`), and the results are scattered back, either
per slot or summed over the k slots with the gate weights.

Memory: the autograd function saves the *input* once (not its k gathered copies) plus the
permutation, and gathers again in backward. With gates it never keeps the expert outputs: the
gate gradient is ``<dy, x W> = <dy W^T, x>``, and ``dy W^T`` is needed for the input gradient
anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import native
from .grouped_mm import grouped_mm, grouped_weight_grad


@dataclass(frozen=True)
class DispatchPlan:
    """The sort of ``(token, slot)`` pairs by expert, shared by every CVMM of one routing.

    Attributes (P = the dispatched pairs: tokens × k, less any a router dropped):
      index_shape: the shape of ``indices``, ``(*batch, k)``.
      num_experts: E.
      order: int64 [P]; ``order[r]`` is the flat pair id (``token * k + slot``) of sorted row r.
        A pair outside ``order`` (dropped at capacity) is never computed; its slot output is
        zero and its gate gets zero gradient.
      token_of_row: int64 [P]; ``order // k``, the token each sorted row reads.
      counts: E python ints, pairs per expert.
      offsets: int32 [E], ``cumsum(counts)``, the end of each expert's block.
      count_tensor: int64 [E], ``counts`` as a tensor (for the fused CPU kernels).
    """

    index_shape: tuple[int, ...]
    num_experts: int
    order: torch.Tensor
    token_of_row: torch.Tensor
    counts: list[int]
    offsets: torch.Tensor
    count_tensor: torch.Tensor

    @property
    def k(self) -> int:
        return self.index_shape[-1]

    @property
    def num_pairs(self) -> int:
        return self.order.shape[0]

    @property
    def num_slots(self) -> int:
        """tokens × k, dispatched or not."""
        return math.prod(self.index_shape)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.index_shape[:-1])

    @property
    def has_dropped(self) -> bool:
        return self.num_pairs != self.num_slots

    @staticmethod
    def build(indices: torch.Tensor, num_experts: int,
              dispatched: torch.Tensor | None = None) -> "DispatchPlan":
        """indices: integer tensor [..., k] of experts in ``[0, num_experts)``.

        dispatched: optional bool [..., k]; pairs where it is False (tokens dropped at an
        expert's capacity, seed 001 §4 "Switch Transformer") are left out of the plan.
        """
        if indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"expert indices must be an integer tensor, got {indices.dtype}")
        if indices.dim() < 1:
            raise ValueError("expert indices must have shape [..., k], got a scalar")
        flat = indices.reshape(-1).long()
        if flat.numel():
            low, high = int(flat.min()), int(flat.max())
            if low < 0 or high >= num_experts:
                raise ValueError(
                    f"expert indices must lie in [0, {num_experts}), got values in [{low}, {high}]"
                )
        if dispatched is not None:
            if dispatched.shape != indices.shape or dispatched.dtype != torch.bool:
                raise ValueError(f"dispatched must be a bool tensor of the indices' shape "
                                 f"{tuple(indices.shape)}, got {dispatched.dtype} "
                                 f"{tuple(dispatched.shape)}")
            keep = dispatched.reshape(-1)
            # Dropped pairs sort after every expert (key num_experts) and are cut off.
            keys = flat.masked_fill(~keep, num_experts)
            order = torch.sort(keys, stable=True).indices[:int(keep.sum())]
            counts_t = torch.bincount(flat[keep], minlength=num_experts)
        else:
            # A stable sort keeps each expert's pairs in token order (deterministic results).
            order = torch.sort(flat, stable=True).indices
            counts_t = torch.bincount(flat, minlength=num_experts)
        k = indices.shape[-1]
        return DispatchPlan(
            index_shape=tuple(indices.shape),
            num_experts=num_experts,
            order=order,
            token_of_row=order // k if k else order,
            counts=counts_t.tolist(),
            offsets=counts_t.cumsum(0).to(torch.int32),
            count_tensor=counts_t,
        )


# Where the rows of a CVMM input come from / where its output rows go:
_TOKEN = "token"    # one row per token, shared by its k slots (input only)
_SLOT = "slot"      # one row per (token, slot) pair, in pair order
_SORTED = "sorted"  # one row per pair, already in the plan's expert-sorted order
_GATED = "gated"    # one row per token: the gate-weighted sum over its k slots (output only)


def _rows_from(source: torch.Tensor, layout: str, order: torch.Tensor,
               token_of_row: torch.Tensor) -> torch.Tensor:
    """Gather ``source`` (in ``layout``) into expert-sorted rows [P, ·]."""
    if layout == _SORTED:
        return source
    return source.index_select(0, token_of_row if layout in (_TOKEN, _GATED) else order)


def _rows_to(rows: torch.Tensor, layout: str, num_tokens: int, order: torch.Tensor,
             token_of_row: torch.Tensor, num_slots: int | None = None) -> torch.Tensor:
    """Scatter expert-sorted rows [P, ·] into ``layout`` (summing over slots for per-token).

    num_slots: rows of the per-slot layout; more than P when pairs were dropped (left zero).
    """
    if layout == _SORTED:
        return rows
    if layout == _SLOT:
        if num_slots is not None and num_slots != rows.shape[0]:
            return rows.new_zeros(num_slots, rows.shape[1]).index_copy_(0, order, rows)
        return torch.empty_like(rows).index_copy_(0, order, rows)
    return rows.new_zeros(num_tokens, rows.shape[1]).index_add_(0, token_of_row, rows)


class _CVMM(torch.autograd.Function):
    """Autograd for :func:`cvmm` on flattened 2-D tensors.

    x2: [T, m] (``in_layout="token"``) or [P, m] (``"slot"`` / ``"sorted"``); weight:
    [E, m, n]; gates: [P] in pair order, or None. Output: [T, n] summed over each token's k
    pairs with the gates (``out_layout="gated"``), or [P, n] (``"slot"`` / ``"sorted"``).
    """

    @staticmethod
    def forward(ctx, x2, weight, gates, plan: DispatchPlan, in_layout: str, out_layout: str):
        order, token_of_row = plan.order, plan.token_of_row
        # The permutation is saved like any tensor (so memory accounting sees it); the input
        # is saved once, not as its k gathered copies.
        ctx.save_for_backward(x2, weight, gates, order, token_of_row)
        ctx.plan = plan
        ctx.in_layout, ctx.out_layout = in_layout, out_layout
        ctx.fused = native.usable(x2, weight, gates)
        if ctx.fused:   # gather, multiply and scatter in L2-sized chunks (ops/native)
            gate_rows = gates.index_select(0, order) if gates is not None else None
            return native.cvmm_rows(
                x2, weight, plan.count_tensor, in_idx=_index_of(in_layout, order, token_of_row),
                out_idx=_index_of(out_layout, order, token_of_row), scale=gate_rows,
                out_rows=plan.num_tokens if out_layout == _GATED else
                plan.num_pairs if out_layout == _SORTED else plan.num_slots)
        rows = _rows_from(x2, in_layout, order, token_of_row)          # [P, m], by expert
        gate_rows = gates.index_select(0, order).unsqueeze(1) if gates is not None else None
        m, n = weight.shape[1], weight.shape[2]
        if gate_rows is not None and m <= n:   # g · (x W) = (g · x) W: scale the narrower side
            rows = rows * gate_rows
        out_rows = grouped_mm(rows, weight, plan.counts, plan.offsets)  # [P, n]
        if gate_rows is not None and m > n:
            out_rows.mul_(gate_rows)
        return _rows_to(out_rows, out_layout, plan.num_tokens, order, token_of_row, plan.num_slots)

    @staticmethod
    def backward(ctx, grad_out):
        if ctx.fused and native.usable(grad_out):
            return _CVMM._fused_backward(ctx, grad_out)
        x2, weight, gates, order, token_of_row = ctx.saved_tensors
        counts, offsets = ctx.plan.counts, ctx.plan.offsets
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        grad_rows = _rows_from(grad_out, ctx.out_layout, order, token_of_row)  # [P, n], ungated
        rows = _rows_from(x2, ctx.in_layout, order, token_of_row) if (need_w or need_g) else None
        gate_rows = gates.index_select(0, order).unsqueeze(1) if gates is not None else None
        grad_x = grad_w = grad_g = None

        if need_x or need_g:
            grad_rows_in = grouped_mm(grad_rows, weight.transpose(1, 2), counts, offsets)  # [P, m]
            if need_g:   # d/dg <dy, g · x W> = <dy W^T, x>
                grad_g = _pairs_to_slots(gates, order, (grad_rows_in * rows).sum(1))
            if need_x:
                if gate_rows is not None:
                    grad_rows_in.mul_(gate_rows)
                grad_x = _rows_to(grad_rows_in, ctx.in_layout, x2.shape[0], order, token_of_row,
                                  x2.shape[0])
        if need_w:
            if gate_rows is not None:   # Σ g x^T dy: scale the narrower side
                if rows.shape[1] <= grad_rows.shape[1]:
                    rows = rows * gate_rows
                else:
                    grad_rows = grad_rows * gate_rows
            grad_w = grouped_weight_grad(rows, grad_rows, counts, offsets)
        return grad_x, grad_w, grad_g, None, None, None

    @staticmethod
    def _fused_backward(ctx, grad_out):
        x2, weight, gates, order, token_of_row = ctx.saved_tensors
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        in_idx = _index_of(ctx.in_layout, order, token_of_row)
        out_idx = _index_of(ctx.out_layout, order, token_of_row)
        counts = ctx.plan.count_tensor
        gate_rows = gates.index_select(0, order) if gates is not None else None
        weight_t = weight.transpose(1, 2)
        grad_x = grad_w = grad_g = None
        if need_g:   # d/dg <dy, g · x W> = <dy W^T, x>, dotted inside the kernel
            rows = _rows_from(x2, ctx.in_layout, order, token_of_row)            # [P, m]
            scaled, dots = native.cvmm_rows(grad_out, weight_t, counts, in_idx=out_idx,
                                            scale=gate_rows, dot_with=rows)   # g · dy W^T
            grad_g = _pairs_to_slots(gates, order, dots)
            if need_x:
                grad_x = _rows_to(scaled, ctx.in_layout, x2.shape[0], order, token_of_row,
                                  x2.shape[0])
        elif need_x:   # dx = Σ g · dy W^T, scattered straight back to the input's layout
            grad_x = native.cvmm_rows(grad_out, weight_t, counts, in_idx=out_idx, out_idx=in_idx,
                                      scale=gate_rows, out_rows=x2.shape[0])
        if need_w:   # dW_e = Σ_r g_r x_r^T dy_r; the gate scales the narrower side
            if weight.shape[1] <= weight.shape[2]:
                grad_w = native.weight_grad(x2, grad_out, counts, a_idx=in_idx, b_idx=out_idx,
                                            scale=gate_rows)
            else:   # computed as [E, n, m] (wide output rows) and returned transposed
                grad_w = native.weight_grad(grad_out, x2, counts, a_idx=out_idx, b_idx=in_idx,
                                            scale=gate_rows).transpose(1, 2)
        return grad_x, grad_w, grad_g, None, None, None


def _pairs_to_slots(gates: torch.Tensor, order: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-pair values [P] in sorted order back to slot order [T·k]; dropped slots get 0."""
    if order.shape[0] == gates.shape[0]:
        return torch.empty_like(gates).index_copy_(0, order, values)
    return torch.zeros_like(gates).index_copy_(0, order, values)


def _index_of(layout: str, order: torch.Tensor, token_of_row: torch.Tensor) -> torch.Tensor | None:
    """Which row of a tensor in ``layout`` each expert-sorted row reads or writes."""
    if layout == _SORTED:
        return None
    return order if layout == _SLOT else token_of_row


def cvmm(x: torch.Tensor, plan: DispatchPlan, weight: torch.Tensor,
         gates: torch.Tensor | None = None, *, sorted_input: bool = False,
         sorted_output: bool = False) -> torch.Tensor:
    """Multiply each (token, slot) row by the matrix of its expert.

    Args:
      x: ``[*batch, m]`` (one input per token, shared by its k slots), ``[*batch, k, m]`` (one
        input per slot), or with ``sorted_input=True`` ``[P, m]`` rows already in the plan's
        expert-sorted order (the output of a ``sorted_output=True`` call).
      plan: :meth:`DispatchPlan.build` of the ``[*batch, k]`` expert indices.
      weight: ``[num_experts, m, n]``.
      gates: optional ``[*batch, k]`` weights; with them the k results of a token are summed,
        ``out[t] = Σ_j gates[t, j] · x_(t,j) @ weight[indices[t, j]]``.
      sorted_output: without gates, return ``[P, n]`` rows in expert-sorted order instead of
        ``[*batch, k, n]``; chaining two CVMMs this way skips a permutation each way.

    Returns ``[*batch, n]`` with gates, else ``[*batch, k, n]`` (or ``[P, n]`` if sorted).
    """
    batch, k = plan.index_shape[:-1], plan.k
    if weight.dim() != 3 or weight.shape[0] != plan.num_experts:
        raise ValueError(f"weight must have shape [num_experts={plan.num_experts}, m, n], "
                         f"got {tuple(weight.shape)}")
    m, n = weight.shape[1], weight.shape[2]
    if sorted_input:
        expected = [(plan.num_pairs, m)]
        in_layout = _SORTED
    elif tuple(x.shape) == (*batch, m):
        expected, in_layout = [], _TOKEN
    elif tuple(x.shape) == (*batch, k, m):
        expected, in_layout = [], _SLOT
    else:
        expected, in_layout = [(*batch, m), (*batch, k, m)], None
    if in_layout is None or (expected and tuple(x.shape) not in expected):
        raise ValueError(
            f"cvmm input must have shape {' or '.join(map(str, expected))} for indices of "
            f"shape {plan.index_shape} and weight of shape {tuple(weight.shape)}, "
            f"got {tuple(x.shape)}")
    if gates is not None and tuple(gates.shape) != plan.index_shape:
        raise ValueError(f"gates must have the shape of the indices {plan.index_shape}, "
                         f"got {tuple(gates.shape)}")
    if gates is not None and sorted_output:
        raise ValueError("sorted_output applies only without gates (gates sum the k slots)")
    if torch.is_autocast_enabled(x.device.type):
        dtype = torch.get_autocast_dtype(x.device.type)
        x, weight = x.to(dtype), weight.to(dtype)
    if x.dtype != weight.dtype:
        raise TypeError(f"cvmm input and weight must have the same dtype, got {x.dtype} and "
                        f"{weight.dtype} (convert the layer with .to(dtype) or use autocast)")
    x2 = x.reshape(-1, m)
    if gates is not None:
        gates = gates.reshape(-1).to(x.dtype)
    out_layout = _GATED if gates is not None else (_SORTED if sorted_output else _SLOT)
    out = _CVMM.apply(x2, weight, gates, plan, in_layout, out_layout)
    if out_layout == _GATED:
        return out.reshape(*batch, n)
    return out if out_layout == _SORTED else out.reshape(*batch, k, n)
