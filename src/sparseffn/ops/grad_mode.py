"""Whether autograd will record an op: the test behind every inference-only path (the expert
MLPs of a few tokens, the exported ``If`` between those and the plan, product-key scores
without a backward, the tree's expansion without an autograd node, the rows' shared index);
and :func:`differentiable_once`, the backward of every autograd Function here."""

from __future__ import annotations

import functools
from typing import Optional

import torch


def grad_wanted(*tensors: Optional[torch.Tensor]) -> bool:
    """True when autograd records an op on ``tensors``: grad mode is on and one of them
    (None entries skipped) requires grad. False is inference, where a path with no backward
    may run."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def differentiable_once(backward):
    """Decorate an autograd Function's ``backward``: it runs without recording (as under
    ``torch.autograd.function.once_differentiable``), and a gradient it returns while a graph
    is built (``create_graph=True``) raises when differentiated again, with whatever
    ``inputs`` that differentiation names.

    ``once_differentiable`` alone hangs its error on fresh leaves only: ``.backward()``
    reaches them and raises, but ``torch.autograd.grad(first, inputs=[x])`` prunes them and
    returns a second derivative that silently leaves the Function out (a σ-MoE's input
    Hessian-vector product came out at a sixth of the loop reference's norm), and it guards
    nothing when the incoming gradient requires no grad (``grad(y.sum(), x,
    create_graph=True)``). Here the error node takes the incoming gradients and the
    Function's saved tensors that require grad (its input, its weights), so every path from
    a second differentiation to them runs into it. Inside ``torch.func`` transforms, whose
    ``grad`` builds its graph with ``create_graph=True`` for a first derivative, nothing is
    added, and a backward under two differentiating transforms (``grad(grad(f))``, which
    ``once_differentiable`` let through with the Function left out) raises at once."""
    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        recording = torch.is_grad_enabled()
        if recording and torch._C._are_functorch_transforms_active():
            if _functorch_derivatives() > 1:   # torch.func.grad(grad(f)), jacrev(grad(f))
                raise _second_derivative_error(type(ctx).__name__)
            recording = False
        with torch.no_grad():
            outputs = backward(ctx, *grads)
        if not recording:
            return outputs
        sources = [t for t in (*grads, *ctx.saved_tensors)
                   if isinstance(t, torch.Tensor) and t.requires_grad]
        if not sources:
            return outputs
        single = not isinstance(outputs, tuple)
        outputs = (outputs,) if single else outputs
        guarded = _NoSecondDerivative.apply(type(ctx).__name__, len(outputs), *outputs, *sources)
        guarded = tuple(guarded[:len(outputs)])
        return guarded[0] if single else guarded
    return wrapper


class _NoSecondDerivative(torch.autograd.Function):
    """Copies of the first ``n`` tensors (None passes), with the rest as further inputs; its
    backward raises, naming the Function whose gradients it guards."""

    @staticmethod
    def forward(ctx, name, n, *tensors):
        ctx.name = name
        return tuple(None if t is None else t.detach().clone() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise _second_derivative_error(ctx.name)


def _second_derivative_error(backward_name: str) -> RuntimeError:
    # "_CVMMBackward", or "_CVMMGeneratedBackward" under torch.func: "CVMM"
    name = backward_name.removesuffix("Backward").removesuffix("Generated").lstrip("_")
    return RuntimeError(
        f"sparseffn: trying to differentiate twice through {name}, whose backward runs fused "
        "kernels that are differentiable once: a second derivative through a sparse layer (a "
        "gradient taken with create_graph=True, then differentiated; torch.func.grad of "
        "torch.func.grad) is not supported")


def _functorch_derivatives() -> int:
    """How many ``torch.func`` differentiation transforms (``grad``, ``vjp``, ``jacrev``,
    ``jvp``, ...) are active around the running code; 0 where PyTorch does not say."""
    try:
        from torch._C._functorch import TransformType
        from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    except ImportError:
        return 0
    return sum(i.key() in (TransformType.Grad, TransformType.Jvp)
               for i in retrieve_all_functorch_interpreters())
