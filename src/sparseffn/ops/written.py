"""Allocating what a kernel overwrites in full.

Under deterministic algorithms (``torch.use_deterministic_algorithms(True)``, the default of
``sparseffn train``) PyTorch fills every new uninitialised tensor with NaN
(``torch.utils.deterministic.fill_uninitialized_memory``), so that reading memory nobody wrote
gives the same result on every run. For an output that a kernel then writes in full, that
fill is a wasted pass over its memory, and on a GPU a launch of its own. The C and Triton
kernels write every element of what they return (their tests allocate through poisoned
allocators, ``tests/poison.py``), and buffers they write in part are read only where written,
so their wrappers allocate without the fill.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.utils.deterministic


@contextlib.contextmanager
def written_in_full() -> Iterator[None]:
    """Within it, new tensors are not NaN-filled under deterministic algorithms (the setting
    is put back on exit); it does nothing when the fill is off. Also a decorator. For the
    allocations of a kernel's wrapper only: every tensor allocated inside must be written in
    full, or read only where written, before it is read. The setting is the process's: a
    tensor another thread allocates meanwhile is not filled either."""
    settings = torch.utils.deterministic
    if not (torch.are_deterministic_algorithms_enabled() and settings.fill_uninitialized_memory):
        yield
        return
    settings.fill_uninitialized_memory = False
    try:
        yield
    finally:
        settings.fill_uninitialized_memory = True
