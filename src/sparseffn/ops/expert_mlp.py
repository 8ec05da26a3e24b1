"""A mixture of two-layer MLP experts: two CVMMs with an activation between them.

``y_t = Σ_j g_tj · act(x_t W1[e_tj]ᵀ) W2[e_tj]`` (Csordás et al. 2023 Eq. 25), with the hidden
units kept in the plan's expert-sorted order between the two CVMMs. Gated (GLU) experts,
``(act(x_t Wg[e]ᵀ) ⊙ x_t W1[e]ᵀ) W2[e]`` (Shazeer 2020, arXiv:2002.05202; Llama's and
Mixtral's SwiGLU experts), add a third CVMM into the same sorted rows.

With ReLU experts (and no dropout; under autocast in the autocast dtype), one autograd
function runs both layers on the ``sparseffn::cvmm_rows`` operator, with the ReLU and its
derivative, the gate scaling and the gate gradient folded into the kernel's epilogues (no
separate passes over the ``[pairs, expert_size]`` hidden units); expert biases (FFF leaves)
go in as weights of a constant input. Otherwise it is two :func:`cvmm` calls and the
activation, which compute the same thing.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch

from ..activations import activation_fn
from . import kernels, native, portable, triton_cvmm
from .cvmm import (DispatchPlan, _pairs_to_slots, backward_gate_rows, check_expert_indices,
                   cvmm)
from .grad_mode import differentiable_once, grad_wanted, gradients_of
from .precision import autocast_dtype
from .rows import gather_sum
from .sizes import exported_for_any_size

_FUSED_ACTIVATIONS = {"relu"}

# Up to this many multiply-adds (pairs · expert_size · (d_in + d_out), d_in once more for
# gated experts) a batch's experts run without a dispatch plan (:func:`expert_mlp_few`): at
# d_model 512 and experts of 128, 16 pairs (4 tokens at k = 4). A whole σ-MoE layer's
# inference forward without / with the plan, interleaved with a dense MLP as in
# ``bench layers`` (2-core AVX-512 CPU): 0.86 at 1 token, 0.96 at 4, 1.02 at 8, 1.13 at 16.
FEW_PAIRS_MACS = 1 << 21

# On the GPU paths each expert's hidden units are padded with zero units to a multiple of this
# (see :func:`hidden_padding`).
HIDDEN_MULTIPLE = 16


def hidden_multiple(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> int:
    """The multiple, in elements, that the kernels which will run want of a row's length:
    ``HIDDEN_MULTIPLE`` on the GPU paths (the Triton kernels, also in the interpreter, and
    CUDA's ``torch._grouped_mm``), 1 on the CPU's C and PyTorch paths. See
    :func:`hidden_padding`."""
    if x.is_cpu and not triton_cvmm.usable(w1.shape[0], x, w1, w2):
        return 1
    return HIDDEN_MULTIPLE


def hidden_padding(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> int:
    """How many hidden units of zero weight :func:`expert_mlp` adds to each expert: enough to
    make ``expert_size`` a multiple of ``HIDDEN_MULTIPLE`` where the kernels that will run
    need it, else 0.

    The Triton kernels load and store the [pairs, expert_size] hidden units (and their
    gradient) in 16-byte vectors, and pipeline those loads, only when the row length and
    stride are multiples of 16 elements: Triton specialises an integer argument on
    divisibility by 16, and a mask ``cols < 255`` proves nothing about a vector of 8. At
    the byte LM's σ-MoE shapes (8 experts of 255 at d_model 256, parameter-matched to a
    dense d_ff of 2048) all six products compiled for sm_90 stored or loaded the hidden
    units 2 bytes at a time (``scripts/ptx_memory_ops.py``). ``torch._grouped_mm``, the
    PyTorch path on CUDA, needs 16-byte aligned rows too. A padded unit has zero in- and
    out-weights, so it adds exactly zero to the output and gets no gradient that is kept
    (``act(0) · 0``; NaN only where the token's input is not finite). On the CPU's C and
    PyTorch paths nothing is padded (unaligned vectors cost them nothing)."""
    return -w1.shape[1] % hidden_multiple(x, w1, w2)


def _pad_units(weight: torch.Tensor, pad: int) -> torch.Tensor:
    """[E, G, ·] -> [E, G + pad, ·] with zero rows after each expert's G (differentiable:
    the gradient of the padded rows is dropped)."""
    return torch.nn.functional.pad(weight, (0, 0, 0, pad)) if pad else weight


def expert_mlp(x: torch.Tensor, plan: DispatchPlan, w1: torch.Tensor, w2: torch.Tensor,
               gates: torch.Tensor, activation: str = "relu",
               hidden_dropout: Callable[[torch.Tensor], torch.Tensor] | None = None,
               b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
               indices: torch.Tensor | None = None,
               w_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Apply each token's k experts and sum them with the gates.

    Args:
      x: [T, d_in] tokens (one row per token of ``plan``).
      plan: :meth:`DispatchPlan.build` of the [T, k] expert indices.
      w1: [E, G, d_in], the keys (rows) of each expert's first layer.
      w2: [E, G, d_out], the values (rows) of each expert's second layer.
      gates: [T, k] weights of the selected experts (zero for the pairs ``plan`` drops, as
        :class:`~sparseffn.routing.Routing` gives them).
      activation: a name of ``sparseffn.activations.ACTIVATIONS`` ("relu" runs fused).
      hidden_dropout: applied to the hidden units [T·k, G] when given (a training-time
        ``nn.Dropout``); it takes the unfused path.
      b1, b2: optional expert biases [E, G] and [E, d_out] (FFF leaves have them):
        ``act(x W1ᵀ + b1) W2 + b2``, weighted by the gate; they need ``indices`` [T, k], the
        expert ids ``plan`` was built from. ReLU experts take them on the fused path
        (:func:`_biased_relu_experts`).
      w_gate: optional [E, G, d_in], the gate rows of gated experts:
        ``(act(x Wgᵀ) ⊙ (x W1ᵀ + b1)) W2 + b2`` (unfused path).

    Returns [T, d_out].
    """
    biased = b1 is not None or b2 is not None
    if biased and indices is None:
        raise ValueError("expert_mlp: biases need the expert indices the plan was built from")
    dtype = autocast_dtype(x)
    if dtype is not None:   # both CVMMs in the autocast dtype (the weights cast below)
        x = x.to(dtype)
    fused = activation in _FUSED_ACTIVATIONS and hidden_dropout is None and w_gate is None \
        and x.dim() == 2 and (dtype is not None or x.dtype == w1.dtype == w2.dtype)
    # zero hidden units, so the GPU kernels move the hidden rows in vectors
    pad = hidden_padding(x, w1, w2)
    if fused and not biased:   # the weights as they are: it casts and pads its own copies
        return _ReluExpertMLP.apply(x, w1, w2, gates.reshape(-1).to(x.dtype), plan.order,
                                    plan.token_of_row, plan.counts, plan.k, pad, dtype)[0]
    if dtype is not None:
        w1, w2 = w1.to(dtype), w2.to(dtype)
        w_gate = None if w_gate is None else w_gate.to(dtype)
    if fused:
        return _biased_relu_experts(x, plan, w1, w2, gates, b1, b2, indices)
    if pad:
        w1, w2 = _pad_units(w1, pad), _pad_units(w2, pad)
        w_gate = None if w_gate is None else _pad_units(w_gate, pad)
        b1 = None if b1 is None else torch.nn.functional.pad(b1, (0, pad))
    hidden = cvmm(x, plan, w1.transpose(1, 2), sorted_output=True)                  # [S, G]
    if b1 is not None:   # each sorted row's expert: the plan's order over the flat indices
        hidden = add_expert_bias(hidden, b1, indices.reshape(-1).index_select(0, plan.order),
                                 plan.counts)
    if w_gate is None:
        hidden = activation_fn(activation)(hidden)
    else:   # the GLU: the activated gate rows times the linear rows, in the same sorted order
        hidden = activation_fn(activation)(cvmm(x, plan, w_gate.transpose(1, 2),
                                                sorted_output=True)) * hidden
    if hidden_dropout is not None:
        hidden = hidden_dropout(hidden)
    y = cvmm(hidden, plan, w2, gates=gates, sorted_input=True)
    if b2 is not None:   # Σ_j g_j b2[e_j]; a dropped pair's gate is 0
        y = y + gather_sum(indices.reshape(-1, plan.k), gates.reshape(-1, plan.k),
                           b2).to(y.dtype)
    return y


