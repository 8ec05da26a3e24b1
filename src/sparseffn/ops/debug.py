"""Checks that read tensors on the host, and when they run.

A check such as "every expert index lies in ``[0, num_experts)``" needs the indices' values
on the host. On a CPU tensor that costs a pass over the data; on a GPU it is a device
synchronisation, and under ``torch.compile`` a graph break. So these checks run on CPU
tensors always, on other devices only when asked (``set_checks(True)`` or the environment
variable ``SPARSEFFN_DEBUG=1``), and never while ``torch.compile`` traces.
"""

from __future__ import annotations

import os

import torch

_checks: bool | None = None


def set_checks(enabled: bool | None) -> None:
    """Run the host-side checks on every device (True), on CPU tensors only (False), or as
    ``SPARSEFFN_DEBUG`` says (None, the default)."""
    global _checks
    _checks = enabled


def checks_enabled(tensor: torch.Tensor) -> bool:
    """Whether a host-side check of ``tensor`` runs now."""
    if torch.compiler.is_compiling():
        return False
    if tensor.device.type == "cpu":
        return True
    if _checks is None:
        return os.environ.get("SPARSEFFN_DEBUG", "") not in ("", "0")
    return _checks


def indices_outside(indices: torch.Tensor, bound: int) -> tuple[int, int] | None:
    """``(lowest, highest)`` of ``indices`` when some index lies outside ``[0, bound)``, else
    None; None also when the check does not run now (:func:`checks_enabled`) or there are
    none. One pass over the indices (``aminmax``) and one host read."""
    if not checks_enabled(indices) or not indices.numel():   # (a size guard when traced)
        return None
    while torch._C._functorch.is_functorch_wrapped_tensor(indices):   # under torch.func:
        indices = torch._C._functorch.get_unwrapped(indices)          # every entry's at once
    low, high = map(int, torch.aminmax(indices))
    return (low, high) if low < 0 or high >= bound else None
