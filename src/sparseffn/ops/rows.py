"""Products with gathered rows of a table, for layers whose experts are single rows: PKM value
rows (Csordás et al. 2023 §3.2), PEER's single-neuron experts ``e_i(x) = σ(u_iᵀx) v_i`` (He 2024 §3)
and product sub-keys.

A *pair* (t, j) names row ``idx[t, j]`` of a table [N, d] for row t of a batch. The pairs are
never copied out as a [T, m, d] tensor of gathered rows (that is what a plain
``table[idx]`` followed by an einsum does, and what ``peer-pytorch`` does per token): the fused
CPU kernels of ``ops/native/rows_cpu.c`` read each table row in place, and the backward's table
gradient groups the pairs by row with a counting sort. Without the kernels (no compiler, other
devices, other dtypes) a chunked PyTorch path computes the same thing.

    gather_dot(x, table, idx)       [T, m]  out[t, j] = <x[t], table[idx[t, j]]>
    gather_sum(idx, weights, table) [T, d]  out[t] = Σ_j weights[t, j] · table[idx[t, j]]

Both are differentiable in every floating-point argument; each one's backward is made of the
other and of ``scatter_rows`` (the table gradient, a dense [N, d] whose untouched rows are 0).
With ``sparse_grad=True`` the table gradient is a coalesced sparse COO tensor holding only the
rows some pair read, as ``nn.Embedding(sparse=True)`` gives (for ``torch.optim.SparseAdam`` or
SGD): a table of a million rows then costs per step what the batch reads, not 4·N·d bytes.
"""

from __future__ import annotations

import warnings

import torch

from . import dense_products, kernels, portable, triton_rows
from .debug import indices_outside
from .grad_mode import differentiable_once, grad_wanted, gradients_of
from .kernels import scatter_rows


def scatter_rows_sparse(idx: torch.Tensor, weights: torch.Tensor, src: torch.Tensor,
                        num_rows: int) -> torch.Tensor:
    """:func:`scatter_rows` as a coalesced sparse COO [num_rows, d] with only the rows that some
    pair lands on."""
    rows, inverse = torch.unique(idx, return_inverse=True)
    values = scatter_rows(inverse.view(idx.shape), weights.contiguous(), src, rows.numel())
    return row_sparse(rows, values, num_rows)


def row_sparse(rows: torch.Tensor, values: torch.Tensor, num_rows: int,
               coalesced: bool = True) -> torch.Tensor:
    """The coalesced sparse COO [num_rows, *values.shape[1:]] whose row ``rows[i]`` is
    ``values[i]``; ``rows`` [n] strictly increasing (so not checked: a check would cost a sort's
    worth per step). With ``coalesced=False``, rows in any order and repeated (a row is then
    the sum of its values), marked uncoalesced.

    PyTorch 2.11 warns that invariant checks are "implicitly disabled" although they are
    disabled explicitly (pytorch/pytorch#178274, fixed later): that warning, and only it, is
    dropped here, so a training step with sparse gradients prints nothing.

    PyTorch warns it once a process (every time under ``torch.set_warn_always(True)``), so only
    those calls filter it: a ``warnings.catch_warnings`` at every step would also make Python
    show each of the program's once-per-place warnings again at every step."""
    global _warning_spent
    def build():
        return torch.sparse_coo_tensor(rows.unsqueeze(0), values, (num_rows, *values.shape[1:]),
                                       is_coalesced=coalesced, check_invariants=False)
    warn_always = torch.is_warn_always_enabled()
    if _warning_spent and not warn_always:
        return build()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
        made = build()
    _warning_spent = _warning_spent or not warn_always   # (warn_always does not spend it)
    return made


_warning_spent = False      # whether row_sparse has built a tensor outside warn_always


def _table_grad(idx, weights, src, num_rows, sparse: bool, row_index) -> torch.Tensor:
    if sparse:
        return scatter_rows_sparse(idx, weights, src, num_rows)
    return scatter_rows(idx, weights, src, num_rows, *(row_index or (None, None)))


