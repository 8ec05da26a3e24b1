"""How many operators one eager step dispatches: the host's side of a step's cost.

An eager training step pays the host for every operator it dispatches (on the H100 machines
of the GPU benchmarks, 10-80 µs each: see docs/performance.md), and on a GPU each operator that
computes launches at least one kernel, which a CUDA graph still runs. Small layers are bound by
these counts, not by their FLOPs, so the counts are worth reading beside the times, and unlike
times they are the same on every machine.

:class:`OpCounter` records every ATen and ``sparseffn::`` operator below autograd (a
``TorchDispatchMode``: the backward's operators are seen too). A ``sparseffn::`` operator counts
as one, as it is one launch or a few on a GPU.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from torch.utils._python_dispatch import TorchDispatchMode

# Operators that only allocate or alias: no kernel runs for them on any device.
_NO_KERNEL = {"aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided",
              "aten._unsafe_view"}


def launches_kernel(func) -> bool:
    """False for operators that only make a view, alias or allocate (``view``, ``t``,
    ``detach``, ``empty`` ...); True for the others, which compute (on a GPU: at least one
    kernel launch)."""
    return not (func.is_view or str(func.overloadpacket) in _NO_KERNEL)


@dataclass
class OpCounts:
    """Operators dispatched, by name (``aten.mm``, ``sparseffn.cvmm_rows`` ...)."""

    by_name: Counter = field(default_factory=Counter)
    computing: Counter = field(default_factory=Counter)

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
        if launches_kernel(func):
            self.counts.computing[name] += 1
        return func(*args, **(kwargs or {}))


def count_ops(step: Callable[[], object]) -> OpCounts:
    """The operators one call of ``step`` dispatches (after a first call, so that lazy
    initialisation is not counted)."""
    step()
    with OpCounter() as counter:
        step()
    return counter.counts
