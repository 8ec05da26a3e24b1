"""How many operators one eager step dispatches: the host's side of a step's cost.

An eager training step pays the host for every operator it dispatches (on the H100 machines
of the GPU benchmarks, 10-80 µs each: see docs/performance.md), and on a GPU each operator that
computes launches at least one kernel, which a CUDA graph still runs. Small layers are bound by
these counts, not by their FLOPs, so the counts are worth reading beside the times, and unlike
times they are the same on every machine.

:class:`OpCounter` records every ATen and ``sparseffn::`` operator below autograd (a
``TorchDispatchMode``: the backward's operators are seen too). A ``sparseffn::`` operator counts
as one, as it is one launch or a few on a GPU.

It also adds up the bytes each computing operator reads and writes at its boundary
(``moved_bytes``): a device-independent proxy for the memory traffic of a step that is bound
by it, as a large MoE step on a GPU is. It is a lower bound where a fused operator moves
more inside (the Triton expert products write and re-read each token's k rows) and an upper
bound for a gather from a table (the whole table is counted as read).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._pytree import tree_flatten
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that only allocate or alias: no kernel runs for them on any device.
_NO_KERNEL = {"aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided",
              "aten._unsafe_view"}


def launches_kernel(func) -> bool:
    """False for operators that only make a view, alias or allocate (``view``, ``t``,
    ``detach``, ``empty`` ...); True for the others, which compute (on a GPU: at least one
    kernel launch)."""
    return not (func.is_view or str(func.overloadpacket) in _NO_KERNEL)


def _tensor_bytes(value) -> int:
    """Bytes of the tensors in ``value`` (nested): a broadcast (expanded) tensor counts the
    memory its strides span, not its logical size."""
    total = 0
    for t in tree_flatten(value)[0]:
        if isinstance(t, torch.Tensor) and t.numel():
            span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
            total += min(t.numel(), span) * t.element_size()
    return total


def boundary_bytes(args, kwargs, out) -> int:
    """Bytes an operator reads (its tensor arguments, but not an ``out=`` buffer) and writes
    (its results; an in-place operator's ``self`` is read and written)."""
    reads = {k: v for k, v in (kwargs or {}).items() if k != "out"}
    return _tensor_bytes(args) + _tensor_bytes(reads) + _tensor_bytes(out)


@dataclass
class OpCounts:
    """Operators dispatched, by name (``aten.mm``, ``sparseffn.cvmm_rows`` ...), and the bytes
    the computing ones read and write (``moved_bytes``, see :func:`boundary_bytes`)."""

    by_name: Counter = field(default_factory=Counter)
    computing: Counter = field(default_factory=Counter)
    moved_bytes: int = 0

    @property
    def total(self) -> int:
        """Every operator dispatched, views included."""
        return sum(self.by_name.values())

    @property
    def compute(self) -> int:
        """The operators that compute (see :func:`launches_kernel`)."""
        return sum(self.computing.values())


class OpCounter(TorchDispatchMode):
    """``with OpCounter() as counter: ...`` records each operator dispatched inside in
    ``counter.counts``."""

    def __init__(self) -> None:
        super().__init__()
        self.counts = OpCounts()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.counts.by_name[name] += 1
        out = func(*args, **(kwargs or {}))
        if launches_kernel(func):
            self.counts.computing[name] += 1
            self.counts.moved_bytes += boundary_bytes(args, kwargs, out)
        return out


def count_ops(step: Callable[[], object]) -> OpCounts:
    """The operators one call of ``step`` dispatches (after a first call, so that lazy
    initialisation is not counted)."""
    step()
    with OpCounter() as counter:
        step()
    return counter.counts
