"""CVMM: conditional vector-matrix multiplication (Csordás et al. 2023 App. B.1, Eq. 40).

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

import functools
import math
from dataclasses import dataclass

import torch

from . import kernels, portable, triton_plan
from .debug import indices_outside
from .grad_mode import differentiable_once, gradients_of
from .ids import id_dtype
from .precision import autocast_dtype
from .sizes import exporting


@dataclass(frozen=True)
class DispatchPlan:
    """The sort of ``(token, slot)`` pairs by expert, shared by every CVMM of one routing.

    Everything that depends on the routing is a tensor, so building and using a plan reads
    nothing on the host (no device synchronisation on a GPU, no graph break under
    ``torch.compile``); its shapes depend only on the shape of the indices.

    Attributes (S = tokens × k slots; D = the dispatched pairs, S less any a router dropped):
      index_shape: the shape of ``indices``, ``(*batch, k)``.
      num_experts: E.
      order: int64 [S]; ``order[r]`` is the flat pair id (``token * k + slot``) of sorted row
        r. The D dispatched pairs come first, grouped by expert, each expert's in token
        order; the pairs dropped at capacity come last. They are never computed: their slot
        output is zero and their gate gets zero gradient.
      token_of_row: int64 [S]; ``order // k``, the token each sorted row reads.
      counts: int64 [E], dispatched pairs per expert (``Σ counts = D``).
      mass: float32 [E] or None: the routing weights of each expert's dispatched pairs summed
        (the usage statistics' mass), where :meth:`build` got the weights and its counting
        sort summed them on the way; None elsewhere.
    """

    index_shape: tuple[int, ...]
    num_experts: int
    order: torch.Tensor
    token_of_row: torch.Tensor
    counts: torch.Tensor
    mass: torch.Tensor | None = None

    @property
    def k(self) -> int:
        return self.index_shape[-1]

    @property
    def offsets(self) -> torch.Tensor:
        """int32 [E], ``cumsum(counts)``: the end of each expert's block (the ``offs`` of
        ``torch._grouped_mm``), computed when asked (no operator here needs it)."""
        return self.counts.cumsum(0).to(torch.int32)

    @property
    def num_rows(self) -> int:
        """Sorted rows: tokens × k (dispatched pairs first, then dropped ones)."""
        return self.order.shape[0]

    @property
    def num_slots(self) -> int:
        """tokens × k, dispatched or not."""
        return math.prod(self.index_shape)

    @property
    def num_tokens(self) -> int:
        return math.prod(self.index_shape[:-1])

    def num_dispatched(self) -> torch.Tensor:
        """D, the dispatched pairs, as an int64 scalar tensor."""
        return self.counts.sum()

    @staticmethod
    def build(indices: torch.Tensor, num_experts: int, dispatched: torch.Tensor | None = None,
              weights: torch.Tensor | None = None) -> "DispatchPlan":
        """indices: integer tensor [..., k] of experts in ``[0, num_experts)``.

        dispatched: optional bool [..., k]; pairs where it is False (tokens dropped at an
        expert's capacity, Fedus et al. 2022) sort after every expert and are never computed.

        weights: optional float [..., k], the routing weights (not differentiated): where the
        counting sort builds the plan, it also sums them per expert (``mass``) at no extra
        launch, for the usage statistics.

        Out-of-range indices raise a ValueError on CPU tensors (a host read is free there) and,
        on other devices, when :func:`sparseffn.ops.debug.set_checks` is on; never while
        ``torch.compile`` traces. Unchecked, the counting sort (CUDA with Triton,
        :func:`expert_order`) treats them as dropped pairs.
        """
        if indices.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
            raise TypeError(f"expert indices must be an integer tensor, got {indices.dtype}")
        if indices.dim() < 1:
            raise ValueError("expert indices must have shape [..., k], got a scalar")
        flat = indices.reshape(-1).long()
        check_expert_indices(flat, num_experts)
        keys = flat
        if dispatched is not None:
            if dispatched.shape != indices.shape or dispatched.dtype != torch.bool:
                raise ValueError(f"dispatched must be a bool tensor of the indices' shape "
                                 f"{tuple(indices.shape)}, got {dispatched.dtype} "
                                 f"{tuple(dispatched.shape)}")
            # Dropped pairs get the key num_experts: they sort after every expert.
            keys = flat.masked_fill(~dispatched.reshape(-1), num_experts)
        if weights is not None and weights.shape != indices.shape:
            raise ValueError(f"weights must have the indices' shape {tuple(indices.shape)}, "
                             f"got {tuple(weights.shape)}")
        k = indices.shape[-1]
        mass = None
        # A stable sort keeps each expert's pairs in token order (deterministic results).
        if not exporting() and triton_plan.usable(keys, num_experts):
            if weights is not None:
                weights = weights.detach().reshape(-1)
            order, token_of_row, counts, mass = expert_order(keys, num_experts, k, weights)
            mass = mass if weights is not None else None
        else:
            order, token_of_row, counts = _expert_order_torch(keys, num_experts, k)
        return DispatchPlan(
            index_shape=tuple(indices.shape),
            num_experts=num_experts,
            order=order,
            token_of_row=token_of_row,
            counts=counts,
            mass=mass,
        )


def _expert_order_torch(keys: torch.Tensor, num_experts: int,
                        k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`expert_order` in PyTorch ops: a stable sort, the experts' block boundaries, and
    each row's token."""
    sorted_keys, order = stable_sort_ids(keys, num_experts + 1)
    # (no builtin max: PyTorch 2.8-2.9's non-strict export replaces it by a function that
    # Dynamo refuses to trace inside torch.cond's branches, as in stable_sort_ids)
    return order, order // k if k else order, _expert_counts(sorted_keys, num_experts)


@kernels.operator("expert_order")
def expert_order(keys: torch.Tensor, num_experts: int, k: int,
                 weights: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs ``token · k + slot`` sorted stably by expert. keys: integer [S], each pair's
    expert in ``[0, num_experts)`` or ``num_experts`` (dropped at capacity: sorted last);
    weights: optional float [S].

    Returns ``(order, token_of_row, counts, mass)``, int64 [S], [S] (``order // k``), [E]
    (the dispatched pairs of each expert) and float32 [E] (their weights summed; empty
    without weights). On CUDA with Triton, a counting sort in two launches
    (:mod:`~sparseffn.ops.triton_plan`); elsewhere a stable ``torch.sort`` and a
    ``searchsorted`` of the experts' boundaries. The same order and counts either way; the
    mass to float32 rounding (summed in another order)."""
    if triton_plan.usable(keys, num_experts):
        return triton_plan.expert_order(keys, num_experts, k, weights)
    order, token_of_row, counts = _expert_order_torch(keys, num_experts, k)
    if weights is None:
        return order, token_of_row, counts, keys.new_empty(0, dtype=torch.float32)
    # (as the kernels: a key outside the experts counts with the dropped pairs)
    valid = (keys >= 0) & (keys < num_experts)
    mass = sum_per_expert(torch.where(valid, keys, num_experts),
                          torch.where(valid, weights.float(), 0.0), num_experts + 1)
    return order, token_of_row, counts, mass[:num_experts]


@expert_order.register_fake
def _(keys, num_experts, k, weights=None):
    pairs = keys.shape[0]
    return (keys.new_empty(pairs, dtype=torch.int64), keys.new_empty(pairs, dtype=torch.int64),
            keys.new_empty(num_experts, dtype=torch.int64),
            keys.new_empty(num_experts if weights is not None else 0, dtype=torch.float32))


def sum_per_expert(flat: torch.Tensor, values: torch.Tensor, num_experts: int) -> torch.Tensor:
    """``values`` [..., S] summed by the expert ids ``flat`` [S]: float32 [..., E]. One expert
    takes a sum: Inductor (PyTorch 2.11, 2.13) failed to generate a scatter into one element,
    so a compiled layer with one expert did not compile."""
    if num_experts == 1:
        return values.sum(-1, keepdim=True)
    return values.new_zeros((*values.shape[:-1], num_experts)).index_add_(-1, flat, values)


def check_expert_indices(indices: torch.Tensor, num_experts: int) -> None:
    """ValueError unless every expert index lies in ``[0, num_experts)``: on CPU tensors (a
    host read is free there) and, on other devices, when
    :func:`sparseffn.ops.debug.set_checks` is on; never while ``torch.compile`` traces."""
    outside = indices_outside(indices, num_experts)
    if outside is not None:
        raise ValueError(f"expert indices must lie in [0, {num_experts}), got values in "
                         f"[{outside[0]}, {outside[1]}]")


def stable_sort_ids(keys: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A stable sort of integer ids in ``[0, bound)`` [n]: (sorted ids, int64 order), the ids
    in the narrowest dtype that holds them (:func:`~.ids.id_dtype`).

    Under ``torch.export`` the ids are made unique, ``id · n + position``, and sorted plainly:
    the same order, and ONNX has no stable sort (an exported plan failed to convert). A
    symbolic ``bound`` (GShard's group ids, exported for any token count) takes int64, since
    choosing the width would be a guard on it."""
    symbolic = isinstance(bound, torch.SymInt)
    # (no builtin max: PyTorch 2.8-2.9's non-strict export replaces it by a function that
    # Dynamo refuses to trace inside torch.cond's branches)
    keys = keys.to(torch.int64 if symbolic else id_dtype(0, bound - 1 if bound > 1 else 0))
    if exporting():
        position = torch.arange(keys.shape[0], device=keys.device)
        order = torch.sort(keys.long() * keys.shape[0] + position).indices
        return keys.index_select(0, order), order
    return torch.sort(keys, stable=True)


def search_sorted(sorted_keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``torch.searchsorted(sorted_keys, values)``: where each of ``values`` [V] would go in
    ``sorted_keys`` [S] (before equal keys), int64 [V]. Under ``torch.export``, by counting
    the smaller keys ([V, S] compared at once): ONNX has no binary search."""
    if exporting():
        return (sorted_keys.unsqueeze(0) < values.unsqueeze(1)).sum(1)
    return torch.searchsorted(sorted_keys, values)


def _expert_counts(sorted_keys: torch.Tensor, num_experts: int) -> torch.Tensor:
    """The length of each expert's block in the sorted keys ([S], values in
    ``[0, num_experts]``): int64 [E], the difference of the block boundaries
    (:func:`search_sorted`; no scatter, so no atomics on a GPU; the keys ``num_experts``,
    dropped pairs, are left after the last block)."""
    experts = torch.arange(num_experts + 1, dtype=sorted_keys.dtype, device=sorted_keys.device)
    bounds = search_sorted(sorted_keys, experts)                       # int64 [E + 1]
    return bounds[1:] - bounds[:-1]


# Where the rows of a CVMM input come from / where its output rows go:
_TOKEN = "token"    # one row per token, shared by its k slots (input only)
_SLOT = "slot"      # one row per (token, slot) pair, in pair order
_SORTED = "sorted"  # one row per pair, already in the plan's expert-sorted order
_GATED = "gated"    # one row per token: the gate-weighted sum over its k slots (output only)


def _index_of(layout: str, order: torch.Tensor, token_of_row: torch.Tensor) -> torch.Tensor | None:
    """Which row of a tensor in ``layout`` each expert-sorted row reads."""
    if layout == _SORTED:
        return None
    return order if layout == _SLOT else token_of_row


def _scatter_of(layout: str, order: torch.Tensor, k: int) -> tuple[torch.Tensor | None, int]:
    """How sorted rows go back to ``layout`` for ``sparseffn::cvmm_rows``: the slot of each
    row (the plan's order, a permutation) and how many consecutive slots sum into one output
    row (k for one row per token, 1 for one row per slot)."""
    if layout == _SORTED:
        return None, 1
    return order, (1 if layout == _SLOT else k)


def _rows_from(source: torch.Tensor, layout: str, order: torch.Tensor,
               token_of_row: torch.Tensor) -> torch.Tensor:
    """Gather ``source`` (in ``layout``) into expert-sorted rows [S, ·]."""
    index = _index_of(layout, order, token_of_row)
    return source if index is None else source.index_select(0, index)


def backward_gate_rows(gates: torch.Tensor | None, order: torch.Tensor) -> torch.Tensor | None:
    """The gates [S] (slot order) in the sorted rows' order, for the backward's products, or
    None; 2-byte gates in float32, wider ones as they are. A 2-byte float widens exactly, so
    every implementation computes what it did with the gates themselves.

    The reason is the expert weight gradient's GPU kernel, which loads a block of gates at
    every step of its loop over the rows: Triton pipelines (copies asynchronously, ahead of
    use) only loads of at least 4 bytes a thread, and a block starting at an expert's first
    row is not aligned for wider vectors, so 2-byte gates were loaded one element at a time,
    synchronously, in every step."""
    if gates is None:
        return None
    rows = gates.index_select(0, order)
    return rows.float() if rows.element_size() < 4 else rows


def _pairs_to_slots(order: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per-row values [S] in sorted order back to slot order [S] (a permutation)."""
    return kernels.unsort_rows(values, order)


def _cvmm_by(cvmm_rows, x2, weight, gates, order, token_of_row, counts, in_layout: str,
             out_layout: str, num_tokens: int, k: int) -> torch.Tensor:
    """:class:`_CVMM`'s forward, its products by ``cvmm_rows`` (the operator, or its
    differentiable portable form)."""
    gate_rows = gates.index_select(0, order) if gates is not None else None
    in_idx = _index_of(in_layout, order, token_of_row)
    out_idx, group = _scatter_of(out_layout, order, k)
    out_rows = num_tokens if out_layout == _GATED else order.shape[0]
    out, _ = cvmm_rows(x2, weight, counts, in_idx, out_idx, gate_rows, out_rows, group, False,
                       None, None)
    return out


def _cvmm_with_graph(ctx, grad_out):
    """:class:`_CVMM`'s gradients in differentiable ops, for second derivatives (see
    :func:`~sparseffn.ops.grad_mode.differentiable_once`): its forward's portable form,
    differentiated by autograd."""
    inputs = (*ctx.saved_tensors, ctx.in_layout, ctx.out_layout, ctx.num_tokens, ctx.k)
    return gradients_of(functools.partial(_cvmm_by, portable.cvmm_rows), inputs,
                        ctx.needs_input_grad, (grad_out,))


class _CVMM(torch.autograd.Function):
    """Autograd for :func:`cvmm` on flattened 2-D tensors, over the ``sparseffn::cvmm_rows``
    and ``sparseffn::expert_weight_grad`` operators.

    x2: [T, m] (``in_layout="token"``) or [S, m] (``"slot"`` / ``"sorted"``); weight:
    [E, m, n]; gates: [S] in slot order, or None. Output: [T, n] summed over each token's k
    pairs with the gates (``out_layout="gated"``), or [S, n] (``"slot"`` / ``"sorted"``).

    Memory: the input is saved once (not its k gathered copies) with the permutation. With
    gates the expert outputs are never kept: the gate gradient is ``<dy, x W> = <dy Wᵀ, x>``,
    and ``dy Wᵀ`` is needed for the input gradient anyway.
    """
    generate_vmap_rule = True

    @staticmethod
    def forward(x2, weight, gates, order, token_of_row, counts, in_layout: str,
                out_layout: str, num_tokens: int, k: int):
        return _cvmm_by(kernels.cvmm_rows, x2, weight, gates, order, token_of_row, counts,
                        in_layout, out_layout, num_tokens, k)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x2, weight, gates, order, token_of_row, counts, in_layout, out_layout, tokens, k = inputs
        ctx.save_for_backward(x2, weight, gates, order, token_of_row, counts)
        ctx.in_layout, ctx.out_layout, ctx.num_tokens, ctx.k = in_layout, out_layout, tokens, k

    @staticmethod
    @differentiable_once(with_graph=_cvmm_with_graph)
    def backward(ctx, grad_out):
        x2, weight, gates, order, token_of_row, counts = ctx.saved_tensors
        need_x, need_w, need_g = ctx.needs_input_grad[:3]
        grad_out = grad_out.contiguous()
        in_idx = _index_of(ctx.in_layout, order, token_of_row)
        out_idx = _index_of(ctx.out_layout, order, token_of_row)
        back_idx, back_group = _scatter_of(ctx.in_layout, order, ctx.k)
        gate_rows = backward_gate_rows(gates, order)
        weight_t = weight.transpose(1, 2)
        grad_x = grad_w = grad_g = None
        if need_g:   # d/dg <dy, g · x W> = <dy Wᵀ, x>, dotted inside the kernel
            rows = _rows_from(x2, ctx.in_layout, order, token_of_row)               # [S, m]
            scaled, dots = kernels.cvmm_rows(grad_out, weight_t, counts, out_idx, None,
                                             gate_rows, order.shape[0], 1, False, None, rows)
            grad_g = _pairs_to_slots(order, dots)
            if need_x:
                grad_x = _scatter_to(scaled, back_idx, back_group, x2.shape[0])
        elif need_x:   # dx = Σ g · dy Wᵀ, summed straight back into the input's layout
            grad_x, _ = kernels.cvmm_rows(grad_out, weight_t, counts, out_idx, back_idx,
                                          gate_rows, x2.shape[0], back_group, False, None, None)
        if need_w:   # dW_e = Σ_r g_r x_rᵀ dy_r; the gate scales the narrower side
            if weight.shape[1] <= weight.shape[2]:
                grad_w = kernels.expert_weight_grad(x2, grad_out, counts, in_idx, out_idx,
                                                    gate_rows)
            else:   # computed as [E, n, m] (wide output rows) and returned transposed
                grad_w = kernels.expert_weight_grad(grad_out, x2, counts, out_idx, in_idx,
                                                    gate_rows).transpose(1, 2)
        return grad_x, grad_w, grad_g, None, None, None, None, None, None, None


def _scatter_to(rows: torch.Tensor, slots: torch.Tensor | None, group: int,
                num_rows: int) -> torch.Tensor:
    """Sorted rows [S, m] back to the input's layout [num_rows, m] (each token's ``group``
    slots summed in slot order; no atomics)."""
    return rows if slots is None else kernels.sum_slots(rows, slots, num_rows, group)


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
        expected = [(plan.num_rows, m)]
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
    dtype = autocast_dtype(x)
    if dtype is not None:
        x, weight = x.to(dtype), weight.to(dtype)
    if x.dtype != weight.dtype:
        raise TypeError(f"cvmm input and weight must have the same dtype, got {x.dtype} and "
                        f"{weight.dtype} (convert the layer with .to(dtype) or use autocast)")
    x2 = x.reshape(-1, m)
    if gates is not None:
        gates = gates.reshape(-1).to(x.dtype)
    out_layout = _GATED if gates is not None else (_SORTED if sorted_output else _SLOT)
    out = _CVMM.apply(x2, weight, gates, plan.order, plan.token_of_row, plan.counts, in_layout,
                      out_layout, plan.num_tokens, k)
    if out_layout == _GATED:
        return out.reshape(*batch, n)
    return out if out_layout == _SORTED else out.reshape(*batch, k, n)
