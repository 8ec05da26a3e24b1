"""Whether autograd will record an op: the test behind every inference-only path (the expert
MLPs of a few tokens, the exported ``If`` between those and the plan, product-key scores
without a backward, the tree's expansion without an autograd node, the rows' shared index);
and :func:`differentiable_once`, the backward of every autograd Function here, with
:func:`gradients_of` for its second derivatives."""

from __future__ import annotations

import functools
from typing import Optional

import torch


def grad_wanted(*tensors: Optional[torch.Tensor]) -> bool:
    """True when autograd records an op on ``tensors``: grad mode is on and one of them
    (None entries skipped) requires grad. False is inference, where a path with no backward
    may run."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def differentiable_once(*, with_graph):
    """Decorate an autograd Function's ``backward`` (``@differentiable_once(with_graph=
    gradients)``, ``gradients`` a function or a lambda: ``torch.compile`` traces this
    decorator's closure, and cannot take a ``functools.partial`` there): it runs the fused
    kernels without recording (as under
    ``torch.autograd.function.once_differentiable``), except while a graph is built
    (``create_graph=True``: gradient penalties, Hessian-vector products), where
    ``with_graph(ctx, *grads)`` computes the same gradients in differentiable PyTorch ops
    (most by :func:`gradients_of` a portable form of the forward), so that second
    derivatives through the Function are exact, however they are asked for.

    ``once_differentiable``, which the Functions used before, only hung an error on fresh
    leaves: ``.backward()`` reached them and raised, but ``torch.autograd.grad(first,
    inputs=[x])`` prunes them and returned a second derivative that silently left the
    Function out (a σ-MoE's input Hessian-vector product at a sixth of the right norm), as
    did an objective whose gradient requires no grad (``y.sum()``) and ``torch.func.grad`` of
    ``torch.func.grad``.

    Inside one ``torch.func`` differentiating transform, whose ``grad`` builds its graph with
    ``create_graph=True`` for a first derivative, the fused backward runs as it is; under two
    (``grad(grad(f))``, ``jacrev(grad(f))``) ``with_graph`` does."""
    def decorate(backward):
        @functools.wraps(backward)
        def wrapper(ctx, *grads):
            recording = torch.is_grad_enabled()
            if recording and torch._C._are_functorch_transforms_active():
                # one torch.func.grad records its first derivative's backward; two
                # (grad(grad(f)), jacrev(grad(f))) differentiate it
                recording = _functorch_derivatives() > 1
            if recording and any(isinstance(t, torch.Tensor) and t.requires_grad
                                 for t in (*grads, *ctx.saved_tensors)):
                return with_graph(ctx, *grads)
            with torch.no_grad():
                return backward(ctx, *grads)
        return wrapper
    return decorate


def gradients_of(forward, inputs: tuple, needs: tuple, grads: tuple) -> tuple:
    """The gradients of ``forward(*inputs)`` (a tensor or a tuple of them) with respect to
    each of ``inputs`` whose ``needs`` entry is true, given the output gradients ``grads``
    (None: that output takes no part), by autograd with ``create_graph=True``: what a
    Function's backward returns while a graph is built (``with_graph`` of
    :func:`differentiable_once`), when ``inputs`` are its saved inputs (which carry their
    autograd history) and ``forward`` computes its forward in differentiable ops. One entry
    per input: None where not needed or not reached.

    Each input enters the recomputation as a view of itself, and the gradients are taken
    with respect to the views: partial derivatives, as a backward returns. With respect to
    the inputs themselves, an input computed from another (a MoE's gates from its input x)
    would carry that path too, and the engine would then add it a second time."""
    with torch.enable_grad():
        inputs = tuple(t.view_as(t) if isinstance(t, torch.Tensor) and t.requires_grad else t
                       for t in inputs)
        outputs = forward(*inputs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    pairs = [(out, grad) for out, grad in zip(outputs, grads)
             if grad is not None and isinstance(out, torch.Tensor) and out.requires_grad]
    wanted = [i for i, (t, need) in enumerate(zip(inputs, needs))
              if need and isinstance(t, torch.Tensor) and t.requires_grad]
    result: list = [None] * len(inputs)
    if pairs and wanted:
        found = torch.autograd.grad([out for out, _ in pairs], [inputs[i] for i in wanted],
                                    [grad for _, grad in pairs], create_graph=True,
                                    allow_unused=True)
        for i, grad in zip(wanted, found):
            result[i] = grad
    return tuple(result)


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