def _biased_relu_experts(x: torch.Tensor, plan: DispatchPlan, w1: torch.Tensor,
                         w2: torch.Tensor, gates: torch.Tensor, b1: torch.Tensor | None,
                         b2: torch.Tensor | None, indices: torch.Tensor) -> torch.Tensor:
    """:func:`expert_mlp` of biased ReLU experts, ``Σ_j g_j (relu(x W1ᵀ + b1) W2 + b2)``, on
    the fused path of unbiased ones: each bias is a weight of a constant input of 1.

    - ``b1``: x gets columns of ones (one on the CPU paths; ``HIDDEN_MULTIPLE`` on the GPU
      paths, so that its rows stay 16-byte aligned), and ``W1`` the bias as the first of
      them and zeros in the rest: ``[x, 1] [W1, b1]ᵀ = x W1ᵀ + b1``.
    - ``b2``: one more hidden unit whose pre-activation is its bias 1 (zero weights in W1), so
      ``relu(1) = 1``, and whose row of W2 is ``b2``: ``h W2 + 1 · b2``. On the GPU paths it
      takes the first of the zero units that pad the hidden width anyway; where the width is
      already a multiple of ``HIDDEN_MULTIPLE`` (no free unit), ``b2`` is added by
      :func:`~sparseffn.ops.rows.gather_sum` instead. Further padding units also get bias 1
      and a zero row of W2: they add exactly zero (NaN only where the token's input is not
      finite, whose output is NaN anyway).

    The gradients come out of the same kernels: ``b1``'s is each expert's column sum of the
    pre-activation gradient (the dW1 product's ones column), ``b2``'s each expert's
    gate-weighted sum of the output gradient (the unit's row of dW2), and each gate's
    gradient includes ``<dy, b2[e]>`` (the unit's share of the dots). Against the unfused
    path (an add and a ReLU pass over the [pairs, G] hidden units, a separate activation
    gradient, ``b2`` through its own gather and scatter) this costs a copy of x with the
    extra columns, the concatenated weights and (on the CPU paths) one more hidden unit. As
    for ``nn.Linear`` under autocast, the biases enter the products rounded to the autocast
    dtype; each row's sum is accumulated in float32 and rounded once."""
    num_experts, width, d_in = w1.shape
    multiple = hidden_multiple(x, w1, w2)
    pad = -width % multiple
    unit = b2 is not None and (multiple == 1 or pad > 0)   # where b2 rides its unit
    added = pad if multiple > 1 else int(unit)                # hidden units appended
    if b1 is None:
        b1 = w1.new_zeros(num_experts, width)
    unit_bias = 1.0 if unit else 0.0
    bias_in = torch.nn.functional.pad(b1.to(w1.dtype), (0, added), value=unit_bias)
    w1 = torch.cat([_pad_units(w1, added), bias_in.unsqueeze(2)], 2)      # [E, G', d_in + 1]
    if multiple > 1:
        w1 = torch.nn.functional.pad(w1, (0, multiple - 1))               # [E, G', d_in + c]
    x = torch.nn.functional.pad(x, (0, multiple), value=1.0)              # [T, d_in + c]
    if unit:   # the unit's row of W2 is b2; the padding units' rows are zero
        w2 = _pad_units(torch.cat([w2, b2.to(w2.dtype).unsqueeze(1)], 1), added - 1)
    else:
        w2 = _pad_units(w2, added)
    y = _ReluExpertMLP.apply(x, w1, w2, gates.reshape(-1).to(x.dtype), plan.order,
                             plan.token_of_row, plan.counts, plan.k, 0, None)[0]
    if b2 is not None and not unit:   # Σ_j g_j b2[e_j]; a dropped pair's gate is 0
        y = y + gather_sum(indices.reshape(-1, plan.k), gates.reshape(-1, plan.k),
                           b2).to(y.dtype)
    return y


