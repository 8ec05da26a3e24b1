"""Activation functions by the names configs use (``ACTIVATIONS`` in config.py)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"relu": F.relu, "gelu": F.gelu}
ACTIVATIONS = tuple(_ACTIVATIONS)


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config names (validated by the config)."""
    return _ACTIVATIONS[name]
