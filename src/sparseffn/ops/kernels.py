"""The arithmetic under every expert store, registered as PyTorch operators (``torch.library``).

Each operator has one schema and several implementations chosen by the device of the
tensors that arrive: the Triton kernels of :mod:`~sparseffn.ops.triton_cvmm` (the CVMM
operators), :mod:`~sparseffn.ops.triton_rows` (gathered rows, product-key top-k) and
:mod:`~sparseffn.ops.triton_tree` (fast feed-forward trees) on CUDA when Triton is
installed, the fused C kernels of :mod:`~sparseffn.ops.native` on CPU in float32 (when they
are built; the two CVMM operators in bfloat16 too, where PyTorch's BLAS is MKL), and a
PyTorch implementation everywhere else (other devices, other dtypes, no C compiler, no
Triton). Each has a *fake* implementation that gives the output's shape and dtype without
computing it, so ``torch.compile`` traces a layer through them in one graph.

None of them reads a tensor on the host on its way in: counts and offsets arrive as tensors.
(The PyTorch implementation of the grouped products reads the per-expert counts inside the
operator when ``torch._grouped_mm`` cannot take the problem; that is invisible to the
compiler, and on a GPU it is one synchronisation.)

On CPU every operator gives the same result for any thread count and schedule
(``cvmm_rows`` adds a token's k rows in slot order, one slot per pass over the rows).

Rows are *expert-sorted*: row r of a product belongs to expert e(r), rows
``[offset_{e-1}, offset_e)`` to expert e, with ``offset_e = Σ_{i<=e} counts[i]``. The first
``D = Σ counts`` rows are computed; any row after them (a pair dropped at an expert's
capacity) is never computed, and where it appears in an output it is exactly zero.

    sparseffn::cvmm_rows          gather → per-expert product → scale → scatter (CVMM, Csordás
                                  et al. 2023, arXiv:2310.10837, App. B.1, Eq. 40)
    sparseffn::expert_weight_grad Σ over an expert's rows of aᵀ b (the CVMM weight gradient)
    sparseffn::expert_mlp_pairs   a few tokens' MLP experts without a plan (inference)
    sparseffn::unsort_rows        per-row values in expert-sorted order back to slot order
    sparseffn::gather_dot         <x[t], table[idx[t, j]]>   (these four: dense products for
                                  a small table where enabled, see ops/dense_products.py)
    sparseffn::gather_sum         Σ_j w[t, j] · table[idx[t, j]]
    sparseffn::scatter_rows       the transpose of gather_sum (a table's gradient)
    sparseffn::scatter_rows_dot   both gradients of gather_sum, in one pass over the pairs
    sparseffn::gather_sum_scatter_rows  both gradients of gather_dot (one S in dense form)
    sparseffn::row_index          a batch's pairs grouped by table row (for scatter_rows)
    sparseffn::dense_rows         each row's pairs as one dense row (small tables' gradients)
    sparseffn::topk_rows          top-k per row, ties to the lower index
    sparseffn::product_key_topk   the top-k of all sums of two score rows (Lample et al. 2019)
    sparseffn::fff_expand         leaf values of a fast feed-forward tree, level by level
    sparseffn::fff_expand_backward
    sparseffn::fff_descend        greedy hard inference down a tree
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import torch
from torch import Tensor

from ..activations import activation_fn
from . import dense_products, native, portable, triton_cvmm, triton_rows, triton_tree
from .debug import checks_enabled
from .grouped_mm import grouped_mm_rows, grouped_weight_grad_rows, pad_rows, zero_rows_after

_LIB = "sparseffn"


_AUTOCAST_DEVICES = ("cpu", "cuda")


class Operator:
    """A ``sparseffn::`` operator (``op``, a ``torch.library`` custom operator) and its Python
    implementation (``implementation``).

    Calling it runs the implementation directly when nothing needs to see the operator: eager
    mode, plain tensors, no dispatch or function mode, no profiler. Going through the
    dispatcher's Python round trip costs tens of microseconds a call on a GPU host, more than
    many of the kernels it launches. Under ``torch.compile``, ``make_fx``, fake tensors,
    tensor subclasses, functorch transforms, a ``TorchDispatchMode`` (FLOP counters,
    debuggers), a ``TorchFunctionMode``, the autograd profiler, or with an input that
    requires grad while grad is enabled (the operators have no autograd formula), the
    registered operator runs. While ``torch.export`` traces for ONNX (``torch.onnx.export``,
    :func:`sparseffn.to_onnx`), the operator's portable form runs instead
    (:func:`~sparseffn.ops.portable.traces_forms`)."""

    def __init__(self, op, implementation) -> None:
        self.op = op
        self.implementation = implementation
        functools.update_wrapper(self, implementation)

    def register_fake(self, fn):
        return self.op.register_fake(fn)

    def __call__(self, *args, **kwargs):
        if portable.traces_forms():
            return portable.form_of(self)(*args, **kwargs)
        if _direct_call_ok(args) and (not kwargs or _direct_call_ok(kwargs.values())):
            return self.implementation(*args, **kwargs)
        return self.op(*args, **kwargs)


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def _direct_call_ok(args) -> bool:
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack() or torch._C._autograd._profiler_enabled()):
        return False
    grad = torch.is_grad_enabled()
    wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN_TENSORS
                                            or (grad and a.requires_grad) or wrapped(a)):
            return False
    return True


def operator(name: str, device_types: Optional[str] = None):
    """Decorator: register ``fn`` as the operator ``sparseffn::<name>`` (no input mutated),
    its implementation run with autocast turned off; returns an :class:`Operator`.

    Autocast stays on inside a custom operator's implementation, so PyTorch ops there would
    follow autocast's lists: on CUDA a ``sum`` of bf16 rows comes back in fp32, the operator's
    output no longer has the dtype its fake implementation declares, and every gradient
    computed from it runs in fp32. The caller chooses the dtype of what goes in; the operator
    computes in that dtype."""
    def wrap(fn):
        @functools.wraps(fn)
        def without_autocast(*args, **kwargs):
            on = [d for d in _AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
            if not on:
                return fn(*args, **kwargs)
            with contextlib.ExitStack() as stack:
                for device in on:
                    stack.enter_context(torch.autocast(device, enabled=False))
                return fn(*args, **kwargs)
        options = {} if device_types is None else {"device_types": device_types}
        op = torch.library.custom_op(f"{_LIB}::{name}", mutates_args=(), **options)(
            without_autocast)
        op.register_vmap(_one_at_a_time(op))
        return Operator(op, without_autocast)
    return wrap


def _one_at_a_time(op):
    """A ``torch.vmap`` rule for ``op``: one call per batch entry, the outputs stacked."""
    def rule(info, in_dims, *args):
        outs = [op(*(a.select(d, b) if d is not None else a for a, d in zip(args, in_dims)))
                for b in range(info.batch_size)]
        if isinstance(outs[0], tuple):
            return tuple(torch.stack(parts) for parts in zip(*outs)), (0,) * len(outs[0])
        return torch.stack(outs), 0
    return rule


def _fused(*tensors: Optional[Tensor]) -> bool:
    """True when the C kernels take these tensors (CPU float32, built, allowed)."""
    return native.usable(*tensors)


# ---------------------------------------------------------------------------------------------
# CVMM over expert-sorted rows

@operator("cvmm_rows")
def cvmm_rows(src: Tensor, weight: Tensor, counts: Tensor, in_idx: Optional[Tensor],
              out_idx: Optional[Tensor], scale: Optional[Tensor], out_rows: int, group: int,
              relu: bool, mask_with: Optional[Tensor], dot_with: Optional[Tensor]
              ) -> tuple[Tensor, Tensor]:
    """``y_r = scale[r] · z_r`` with ``z_r = src[in_idx[r]] @ weight[e(r)]`` for the
    expert-sorted rows r < D = Σ counts.

    src: [R, m]; weight: [E, m, n] (any strides); counts: int64 [E]; in_idx: int64 [P] or None
    (row r of src); out_idx: int64 [P] or None; scale: [P] or None; P >= D sorted rows.

    Returns ``(out, dots)``. ``out`` is the rows ``y`` [out_rows = P, n] (rows >= D zero), or,
    with ``out_idx`` (a permutation of the P slots ``out_rows · group``: the plan's order),
    ``out[i] = Σ_{j < group} y_{r(i·group + j)}`` [out_rows, n], where r(s) is the row whose
    ``out_idx`` is s and rows >= D count as zero: each token's k slots summed in slot order,
    with no atomics (the same sum on every device and thread count). Without ``out_idx``:
    ``relu`` applies max(y, 0) (NaN stays NaN) and ``mask_with`` [P, n] zeroes y where
    ``mask_with <= 0`` (backward through a ReLU whose output it is). ``dots`` is
    ``<z_r, dot_with[r]>`` [P] (the gate gradient; zero for rows >= D), or an empty tensor
    when ``dot_with`` is None.
    """
    if triton_cvmm.usable(weight.shape[0], src, weight, scale, mask_with, dot_with):
        return triton_cvmm.cvmm_rows(src, weight, counts, in_idx, out_idx, scale, out_rows,
                                     group, relu, mask_with, dot_with)
    if native.cvmm_usable(src, weight, mask_with, dot_with, scale=scale):
        return _cvmm_rows_native(src, weight, counts, in_idx, out_idx, scale, out_rows, group,
                                 relu, mask_with, dot_with)
    return _cvmm_rows_torch(src, weight, counts, in_idx, out_idx, scale, out_rows, group, relu,
                            mask_with, dot_with)


def _num_sorted_rows(src: Tensor, in_idx: Optional[Tensor], out_idx: Optional[Tensor]) -> int:
    if in_idx is not None:
        return in_idx.shape[0]
    if out_idx is not None:
        return out_idx.shape[0]
    return src.shape[0]


def _dispatched(counts: Tensor, *per_row: Optional[Tensor]) -> list[Optional[Tensor]]:
    """The per-sorted-row tensors cut to the D = Σ counts rows the C kernels compute (a CPU
    tensor: the host read costs no synchronisation)."""
    done = int(counts.sum())
    return [None if t is None else t[:done] for t in per_row]


def _cvmm_rows_native(src, weight, counts, in_idx, out_idx, scale, out_rows, group, relu,
                      mask_with, dot_with):
    rows = _num_sorted_rows(src, in_idx, out_idx)
    in_idx, out_idx, scale, dot_with, mask_with = _dispatched(
        counts, in_idx, out_idx, scale, dot_with, mask_with)
    result = native.cvmm_rows(src, weight, counts, in_idx=in_idx, out_idx=out_idx, scale=scale,
                              out_rows=out_rows if out_idx is not None else None, group=group,
                              dot_with=dot_with, relu=relu, mask_with=mask_with)
    out, dots = result if dot_with is not None else (result, src.new_empty(0))
    if out_idx is None:                     # the rows of dropped pairs: written, as zeros
        out = pad_rows(out, rows)
    return out, (dots if dot_with is None else pad_rows(dots, rows))


def sum_slots(rows: Tensor, out_idx: Tensor, out_rows: int, group: int) -> Tensor:
    """``out[i] = Σ_{j < group} slots[i·group + j]`` where ``slots[out_idx[r]] = rows[r]``: the
    sorted rows [P, n] put back in slot order (a permutation: no atomics) and each group of
    ``group`` consecutive slots summed in slot order (deterministic on every device)."""
    slots = torch.empty_like(rows).index_copy_(0, out_idx, rows)
    if group == 1:
        return slots
    return slots.view(out_rows, group, rows.shape[1]).sum(1)


@operator("unsort_rows")
def unsort_rows(rows: Tensor, order: Tensor) -> Tensor:
    """``rows`` [S, ...] in a plan's expert-sorted order back to slot order: ``out[order[r]] =
    rows[r]``, ``order`` int64 [S] a permutation of ``[0, S)``.

    An operator rather than the ``index_copy_`` into a new tensor it runs, because
    Inductor's CPU backend (PyTorch 2.13) scheduled a fused kernel that read such a copy before
    writing it: a compiled σ-MoE backward (k ≥ E/2) gave its router NaN or 1e31 gradients."""
    return torch.empty_like(rows).index_copy_(0, order, rows)


@unsort_rows.register_fake
def _(rows, order):
    return torch.empty_like(rows)


def _cvmm_rows_torch(src, weight, counts, in_idx, out_idx, scale, out_rows, group, relu,
                     mask_with, dot_with, grouped=grouped_mm_rows, put_back=None):
    """:func:`cvmm_rows` in PyTorch ops: the per-expert products by ``grouped``, the rows put
    back in slot order and summed by ``put_back`` (default :func:`sum_slots`). The portable
    form of ``ops/portable.py`` passes its own two, which read no counts on the host and
    write into no tensor in place."""
    dtype = torch.promote_types(src.dtype, weight.dtype)
    rows = src if in_idx is None else src.index_select(0, in_idx)                # [P, m]
    z = grouped(rows.to(dtype), weight.to(dtype), counts)                       # [P, n]
    if dot_with is not None:   # rows of dropped pairs: exactly zero, even against NaN
        dots = zero_rows_after((z * dot_with.to(dtype)).sum(1, keepdim=True), counts).squeeze(1)
    else:
        dots = src.new_empty(0, dtype=dtype)
    y = z if scale is None else z * scale.to(dtype).unsqueeze(1)
    if relu:
        y = torch.relu(y)
    if mask_with is not None:
        y = torch.where(mask_with > 0, y, torch.zeros((), dtype=dtype, device=y.device))
    if scale is not None:   # a dropped row's scale may be anything: its rows stay exactly zero
        y = zero_rows_after(y, counts)
    if out_idx is None:
        return y, dots
    return (put_back or sum_slots)(y, out_idx, out_rows, group), dots


@cvmm_rows.register_fake
def _(src, weight, counts, in_idx, out_idx, scale, out_rows, group, relu, mask_with, dot_with):
    rows = _num_sorted_rows(src, in_idx, out_idx)
    dtype = torch.promote_types(src.dtype, weight.dtype)
    out = src.new_empty(out_rows if out_idx is not None else rows, weight.shape[2], dtype=dtype)
    return out, src.new_empty(rows if dot_with is not None else 0, dtype=dtype)


@operator("expert_weight_grad")
def expert_weight_grad(a_src: Tensor, b_src: Tensor, counts: Tensor, a_idx: Optional[Tensor],
                       b_idx: Optional[Tensor], scale: Optional[Tensor],
                       rows: Optional[int] = None,
                       out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """``out[e] = A_eᵀ B_e`` over expert e's sorted rows r < Σ counts, with
    ``A_r = scale[r] · a_src[a_idx[r]]`` [ma] and ``B_r = b_src[b_idx[r]]`` [nb].

    Returns [E, rows, nb] (``rows`` ≤ ma, default ma: the first rows of each expert's
    gradient, those of a weight whose copy was padded with zero units) in ``out_dtype``
    (default the promoted dtype of a_src and b_src): the gradient of the weight itself, not
    of its padded copy in the autocast dtype, rounded once from the float32 sums. An expert
    with no rows gets an exact zero matrix."""
    ma = a_src.shape[1]
    rows = ma if rows is None else rows
    if not 0 <= rows <= ma:
        raise ValueError(f"expert_weight_grad: rows must lie in [0, {ma}], got {rows}")
    if triton_cvmm.usable(counts.shape[0], a_src, b_src, scale):
        return triton_cvmm.expert_weight_grad(a_src, b_src, counts, a_idx, b_idx, scale, rows,
                                              out_dtype)
    if native.cvmm_usable(a_src, b_src, scale=scale):   # summed in a fixed order
        a_idx, b_idx, scale = _dispatched(counts, a_idx, b_idx, scale)
        out = native.weight_grad(a_src, b_src, counts, a_idx=a_idx, b_idx=b_idx, scale=scale,
                                 out_dtype=out_dtype)
        return _first_rows(out, rows)
    return expert_weight_grad_torch(a_src, b_src, counts, a_idx, b_idx, scale, rows, out_dtype)


def expert_weight_grad_torch(a_src: Tensor, b_src: Tensor, counts: Tensor,
                             a_idx: Optional[Tensor], b_idx: Optional[Tensor],
                             scale: Optional[Tensor], rows: Optional[int] = None,
                             out_dtype: Optional[torch.dtype] = None) -> Tensor:
    """:func:`expert_weight_grad` in PyTorch ops: the rows gathered and scaled, then
    ``torch._grouped_mm`` over each expert's rows where it runs (else a loop over experts)."""
    dtype = torch.promote_types(a_src.dtype, b_src.dtype)
    a = a_src if rows is None or rows == a_src.shape[1] else a_src[:, :rows]
    a = (a if a_idx is None else a.index_select(0, a_idx)).to(dtype)
    b = (b_src if b_idx is None else b_src.index_select(0, b_idx)).to(dtype)
    if scale is not None:
        a = a * scale.to(dtype).unsqueeze(1)
    out = grouped_weight_grad_rows(a.contiguous(), b, counts)
    return out if out_dtype is None else out.to(out_dtype)


def _first_rows(out: Tensor, rows: int) -> Tensor:
    """[E, rows, n] of [E, m, n], contiguous (a copy only when rows < m)."""
    return out if rows == out.shape[1] else out[:, :rows].contiguous()


@expert_weight_grad.register_fake
def _(a_src, b_src, counts, a_idx, b_idx, scale, rows=None, out_dtype=None):
    dtype = out_dtype or torch.promote_types(a_src.dtype, b_src.dtype)
    return a_src.new_empty(counts.shape[0], a_src.shape[1] if rows is None else rows,
                           b_src.shape[1], dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Gathered rows of single-row tables (PKM values, PEER experts, product sub-keys)

# The PyTorch path gathers at most this many table elements at a time.
_CHUNK_ELEMENTS = 1 << 24


def _chunks(rows: int, per_row: int):
    step = max(1, _CHUNK_ELEMENTS // max(1, per_row))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


@operator("gather_dot")
def gather_dot(x: Tensor, table: Tensor, idx: Tensor) -> Tensor:
    """``out[t, j] = <x[t], table[idx[t, j]]>``. x: [T, d]; table: [N, d]; idx: int64 [T, m]."""
    if dense_products.pays(idx, table.shape[0]):
        return dense_products.gather_dot(x, table, idx)
    if triton_rows.usable(x, table):
        return triton_rows.gather_dot(x, table, idx)
    if native.rows_usable(x, table):
        return native.gather_dot(x, table, idx)
    out = x.new_empty(idx.shape, dtype=torch.promote_types(x.dtype, table.dtype))
    for part in _chunks(idx.shape[0], idx.shape[1] * table.shape[1]):
        rows = table[idx[part]]                                       # [t, m, d]
        out[part] = torch.bmm(rows.to(out.dtype),
                              x[part].to(out.dtype).unsqueeze(-1)).squeeze(-1)
    return out


@gather_dot.register_fake
def _(x, table, idx):
    return x.new_empty(idx.shape, dtype=torch.promote_types(x.dtype, table.dtype))


@operator("gather_sum")
def gather_sum(idx: Tensor, weights: Tensor, table: Tensor) -> Tensor:
    """``out[t] = Σ_j weights[t, j] · table[idx[t, j]]``. idx, weights: [T, m]; table: [N, d];
    returns [T, d] in the table's dtype."""
    if dense_products.pays(idx, table.shape[0]):
        return dense_products.gather_sum(idx, weights, table)
    if triton_rows.usable(weights, table):
        return triton_rows.gather_sum(idx, weights, table)
    if native.rows_usable(weights, table):
        return native.gather_sum(idx, weights, table)
    if idx.shape[0] == 0:
        return table.new_zeros(0, table.shape[1])
    out = table.new_empty(idx.shape[0], table.shape[1])
    for part in _chunks(idx.shape[0], idx.shape[1] * table.shape[1]):
        out[part] = (table[idx[part]] * weights[part].to(table.dtype).unsqueeze(-1)).sum(1)
    return out


@gather_sum.register_fake
def _(idx, weights, table):
    return table.new_empty(idx.shape[0], table.shape[1])


@operator("scatter_rows")
def scatter_rows(idx: Tensor, weights: Tensor, src: Tensor, num_rows: int,
                 order: Optional[Tensor] = None, offsets: Optional[Tensor] = None) -> Tensor:
    """``out[i] = Σ_{(t, j): idx[t, j] = i} weights[t, j] · src[t]``, a dense [num_rows, d]
    with zero rows where no pair lands. idx, weights: [T, m]; src: [T, d]. ``order`` and
    ``offsets``: optionally, :func:`row_index` of (idx, num_rows), which the Triton kernel
    then does not compute again (the other implementations group the pairs themselves)."""
    if dense_products.pays(idx, num_rows):
        return dense_products.scatter_rows(idx, weights, src, num_rows)
    if triton_rows.usable(weights, src):
        row_index = (order, offsets) if order is not None and offsets is not None else None
        return triton_rows.scatter_rows(idx, weights, src, num_rows, row_index)
    if native.rows_usable(weights, src):
        return native.scatter_rows(idx, weights, src, num_rows)
    out = src.new_zeros(num_rows, src.shape[1])
    for part in _chunks(idx.shape[0], idx.shape[1] * src.shape[1]):
        contrib = weights[part].to(src.dtype).unsqueeze(-1) * src[part].unsqueeze(1)  # [t, m, d]
        out.index_add_(0, idx[part].reshape(-1), contrib.reshape(-1, src.shape[1]))
    return out


@scatter_rows.register_fake
def _(idx, weights, src, num_rows, order=None, offsets=None):
    return src.new_empty(num_rows, src.shape[1])


@operator("scatter_rows_dot")
def scatter_rows_dot(idx: Tensor, weights: Tensor, src: Tensor, table: Tensor,
                     order: Optional[Tensor] = None, offsets: Optional[Tensor] = None
                     ) -> tuple[Tensor, Tensor]:
    """``(scatter_rows(idx, weights, src, N), gather_dot(src, table, idx))``: the two
    gradients of ``gather_sum(idx, weights, table)`` for an output gradient ``src`` (the
    table's [N, d] and the weights' [T, m]). The Triton kernel computes both in one pass over
    the pairs grouped by row: each pair's src row, read once for the table gradient, also
    gives its dot with the row's table row, which the program reads once, where the two
    operators read a src row and a table row per pair each; so does the C kernel (src and
    table of one dtype). Elsewhere it is those two operators.

    idx, weights: [T, m]; src: [T, d]; table: [N, d]; ``order``, ``offsets``: as for
    :func:`scatter_rows`."""
    if dense_products.pays(idx, table.shape[0]):
        return dense_products.scatter_rows_dot(idx, weights, src, table)
    if triton_rows.scatter_rows_dot_usable(weights, src, table):
        row_index = (order, offsets) if order is not None and offsets is not None else None
        return triton_rows.scatter_rows_dot(idx, weights, src, table, row_index)
    if native.rows_usable(weights, src, table) and src.dtype == table.dtype:
        return native.scatter_rows_dot(idx, weights, src, table)
    return scatter_rows_and_gather_dot(idx, weights, src, table, order, offsets)


def scatter_rows_and_gather_dot(idx: Tensor, weights: Tensor, src: Tensor, table: Tensor,
                                order: Optional[Tensor] = None, offsets: Optional[Tensor] = None
                                ) -> tuple[Tensor, Tensor]:
    """What :func:`scatter_rows_dot` computes, by the two operators it fuses (its
    implementation where no fused kernel takes the tensors)."""
    return (scatter_rows(idx, weights, src, table.shape[0], order, offsets),
            gather_dot(src, table, idx))


@scatter_rows_dot.register_fake
def _(idx, weights, src, table, order=None, offsets=None):
    return (src.new_empty(table.shape[0], src.shape[1]),
            src.new_empty(idx.shape, dtype=torch.promote_types(src.dtype, table.dtype)))


@operator("gather_sum_scatter_rows")
def gather_sum_scatter_rows(idx: Tensor, weights: Tensor, table: Tensor, src: Tensor,
                            order: Optional[Tensor] = None, offsets: Optional[Tensor] = None
                            ) -> tuple[Tensor, Tensor]:
    """``(gather_sum(idx, weights, table), scatter_rows(idx, weights, src, N))``: the two
    gradients of ``gather_dot(src, table, idx)`` for an output gradient ``weights`` (src's
    [T, d] in the table's dtype, the table's [N, d] in src's). In the dense form both are
    products with the same S, built once (:func:`dense_products.gather_dot_grads`); elsewhere
    they are the two operators, each over the pairs as it reads them.

    idx, weights: [T, m]; table: [N, d]; src: [T, d]; ``order``, ``offsets``: as for
    :func:`scatter_rows`."""
    if src.dtype == table.dtype and dense_products.pays(idx, table.shape[0]):
        return dense_products.gather_dot_grads(idx, weights, table, src)
    return (gather_sum(idx, weights, table),
            scatter_rows(idx, weights, src, table.shape[0], order, offsets))


@gather_sum_scatter_rows.register_fake
def _(idx, weights, table, src, order=None, offsets=None):
    return (table.new_empty(idx.shape[0], table.shape[1]),
            src.new_empty(table.shape[0], src.shape[1]))


@operator("row_index")
def row_index(idx: Tensor, num_rows: int) -> tuple[Tensor, Tensor]:
    """The pairs of ``idx`` [T, m] grouped by table row, for :func:`scatter_rows`: ``order``
    [T·m] (pair numbers t·m + j, stably sorted by row) and ``offsets`` [num_rows + 1] (row i's
    pairs are ``order[offsets[i]:offsets[i + 1]]``), both int32 (at most 2³¹ - 2 pairs and
    rows), computed on the device with no host read."""
    if not triton_rows.fits_int32_index(idx, num_rows):
        raise ValueError(f"row_index: {idx.numel()} pairs over {num_rows} rows do not fit the "
                         f"int32 index")
    return triton_rows.sorted_reverse_index(idx, num_rows)


@row_index.register_fake
def _(idx, num_rows):
    return (idx.new_empty(idx.numel(), dtype=torch.int32),
            idx.new_empty(num_rows + 1, dtype=torch.int32))


@operator("dense_rows")
def dense_rows(idx: Tensor, weights: Tensor, num_rows: int) -> Tensor:
    """``out[t, i] = Σ_{j: idx[t, j] = i} weights[t, j]``: each row's pairs as a dense
    [T, num_rows] in the weights' dtype, summed in slot order (the Triton kernel; the PyTorch
    ``scatter_add_`` elsewhere). For a small table, the gradients of :func:`gather_dot` are
    then two GEMMs with it (``out @ table`` and ``outᵀ @ x``). idx, weights: [T, m]."""
    if triton_rows.usable(weights):
        return triton_rows.dense_rows(idx, weights, num_rows)
    return weights.new_zeros(idx.shape[0], num_rows).scatter_add_(1, idx, weights)


@dense_rows.register_fake
def _(idx, weights, num_rows):
    return weights.new_empty(idx.shape[0], num_rows)


# ---------------------------------------------------------------------------------------------
# Deterministic top-k (product-key retrieval)

def _reject_nan(scores: Tensor, what: str) -> None:
    """NaN has no rank: raise on CPU tensors, and on other devices in debug mode (the check
    reads the tensor on the host, see :mod:`~sparseffn.ops.debug`)."""
    if checks_enabled(scores) and bool(torch.isnan(scores).any()):
        raise ValueError(f"{what}: scores contain NaN (a NaN or an infinity in the layer's "
                         f"input or weights?)")


@operator("topk_rows")
def topk_rows(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k largest entries of each row of ``scores`` [R, n], ordered by (value desc, index
    asc): (values [R, k], int64 indices [R, k]). A row holding NaN raises a ValueError on CPU
    tensors (NaN has no rank, and the C kernel would rank nothing); on other devices outside
    debug mode it is not checked (that would read the scores on the host) and NaN ranks above
    every number, the indices staying in range."""
    _reject_nan(scores, "topk_rows")
    if _fused(scores):
        return native.topk_rows(scores, k)
    # a stable sort keeps equal scores in index order: (value desc, index asc), no host read
    values, idx = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k].contiguous(), idx[..., :k].contiguous()


@topk_rows.register_fake
def _(scores, k):
    return scores.new_empty(scores.shape[0], k), scores.new_empty(scores.shape[0], k,
                                                                   dtype=torch.int64)


def rankable(scores: Tensor) -> Tensor:
    """``scores`` with NaN and -inf ranked below every finite score and +inf above, as finite
    numbers whose sums of two cannot overflow: a non-finite score (from a non-finite input)
    still selects keys, and the selected *values* are read from the original scores, so the
    NaN or infinity reaches that row's output and no other row's (no host read to check)."""
    big = torch.finfo(scores.dtype).max / 4
    return torch.nan_to_num(scores, nan=-big, posinf=big, neginf=-big).clamp(-big, big)


@operator("product_key_topk")
def product_key_topk(scores_a: Tensor, scores_b: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The top k of ``scores_a[r, i] + scores_b[r, j]`` over all (i, j), index ``i + n_a·j``,
    ordered by (sum desc, index asc) (Lample et al. 2019, Eq. 15 of Csordás et al. 2023).
    scores_a: [R, n_a]; scores_b: [R, n_b]; 1 <= k <= n_a·n_b. Returns (values [R, k], int64
    indices [R, k]).

    On every device and without a host read, NaN and -inf scores rank below every finite one
    and +inf above (as :func:`rankable` maps them), and the values are the sums of the
    *original* scores, so a NaN selected stays NaN. (One call: the Triton kernel on a GPU and
    the C kernel on the CPU rank and sum in their loads; the PyTorch path maps and gathers.)"""
    if triton_rows.product_key_topk_usable(scores_a, scores_b, k):
        return triton_rows.product_key_topk(scores_a, scores_b, k)
    if _fused(scores_a, scores_b):       # ranks as rankable does in its loads, sums the originals
        return native.product_key_topk(scores_a, scores_b, k)
    indices = _product_key_topk_indices(rankable(scores_a), rankable(scores_b), k)
    sub_a, sub_b = sub_key_indices(indices, scores_a.shape[1])
    return scores_a.gather(1, sub_a) + scores_b.gather(1, sub_b), indices


def sub_key_indices(indices: Tensor, n_a: int) -> tuple[Tensor, Tensor]:
    """The sub-key indices ``(i, j)`` of product-key indices ``i + n_a·j`` (any shape, int64).
    One integer division: PyTorch's ``%`` and ``//`` are one each, and on the CPU an int64
    division took 0.5 ms at 2048 tokens × 4 heads × 32 keys."""
    sub_b = indices // n_a
    return indices - sub_b * n_a, sub_b


def _product_key_topk_indices(scores_a: Tensor, scores_b: Tensor, k: int) -> Tensor:
    """The indices of :func:`product_key_topk` for scores without NaN, in PyTorch."""
    n_a, n_b = scores_a.shape[1], scores_b.shape[1]
    val_a, idx_a = topk_rows(scores_a, min(k, n_a))
    val_b, idx_b = topk_rows(scores_b, min(k, n_b))
    sums = (val_a.unsqueeze(-1) + val_b.unsqueeze(-2)).flatten(1)       # (-1 fails at 0 rows)
    full = (idx_a.unsqueeze(-1) + n_a * idx_b.unsqueeze(-2)).flatten(1)
    order = full.argsort(dim=-1)                # candidates by index, so ties go to the lower
    _, pos = topk_rows(sums.gather(-1, order), k)
    return full.gather(-1, order).gather(-1, pos)


@product_key_topk.register_fake
def _(scores_a, scores_b, k):
    rows = scores_a.shape[0]
    return scores_a.new_empty(rows, k), scores_a.new_empty(rows, k, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------
# MLP experts for a few tokens, without a dispatch plan (inference)

@operator("expert_mlp_pairs")
def expert_mlp_pairs(x: Tensor, indices: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
                     activation: str, b1: Optional[Tensor], b2: Optional[Tensor],
                     w_gate: Optional[Tensor], keep: Optional[Tensor]) -> Tensor:
    """``y[t] = Σ_j g[t, j] · f_{e[t, j]}(x[t])`` with ``f_e(x) = act(x W1_eᵀ + b1_e) W2_e +
    b2_e``, or for gated experts ``(act(x Wg_eᵀ) ⊙ (x W1_eᵀ + b1_e)) W2_e + b2_e`` (Csordás et
    al. 2023 Eq. 25; Shazeer 2020), each pair read straight from the weights.

    x: [T, m]; indices: int [T, k] (in range); gates: [T, k]; w1, w_gate: [E, G, m]; w2:
    [E, G, n]; b1: [E, G]; b2: [E, n]; keep: bool [T, k] or None: a pair where it is False is
    never computed and adds exactly zero. Returns [T, n] in x's dtype. No autograd formula:
    :func:`~sparseffn.ops.expert_mlp.expert_mlp_few` calls it only where no gradient is
    wanted. The C kernel on CPU float32 (weights with a unit last stride); elsewhere each
    pair's expert weights are gathered and applied as batched matrix-vector products."""
    if native.mlp_pairs_usable(x, gates, w1, w2, b1, b2, w_gate, activation):
        return native.mlp_pairs(x, indices, gates, w1, w2, activation, b1, b2, w_gate, keep)
    return expert_mlp_pairs_torch(x, indices, gates, w1, w2, activation, b1, b2, w_gate, keep)


def expert_mlp_pairs_torch(x: Tensor, indices: Tensor, gates: Tensor, w1: Tensor, w2: Tensor,
                           activation: str, b1: Optional[Tensor] = None,
                           b2: Optional[Tensor] = None, w_gate: Optional[Tensor] = None,
                           keep: Optional[Tensor] = None) -> Tensor:
    """:func:`expert_mlp_pairs` in PyTorch ops (differentiable by autograd): every pair's
    expert weights gathered ([T·k, G, m] copies) and applied by ``bmm``."""
    tokens, k = indices.shape
    flat = indices.reshape(-1).long()
    rows = x.repeat_interleave(k, dim=0).unsqueeze(1)                          # [P, 1, m]
    pre = torch.bmm(rows, w1.index_select(0, flat).transpose(1, 2)).squeeze(1)  # [P, G]
    if b1 is not None:
        pre = pre + b1.index_select(0, flat)
    act = activation_fn(activation)
    if w_gate is None:
        hidden = act(pre)
    else:
        hidden = act(torch.bmm(rows, w_gate.index_select(0, flat).transpose(1, 2)).squeeze(1)) * pre
    out = torch.bmm(hidden.unsqueeze(1), w2.index_select(0, flat)).squeeze(1)   # [P, n]
    if b2 is not None:
        out = out + b2.index_select(0, flat)
    out = out * gates.reshape(-1, 1).to(out.dtype)
    if keep is not None:     # never computed: exactly zero, whatever the expert gives
        out = torch.where(keep.reshape(-1, 1), out, out.new_zeros(()))
    return out.view(tokens, k, w2.shape[-1]).sum(1).to(x.dtype)


@expert_mlp_pairs.register_fake
def _(x, indices, gates, w1, w2, activation, b1, b2, w_gate, keep):
    return x.new_empty(x.shape[0], w2.shape[-1])


# ---------------------------------------------------------------------------------------------
# Fast feed-forward trees (Chaunin & Mikhailovskiy §1.2-2.3; layout in ``fff.py``)

# Modes of the expansion: how a node's two children get their values from the parent's value
# ``cur`` (see ``fff_cpu.c``): 0 product, p = σ(z): (cur·p, cur - cur·p); 1 sum with
# a(-z) = a(z) - z: (cur + a, cur + a - z); 2 sum with a(-z) = -a(z): (cur + a, cur - a);
# 3 the product of mode 0 given the logits z themselves (σ computed inside, by every kernel:
# on a GPU one launch instead of two, on a CPU no [T, N] tensor of sigmoids written and read
# again; the backward keeps z instead of σ(z)).
FFF_PRODUCT, FFF_SUM_SHIFTED, FFF_SUM_ODD, FFF_PRODUCT_OF_LOGITS = 0, 1, 2, 3


@operator("fff_expand")
def fff_expand(node_values: Tensor, depth: int, mode: int,
               node_logits: Optional[Tensor]) -> Tensor:
    """Leaf values [T, 2^depth] from node values [T, 2^depth - 1], level by level (mode 1
    also reads the node logits [T, 2^depth - 1]); in the node values' dtype."""
    if triton_tree.usable(depth, node_values, node_logits):
        return triton_tree.expand(node_values, depth, mode, node_logits)
    if _fused(node_values, node_logits):
        return native.fff_expand(node_values, depth, mode, node_logits=node_logits)
    return fff_expand_torch(node_values, depth, mode, node_logits)


def fff_expand_torch(a: Tensor, depth: int, mode: int, z: Optional[Tensor]) -> Tensor:
    """:func:`fff_expand` in PyTorch ops, which autograd differentiates: the operator's
    implementation where no kernel runs, and the levelwise formulation of ``fff.py`` there."""
    if mode == FFF_PRODUCT_OF_LOGITS:
        a, mode = torch.sigmoid(a), FFF_PRODUCT
    tokens = a.shape[0]
    values = (a.new_ones if mode == FFF_PRODUCT else a.new_zeros)(tokens, 1)
    for level in range(depth):
        nodes = slice((1 << level) - 1, (1 << (level + 1)) - 1)
        if mode == FFF_PRODUCT:
            left = values * a[:, nodes]
            right = values - left
        elif mode == FFF_SUM_SHIFTED:
            left = values + a[:, nodes]
            right = left - z[:, nodes].to(a.dtype)
        else:
            left, right = values + a[:, nodes], values - a[:, nodes]
        values = torch.stack((left, right), dim=-1).reshape(tokens, 2 << level)
    return values


@fff_expand.register_fake
def _(node_values, depth, mode, node_logits):
    return node_values.new_empty(node_values.shape[0], 1 << depth)


@operator("fff_expand_backward")
def fff_expand_backward(grad_leaf: Tensor, leaf: Optional[Tensor], node_data: Optional[Tensor],
                        depth: int, mode: int) -> Tensor:
    """The gradient [T, 2^depth - 1] of the leaf values with respect to the node logits z
    (bottom-up; ``leaf`` the leaf values in modes 0 and 3; ``node_data`` σ(z) in mode 0, z in
    mode 3, a'(z) in mode 1, see ``fff_cpu.c``); in the gradient's dtype."""
    if triton_tree.usable(depth, grad_leaf, leaf, node_data):
        return triton_tree.expand_backward(grad_leaf, leaf, node_data, depth, mode)
    if _fused(grad_leaf, leaf, node_data):
        return native.fff_expand_backward(grad_leaf, leaf, node_data, depth, mode)
    return _fff_expand_backward_torch(grad_leaf, leaf, node_data, depth, mode)


def _fff_expand_backward_torch(grad_leaf, leaf, node_data, depth, mode):
    if mode == FFF_PRODUCT_OF_LOGITS:   # as fff_expand_torch: σ(z), then the product
        node_data, mode = torch.sigmoid(node_data), FFF_PRODUCT
    g = grad_leaf * leaf.to(grad_leaf.dtype) if mode == FFF_PRODUCT else grad_leaf
    out = grad_leaf.new_empty(grad_leaf.shape[0], (1 << depth) - 1)
    for level in reversed(range(depth)):
        nodes = slice((1 << level) - 1, (1 << (level + 1)) - 1)
        g0, g1 = g[:, 0::2], g[:, 1::2]
        s = g0 + g1
        if mode == FFF_SUM_ODD:
            out[:, nodes] = g0 - g1
        elif mode == FFF_PRODUCT:    # a'(z) = 1 - σ(z) for log-sigmoid
            out[:, nodes] = s * (1 - node_data[:, nodes].to(s.dtype)) - g1
        else:
            out[:, nodes] = s * node_data[:, nodes].to(s.dtype) - g1
        g = s
    return out


@fff_expand_backward.register_fake
def _(grad_leaf, leaf, node_data, depth, mode):
    return grad_leaf.new_empty(grad_leaf.shape[0], (1 << depth) - 1)


@operator("fff_descend")
def fff_descend(x: Tensor, weight: Tensor, bias: Optional[Tensor], depth: int) -> Tensor:
    """Greedy hard inference: the leaf (int64 [T]) each token of x [T, dim] reaches, going
    left (2n + 1) where ``z_n = <x, weight[n]> + bias[n] > 0`` and right otherwise (NaN goes
    right). weight: [2^depth - 1, dim]; bias: [2^depth - 1] or None. The Triton kernel
    accumulates z in fp32; the PyTorch path computes it in x's dtype."""
    if triton_tree.descend_usable(x, weight, bias):
        return triton_tree.descend(x, weight, bias, depth)
    if _fused(x, weight, bias):
        return native.fff_descend(x, weight, bias, depth)
    return fff_descend_torch(x, weight, bias, depth)


def fff_descend_torch(x: Tensor, weight: Tensor, bias: Optional[Tensor], depth: int) -> Tensor:
    """:func:`fff_descend` in PyTorch ops: each level's node rows gathered and dotted with the
    tokens (the operator's implementation where no kernel runs, and its portable form)."""
    weight = weight.to(x.dtype)

    def node_logit(level: int, node: Tensor) -> Tensor:
        z = torch.einsum("td,td->t", x, weight.index_select(0, node))
        return z if bias is None else z + bias.index_select(0, node).to(z.dtype)
    return descend_from_logits_fn(node_logit, depth, x.shape[0], x.device)


def descend_from_logits_fn(node_logit: Callable[[int, Tensor], Tensor], depth: int,
                           tokens: int, device=None) -> Tensor:
    """Greedy descent given ``node_logit(level, node [T]) -> z [T]`` (any node network):
    left (2n + 1) where z > 0, right otherwise, NaN included (as every kernel)."""
    node = torch.zeros(tokens, dtype=torch.long, device=device)
    for level in range(depth):
        node = 2 * node + 2 - (node_logit(level, node) > 0).long()
    return node - ((1 << depth) - 1)


@fff_descend.register_fake
def _(x, weight, bias, depth):
    return x.new_empty(x.shape[0], dtype=torch.int64)


portable.fill_forms()
