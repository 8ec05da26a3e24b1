"""The dtype the products run in under autocast, in one place for every router, store and
operator that casts its input itself (so that a layer can tell when two of them would cast
the same tensor to the same dtype, and cast it once)."""

from __future__ import annotations

import torch


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The autocast dtype of ``x``'s device while autocast is on there, else None."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
