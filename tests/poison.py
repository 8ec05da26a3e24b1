"""Fresh memory that is never zero: every test runs with its uninitialised allocations filled.

A kernel must never return memory it did not write. On a CPU, ``torch.empty`` hands out
whatever a freed block held, often zeros, so a kernel that skips a row (a dropped pair, an
expert with no tokens, a tile past the end) can pass a comparison against its reference by
luck. While :func:`poisoned_allocations` is active, ``torch.empty``, ``torch.empty_like``,
``torch.empty_strided``, ``Tensor.new_empty`` and ``Tensor.new_empty_strided`` fill what they
return with :func:`poison_value` (the dtype's most negative value: finite, far from any
result, and not NaN, so tests of NaN propagation still read what the kernel wrote). The C
kernels' and the Triton kernels' wrappers allocate their outputs through these calls, so every
kernel test also checks that the kernel wrote its whole output.

``torch.compile`` cannot trace the wrappers, so a test that compiles gets the original
allocators back from its first call to ``torch.compile`` on (its compiled code allocates
through Inductor anyway). Dynamo learns which torch functions it may trace the first time it
traces, by looking them up on ``torch``; :func:`poisoned_allocations` lets it do so before the
first patch, or it would not know the original allocators afterwards.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import is_fake

_ALLOCATORS = ((torch, "empty"), (torch, "empty_like"), (torch, "empty_strided"),
               (torch.Tensor, "new_empty"), (torch.Tensor, "new_empty_strided"))


def poison_value(dtype: torch.dtype) -> float | int | bool:
    """What fresh memory of ``dtype`` holds under :func:`poisoned_allocations`."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point:
        return torch.finfo(dtype).min
    if dtype.is_complex:
        return torch.finfo(dtype.to_real()).min
    return torch.iinfo(dtype).min


def _poisoning(allocate):
    def allocate_poisoned(*args, **kwargs):
        out = allocate(*args, **kwargs)
        if is_fake(out) or any(isinstance(size, torch.SymInt) for size in out.shape):
            return out     # no memory: traced (torch.export), its sizes perhaps symbols
        if out.numel() and not out.is_meta and out.layout == torch.strided:
            with torch.no_grad():      # also for an allocation made with requires_grad=True
                out.fill_(poison_value(out.dtype))
        return out
    return allocate_poisoned


@functools.cache
def _let_dynamo_see_the_allocators() -> None:
    """Trace one call of each allocator while ``torch`` still holds the originals."""
    def allocate(x):
        return (torch.empty(1), torch.empty_like(x), torch.empty_strided((1,), (1,)),
                x.new_empty(1), x.new_empty_strided((1,), (1,)))
    torch.compile(allocate, backend="eager", fullgraph=True)(torch.ones(1))


def _let_device_contexts_see_the_allocators() -> None:
    """``with torch.device(...)`` gives a default device to the factory functions it finds in
    ``torch.utils._device._device_constructors()``, a set built on its first call (and kept)
    from what ``torch.empty`` and the others are at that moment. Built while they are
    patched (PyTorch 2.11 builds it lazily, as Hugging Face's meta-device init first enters
    such a context), it would hold the wrappers: every ``torch.empty`` inside a
    ``torch.device("meta")`` context would then land on the CPU. Build it with the originals."""
    constructors = getattr(getattr(torch.utils, "_device", None), "_device_constructors", None)
    if constructors is not None:
        constructors()


@contextlib.contextmanager
def poisoned_allocations() -> Iterator[None]:
    """Fill every uninitialised allocation (see the module docstring) until exit, or until
    ``torch.compile`` is first called."""
    _let_dynamo_see_the_allocators()
    _let_device_contexts_see_the_allocators()
    patches = pytest.MonkeyPatch()
    compile_patch = pytest.MonkeyPatch()
    compile_original = torch.compile

    def compile_unpoisoned(*args, **kwargs):
        patches.undo()
        return compile_original(*args, **kwargs)

    for owner, name in _ALLOCATORS:
        patches.setattr(owner, name, _poisoning(getattr(owner, name)))
    compile_patch.setattr(torch, "compile", compile_unpoisoned)
    try:
        yield
    finally:
        patches.undo()
        compile_patch.undo()