_ONES_COLUMNS = 8


def add_expert_bias(hidden: torch.Tensor, bias: torch.Tensor, expert_of_row: torch.Tensor,
                    counts: torch.Tensor) -> torch.Tensor:
    """``hidden[r] + bias[expert_of_row[r]]`` for expert-sorted rows (in ``hidden``'s dtype).

    hidden: [S, G]; bias: [E, G]; expert_of_row: int [S]; counts: [E], the rows of each
    expert, in order (rows past ``Σ counts``, pairs dropped at capacity, give ``bias`` no
    gradient). Where a gradient is wanted, ``bias``'s is each expert's sum of its rows'
    gradients by ``sparseffn::expert_weight_grad`` (:class:`_ExpertBiasRows`)."""
    if not grad_wanted(bias):
        return hidden + bias.index_select(0, expert_of_row).to(hidden.dtype)
    return _ExpertBiasRows.apply(hidden, bias, expert_of_row, counts)


def _bias_rows_with_graph(ctx, grad):
    """:class:`_ExpertBiasRows`' gradients in differentiable ops, for second derivatives (see
    :func:`~sparseffn.ops.grad_mode.differentiable_once`): the identity for the hidden
    units, each expert's rows summed by ``index_add`` for the bias. The rows are sorted by
    expert, so each row's expert follows from the counts; rows past ``Σ counts`` (expert E)
    go to a row that is dropped."""
    counts, = ctx.saved_tensors
    grad_bias = None
    if ctx.needs_input_grad[1]:
        experts = counts.shape[0]
        grad_bias = grad.new_zeros(experts + 1, grad.shape[1]).index_add(
            0, portable.expert_of_sorted_rows(counts, grad.shape[0]), grad
        )[:experts].to(ctx.bias_dtype)
    return (grad if ctx.needs_input_grad[0] else None), grad_bias, None, None


