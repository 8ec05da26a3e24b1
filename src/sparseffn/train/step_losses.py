"""The training loop's host reads: each step's loss stays on the device until the loop needs it.

Reading a GPU tensor on the host (``float(loss)``, ``.item()``, ``.tolist()``) waits until the
device has run everything queued before it. Once a step, that keeps the host from queueing the
next step's kernels while the device runs this one, and a step that reads cannot be captured
in a CUDA graph. So on a GPU the trainer keeps each step's loss and auxiliary loss as device
scalars and reads them together where it stops anyway: at the log, evaluation and checkpoint
steps, the last step and a stop. On the CPU, where a read costs nothing, it reads each loss as
soon as it is computed, so that a non-finite loss stops the run before the parameters change
(:func:`reads_every_step`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


def reads_every_step(device: torch.device) -> bool:
    """Whether the trainer reads each step's loss at once on ``device`` (the CPU), rather than
    at the steps where it logs, evaluates or saves (a GPU)."""
    return device.type == "cpu"


def synchronize(device: torch.device) -> None:
    """Wait until ``device`` has run everything queued (nothing to wait for on the CPU): the
    loop's clock stops after this."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_values(scalars: list[torch.Tensor]) -> list[float]:
    """The values of device scalars (any float or integer dtype) as Python floats, in one
    host read: a float64 stack of them, exact for float32, bfloat16, float16 and integers
    below 2^53."""
    return torch.stack([value.double() for value in scalars]).tolist() if scalars else []


class StepLoss(NamedTuple):
    step: int       # 1-based: the step that computed the loss
    loss: float
    aux: float


class StepLosses:
    """The losses of the steps not read yet, as device scalars, in step order."""

    def __init__(self) -> None:
        self._pending: list[tuple[int, torch.Tensor, torch.Tensor]] = []

    def add(self, step: int, loss: torch.Tensor, aux: torch.Tensor) -> None:
        """Keep step ``step``'s loss and auxiliary loss (scalars; detached, so no graph is
        kept)."""
        self._pending.append((step, loss.detach(), aux.detach()))

    def read(self, average: Callable[[list[float]], list[float]] = list) -> list[StepLoss]:
        """Every pending step's values, in one host read, and forget them. ``average`` maps
        the flat list ``[loss, aux, loss, aux, ...]`` to the values reported (the mean over
        the data-parallel ranks: :meth:`sparseffn.train.parallel.Parallel.mean`)."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        values = average(host_values([value for _, loss, aux in pending
                                      for value in (loss, aux)]))
        return [StepLoss(step, values[2 * i], values[2 * i + 1])
                for i, (step, _, _) in enumerate(pending)]