def shared_row_index(idx: torch.Tensor, num_rows: int, *tensors: torch.Tensor,
                     sparse_grad: bool = False):
    """The pairs of ``idx`` grouped by table row (``kernels.row_index``), computed once in the
    forward for the backward of several products that read tables of ``num_rows`` rows with
    the same pairs (PEER reads ``u_i`` and ``v_i`` with one idx): each table gradient then
    reuses it instead of sorting the pairs again. Only where the Triton table gradient will
    run and need it (a table requires grad under grad mode, not ``sparse_grad``, the tensors
    the Triton kernels' own, not the dense products of ``ops/dense_products.py``); else None
    (the C kernel and the PyTorch path group the pairs themselves). Pass the result as
    ``row_index`` to :func:`gather_dot` and :func:`gather_sum`."""
    if (sparse_grad or not grad_wanted(*tensors) or not triton_rows.usable(*tensors)
            or not triton_rows.fits_int32_index(idx, num_rows)
            or dense_products.pays(idx, num_rows)):     # (the dense form groups nothing)
        return None
    return kernels.row_index(idx, num_rows)


def row_usage(idx: torch.Tensor, weights: torch.Tensor, num_rows: int,
              row_index: tuple[torch.Tensor, torch.Tensor],
              mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per table row, the pairs of ``idx`` [T, m] that read it and their ``weights`` [T, m]
    summed: float32 [num_rows] each, outside the autograd graph, from ``row_index``
    (:func:`shared_row_index` of idx, the table gradient's grouping of the pairs). The counts
    are its offsets' differences; the mass each row's weights added in the row index's order
    by :func:`scatter_rows` with a column of ones, with no atomics (the same bits on every
    run) and no second sort (``index_add_`` under deterministic algorithms sorts the pairs on
    CUDA). ``mass``: the mass when already known, not summed again. Pairs outside
    ``[0, num_rows)`` count in no row."""
    order, offsets = row_index
    counts = (offsets[1:] - offsets[:-1]).float()
    if mass is None:
        ones = weights.new_ones(idx.shape[0], 1, dtype=torch.float32)
        mass = scatter_rows(idx, weights.detach().float(), ones, num_rows, order, offsets)[:, 0]
    return counts, mass.detach().float()


def _rows_with_graph(ctx, grad, form):
    """:class:`_GatherDot`'s or :class:`_GatherSum`'s gradients in differentiable ops, for
    second derivatives (see :func:`~sparseffn.ops.grad_mode.differentiable_once`): autograd
    over the operator's portable ``form`` (``index_select`` and a batched product). A
    table's gradient is dense here, ``sparse_grad`` or not."""
    first, second, third, *_ = ctx.saved_tensors
    return gradients_of(lambda a, b, c, *_: form(a, b, c), (first, second, third, None, None),
                        ctx.needs_input_grad, (grad,))


class _GatherDot(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(x, table, idx, sparse, row_index):
        return kernels.gather_dot(x, table, idx)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, table, idx, sparse, row_index = inputs
        ctx.sparse = sparse
        ctx.save_for_backward(x, table, idx, *(row_index or ()))

    @staticmethod
    @differentiable_once(with_graph=lambda ctx, grad: _rows_with_graph(ctx, grad,
                                                                       portable.gather_dot))
    def backward(ctx, grad):
        x, table, idx, *row_index = ctx.saved_tensors
        grad = grad.contiguous()
        grad_x = grad_table = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1] and not ctx.sparse \
                and dense_products.pays(idx, table.shape[0]):
            # both as products with one S (the row kernels take the two operators below,
            # without the combined operator's extra call)
            grad_x, grad_table = kernels.gather_sum_scatter_rows(
                idx, grad, table, x.to(table.dtype))
            return grad_x.to(x.dtype), grad_table, None, None, None
        if ctx.needs_input_grad[0]:
            grad_x = kernels.gather_sum(idx, grad, table).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_table = _table_grad(idx, grad, x.to(table.dtype), table.shape[0], ctx.sparse,
                                     row_index)
        return grad_x, grad_table, None, None, None


class _GatherSum(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(idx, weights, table, sparse, row_index):
        return kernels.gather_sum(idx, weights, table)

    @staticmethod
    def setup_context(ctx, inputs, output):
        idx, weights, table, sparse, row_index = inputs
        ctx.sparse = sparse
        ctx.save_for_backward(idx, weights, table, *(row_index or ()))

    @staticmethod
    @differentiable_once(with_graph=lambda ctx, grad: _rows_with_graph(ctx, grad,
                                                                       portable.gather_sum))
    def backward(ctx, grad):
        idx, weights, table, *row_index = ctx.saved_tensors
        grad = grad.contiguous()
        grad_weights = grad_table = None
        if ctx.needs_input_grad[1] and ctx.needs_input_grad[2] and not ctx.sparse:
            # both from one pass over the pairs grouped by row (grad has the table's dtype:
            # it is the gradient of gather_sum's output)
            grad_table, grad_weights = kernels.scatter_rows_dot(
                idx, weights, grad.to(table.dtype), table, *(row_index or (None, None)))
            return None, grad_weights.to(weights.dtype), grad_table, None, None
        if ctx.needs_input_grad[1]:
            grad_weights = kernels.gather_dot(grad, table, idx).to(weights.dtype)
        if ctx.needs_input_grad[2]:
            grad_table = _table_grad(idx, weights, grad.to(table.dtype), table.shape[0],
                                     ctx.sparse, row_index)
        return None, grad_weights, grad_table, None, None


def _check_pairs(idx: torch.Tensor, rows: int, table: torch.Tensor, what: str) -> None:
    if idx.dim() != 2 or idx.shape[0] != rows:
        raise ValueError(f"{what}: idx must be [{rows}, m], got {tuple(idx.shape)}")
    if idx.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{what}: idx must be an integer tensor, got {idx.dtype}")
    if table.dim() != 2:
        raise ValueError(f"{what}: table must be [N, d], got {tuple(table.shape)}")
    outside = indices_outside(idx, table.shape[0])
    if outside is not None:
        raise IndexError(f"{what}: idx must lie in [0, {table.shape[0]}), got values in "
                         f"[{outside[0]}, {outside[1]}]")


def gather_dot(x: torch.Tensor, table: torch.Tensor, idx: torch.Tensor,
               sparse_grad: bool = False, row_index=None) -> torch.Tensor:
    """``out[t, j] = <x[t], table[idx[t, j]]>``, differentiable in x and table (the table's
    gradient sparse with ``sparse_grad``). ``row_index``: :func:`shared_row_index` of idx
    when another product shares the pairs.

    x: [T, d]; table: [N, d]; idx: int [T, m]. Returns [T, m]."""
    _check_pairs(idx, x.shape[0], table, "gather_dot")
    if x.shape[-1] != table.shape[1]:
        raise ValueError(f"gather_dot: x has width {x.shape[-1]}, table rows {table.shape[1]}")
    return _GatherDot.apply(x, table, idx.long(), sparse_grad, row_index)


def gather_sum(idx: torch.Tensor, weights: torch.Tensor, table: torch.Tensor,
               sparse_grad: bool = False, row_index=None) -> torch.Tensor:
    """``out[t] = Σ_j weights[t, j] · table[idx[t, j]]`` (a weighted embedding bag),
    differentiable in weights and table (the table's gradient sparse with ``sparse_grad``).
    ``row_index``: :func:`shared_row_index` of idx when another product shares the pairs.

    idx: int [T, m]; weights: [T, m]; table: [N, d]. Returns [T, d]."""
    _check_pairs(idx, weights.shape[0], table, "gather_sum")
    if weights.shape != idx.shape:
        raise ValueError(f"gather_sum: weights {tuple(weights.shape)} must match idx "
                         f"{tuple(idx.shape)}")
    return _GatherSum.apply(idx.long(), weights, table, sparse_grad, row_index)