class _ExpertBiasRows(torch.autograd.Function):
    """:func:`add_expert_bias` with a gradient for the bias summed in a fixed order.

    ``index_select``'s own backward is an ``index_add_``: on CUDA every row of an expert adds
    atomically into the same G elements (4,096 rows into each of 8 experts' at the byte LM's
    sparse FFF), in an order that changes from run to run; under deterministic algorithms
    PyTorch sorts the indices and adds each expert's rows in turn. Here the rows are already
    sorted by expert, so the sum is ``Σ_r 1 · grad_r`` over each expert's rows: the expert
    weight gradient with a column of ones, a grouped product with float32 accumulation and
    no atomics (the split-K Triton kernel on CUDA), rounded once to the gradient's dtype."""
    generate_vmap_rule = True

    @staticmethod
    def forward(hidden, bias, expert_of_row, counts):
        return hidden + bias.index_select(0, expert_of_row).to(hidden.dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[3])
        ctx.bias_dtype = inputs[1].dtype

    @staticmethod
    @differentiable_once(with_graph=_bias_rows_with_graph)
    def backward(ctx, grad):
        counts, = ctx.saved_tensors
        grad_bias = None
        if ctx.needs_input_grad[1]:   # [E, 8, G]: Σ_r 1ᵀ grad_r per expert, 8 times over
            # (8 columns of ones: torch._grouped_mm, the PyTorch path on CUDA, takes rows of
            # whole 16-byte vectors only)
            ones = grad.new_ones(grad.shape[0], _ONES_COLUMNS)
            grad_bias = kernels.expert_weight_grad(ones, grad.contiguous(), counts, None, None,
                                                   None)[:, 0].to(ctx.bias_dtype)
        return (grad if ctx.needs_input_grad[0] else None), grad_bias, None, None


def _relu_expert_mlp_by(cvmm_rows, x, w1, w2, gates, order, tokens, counts, k, pad, dtype):
    """:class:`_ReluExpertMLP`'s forward, its products by ``cvmm_rows`` (the operator, or
    its differentiable portable form): ``(y, h, W1', W2')``."""
    w1c, w2c = _compute_copy(w1, pad, dtype), _compute_copy(w2, pad, dtype)
    gate_rows = gates.index_select(0, order)
    hidden, _ = cvmm_rows(x, w1c.transpose(1, 2), counts, tokens, None, None, order.shape[0], 1,
                          True, None, None)
    y, _ = cvmm_rows(hidden, w2c, counts, None, order, gate_rows, x.shape[0], k, False, None,
                     None)
    return y, hidden, w1c, w2c


def _relu_expert_mlp_with_graph(ctx, grad_y, *_grad_saved):
    """:class:`_ReluExpertMLP`'s gradients in differentiable ops, for second derivatives (see
    :func:`~sparseffn.ops.grad_mode.differentiable_once`): its forward's portable form,
    differentiated by autograd."""
    x, _, _, gates, _, order, tokens, counts, w1, w2 = ctx.saved_tensors
    inputs = (x, w1, w2, gates, order, tokens, counts, ctx.k, ctx.pad, ctx.compute_dtype)
    return gradients_of(functools.partial(_relu_expert_mlp_by, portable.cvmm_rows), inputs,
                        ctx.needs_input_grad, (grad_y, None, None, None))


