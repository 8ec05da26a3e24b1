"""Tensors made without the input's device.

A factory call without ``device=`` (``torch.zeros(())``, ``torch.tensor(2.0)``) makes a CPU
tensor whatever device the model runs on. In a step compiled for a GPU such a tensor stops
CUDA graphs: Inductor skips them for the graph, or (with graph partitions) splits the graph
around it. No GPU is needed to find one: run the step on CPU inputs inside
:func:`made_off_device`, which sets the default device to meta, and everything made on meta
ignored the input's device.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class _MadeOn(TorchDispatchMode):
    """Records the operators whose outputs land on ``device``."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.device, self.found = device, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device:
                self.found.append(str(func))
        return out


@contextlib.contextmanager
def made_off_device() -> Iterator[list[str]]:
    """Inside, factory calls without a device make meta tensors; yields the list of the
    operators that made one (run the step on CPU tensors; the list should stay empty).
    ``torch.tensor(...)`` dispatches no operator: check the tensors a step keeps too."""
    with torch.device("meta"), _MadeOn("meta") as spy:
        yield spy.found


def off_device(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The entries of ``tensors`` made on meta (see :func:`made_off_device`)."""
    return {name: t.device.type for name, t in tensors.items() if t.device.type == "meta"}
