"""The dtype the products run in under autocast, in one place for every router, store and
operator that casts its input itself (so that a layer can tell when two of them would cast
the same tensor to the same dtype, and cast it once), and that one cast."""

from __future__ import annotations

import contextlib

import torch

from .grad_mode import differentiable_once

_NO_CONTEXT = contextlib.nullcontext()


def autocast_off(device_type: str):
    """A context that turns autocast off on ``device_type`` while it is on there, and does
    nothing (no ``torch.autocast`` object entered, about 2 µs saved a call) while it is off:
    float32 routing at small batches is host-bound."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return _NO_CONTEXT


def routing_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype routing computes its logits, scores and losses in for an input of ``dtype``:
    float32 for float32 and the half-precision dtypes (Switch Transformer's "selective
    precision"), float64 for float64, whose gates would otherwise be rounded to float32 (a
    float64 layer's gradients then disagree with finite differences by about 1e-7 / eps)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype of ``x``'s device while autocast is on there, else None."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _summed(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """``a + b`` where both are given, else the one that is (second derivatives of
    :class:`_CastForTwo`, in differentiable ops)."""
    return b if a is None else a if b is None else a + b


class _CastForTwo(torch.autograd.Function):
    """``x`` cast to ``dtype`` once and handed to two readers; the backward sums their
    gradients and casts the sum back to ``x``'s dtype in one operator (on a GPU one kernel:
    it reads the two reduced-precision gradients and writes the float32 one)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, dtype: torch.dtype):
        cast = x.to(dtype)
        return cast, cast.view_as(cast)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.input_dtype = inputs[0].dtype

    @staticmethod
    @differentiable_once(with_graph=lambda ctx, grad_a, grad_b: (
        _summed(grad_a, grad_b).to(ctx.input_dtype), None))
    def backward(ctx, grad_a: torch.Tensor | None, grad_b: torch.Tensor | None):
        if grad_a is None or grad_b is None:
            grad = grad_b if grad_a is None else grad_a
            return (None if grad is None else grad.to(ctx.input_dtype)), None
        # Summed in the reduced dtype, then widened: the bits of (a + b).to(float32), what
        # autograd gives one tensor read twice, without the intermediate tensor.
        out = torch.empty(grad_a.shape, dtype=ctx.input_dtype, device=grad_a.device)
        return torch.add(grad_a, grad_b, out=out), None


def cast_for_two(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [T, d] in ``dtype`` for two readers (a router and an expert store): one copy
    made and kept for the backward, and an input gradient that is the two readers' parts
    summed in ``dtype`` and widened to ``x.dtype`` by one operator, as for one ``nn.Linear``
    that read it. Returns two tensors sharing the cast's memory (the second a view of the
    first); do not modify them in place."""
    return _CastForTwo.apply(x, dtype)