class _ReluExpertMLP(torch.autograd.Function):
    """Both layers of ReLU experts, with the ReLU and its derivative, the gate scaling and the
    gate gradient folded into the ``sparseffn::cvmm_rows`` epilogues (no separate passes over
    the [S, expert_size] hidden units).

    Takes the weights [E, G, ·] as they are, with ``dtype`` (the autocast dtype, or None) and
    ``pad`` (zero hidden units to add, :func:`hidden_padding`): the products run on copies cast
    and padded here, and the weight gradients come back as the weights' own, [E, G, ·] in
    their dtype, written so by the weight-gradient kernel from its float32 sums (not a
    gradient of the padded copy that autograd would slice and cast back: two weight-sized
    copies and launches less a step, and one rounding).

    Saves the input, the weights' copies, the gates and the hidden units h = relu(x W1ᵀ)
    [S, G] in sorted order (the ReLU's derivative is read off h > 0). The forward returns
    ``(y, h, W1', W2')``, all but y outputs without a gradient, so that ``torch.func``
    transforms and ``torch.compile`` see what is saved (a weight used as it is comes back as
    a view of itself)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x, w1, w2, gates, order, tokens, counts, k, pad, dtype):
        return _relu_expert_mlp_by(kernels.cvmm_rows, x, w1, w2, gates, order, tokens, counts,
                                   k, pad, dtype)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w1, w2, gates, order, tokens, counts, k, pad, dtype = inputs
        _, hidden, w1c, w2c = output
        ctx.mark_non_differentiable(*output[1:])
        ctx.set_materialize_grads(False)   # no zero gradients built for h and the copies
        # (the weights themselves last, for the second derivatives' recomputation only: a
        # copy made inside the forward carries no autograd history)
        ctx.save_for_backward(x, w1c, w2c, gates, hidden, order, tokens, counts, w1, w2)
        ctx.k, ctx.pad, ctx.compute_dtype = k, pad, dtype
        ctx.weights = (w1.shape[1], w1.dtype, w2.dtype)

    @staticmethod
    @differentiable_once(with_graph=_relu_expert_mlp_with_graph)
    def backward(ctx, grad_y, *_grad_saved):
        if grad_y is None:   # (the output took no part in what is differentiated)
            return (None,) * 10
        x, w1, w2, gates, hidden, order, tokens, counts, _, _ = ctx.saved_tensors
        width, w1_dtype, w2_dtype = ctx.weights
        need_x, need_w1, need_w2, need_g = ctx.needs_input_grad[:4]
        grad_y = grad_y.contiguous()
        gate_rows = backward_gate_rows(gates, order)
        grad_x = grad_w1 = grad_w2 = grad_g = None
        # dh = g · dy W2ᵀ masked by relu'; the gate gradient is <dy W2ᵀ, h> (unscaled rows)
        grad_pre, dots = kernels.cvmm_rows(grad_y, w2.transpose(1, 2), counts, tokens, None,
                                           gate_rows, order.shape[0], 1, False, hidden, hidden)
        if need_g:
            grad_g = _pairs_to_slots(order, dots)
        if need_w2:   # dW2_e = Σ_r g_r h_rᵀ dy_r
            grad_w2 = kernels.expert_weight_grad(hidden, grad_y, counts, None, tokens, gate_rows,
                                                 width, w2_dtype)
        if need_x:    # dx_t = Σ_{r of t} dpre_r W1[e_r]
            grad_x, _ = kernels.cvmm_rows(grad_pre, w1, counts, None, order, None, x.shape[0],
                                          ctx.k, False, None, None)
        if need_w1:   # dW1_e = Σ_r dpre_rᵀ x_r
            grad_w1 = kernels.expert_weight_grad(grad_pre, x, counts, None, tokens, None, width,
                                                 w1_dtype)
        return grad_x, grad_w1, grad_w2, grad_g, None, None, None, None, None, None


def _compute_copy(weight: torch.Tensor, pad: int, dtype: torch.dtype | None) -> torch.Tensor:
    """``weight`` [E, G, ·] in ``dtype`` (None: its own) with ``pad`` zero rows after each
    expert's G: a new tensor, or a view of ``weight`` where nothing changes (an autograd
    function with ``setup_context`` may save an input it returns only as a view)."""
    if dtype is not None and weight.dtype != dtype:
        return _pad_units(weight.to(dtype), pad)
    return _pad_units(weight, pad) if pad else weight.view_as(weight)


def few_pairs_tokens(k: int, w1: torch.Tensor, w2: torch.Tensor,
                     w_gate: torch.Tensor | None = None) -> int:
    """The most tokens whose k pairs come to ``FEW_PAIRS_MACS`` multiply-adds at most (weights
    as :func:`expert_mlp_few` takes them). An integer bound, ``⌊M / macs per token⌋``, so that
    under torch.export with a dynamic token count ``tokens <= bound`` is an integer guard (a
    rational one, 65536/9 tokens, failed the export's constraint solver with "Expected op to
    be '=='")."""
    d_in = w1.shape[2] * (1 if w_gate is None else 2)
    return FEW_PAIRS_MACS // (k * w1.shape[1] * (d_in + w2.shape[2]))


def expert_mlp_few_ok(x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor,
                      w1: torch.Tensor, w2: torch.Tensor, activation: str = "relu",
                      b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                      w_gate: torch.Tensor | None = None) -> bool:
    """True when :func:`expert_mlp_few` computes these experts (arguments as it takes them)
    better than the plan does: no gradient is wanted (inference), the C kernel takes the
    tensors (CPU float32, weights with a unit last stride; under CPU autocast, float32
    weights and any floating x and gates, see :func:`expert_mlp_few`) and the pairs come to
    at most ``FEW_PAIRS_MACS`` multiply-adds."""
    tensors = (x, gates, w1, w2, b1, b2, w_gate)
    if grad_wanted(*tensors):
        return False
    if x.dim() != 2 or indices.dim() != 2 or exported_for_any_size(indices.shape[0]):
        return False
    if indices.shape[0] > few_pairs_tokens(indices.shape[1], w1, w2, w_gate):
        return False
    if autocast_dtype(x) is not None:    # x and gates go in as float32
        if not (x.is_cpu and x.is_floating_point() and gates.is_floating_point()):
            return False
        tensors = (None, None, *tensors[2:])
    return native.mlp_pairs_usable(*tensors, activation)


def expert_mlp_few(x: torch.Tensor, indices: torch.Tensor, gates: torch.Tensor,
                   w1: torch.Tensor, w2: torch.Tensor, activation: str = "relu",
                   b1: torch.Tensor | None = None, b2: torch.Tensor | None = None,
                   w_gate: torch.Tensor | None = None,
                   dispatched: torch.Tensor | None = None) -> torch.Tensor:
    """What :func:`expert_mlp` computes, for a few tokens and without a dispatch plan: each
    token's k experts read straight from the weights (the operator
    ``sparseffn::expert_mlp_pairs``). Inference only (no autograd formula): use it where
    :func:`expert_mlp_few_ok` says so, as :class:`~sparseffn.stores.MLPExperts` does.

    x: [T, d_in]; indices: int [T, k] in ``[0, E)`` (ValueError otherwise, checked as
    :meth:`DispatchPlan.build` checks); gates: [T, k]; w1, w_gate: [E, G, d_in]; w2:
    [E, G, d_out]; b1: [E, G]; b2: [E, d_out]; dispatched: bool [T, k] or None: pairs where it
    is False are not computed and add zero. Returns [T, d_out], in the autocast dtype under
    autocast, as :func:`expert_mlp` does.

    Under autocast the pairs run in float32 on the weights as they are (x and the gates cast
    to float32, the result to the autocast dtype): a pair reads only its expert's rows, where
    casting the weights to the autocast dtype would read every expert's. A σ-MoE layer of 256
    experts of 128 at d_model 512 decoding one token under CPU bf16 autocast took 11.4 ms
    with the cast, and 0.4 ms (as in float32) without."""
    check_expert_indices(indices, w1.shape[0])
    dtype = autocast_dtype(x)
    if dtype is not None:
        return kernels.expert_mlp_pairs(x.float(), indices, gates.float(), w1, w2, activation,
                                        b1, b2, w_gate, dispatched).to(dtype)
    return kernels.expert_mlp_pairs(x, indices, gates, w1, w2, activation, b1, b2, w_gate,
                                    dispatched)
