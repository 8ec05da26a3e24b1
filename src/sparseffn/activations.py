"""Activation functions by the names configs use (``ACTIVATIONS`` in config.py)."""

from __future__ import annotations

from typing import Callable

import torch
from torch.nn import functional as F

def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU with the tanh approximation (Hendrycks & Gimpel 2016, arXiv:1606.08415 §2;
    GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x·σ(1.702·x): GELU's sigmoid approximation (Hendrycks & Gimpel 2016,
    arXiv:1606.08415 §2), the MLP activation of OpenAI's CLIP (Radford et al. 2021,
    arXiv:2103.00020; Hugging Face's ``quick_gelu``)."""
    return x * torch.sigmoid(1.702 * x)


# "silu" is x·σ(x) (Elfwing et al. 2018, arXiv:1702.03118; "swish" in Ramachandran et al.
# 2017), the gate of SwiGLU MLPs (Shazeer 2020, arXiv:2002.05202) as in Llama.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": F.relu, "gelu": F.gelu, "gelu_tanh": gelu_tanh, "silu": F.silu,
    "quick_gelu": quick_gelu}
ACTIVATIONS = tuple(_ACTIVATIONS)


def activation_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function a config names (validated by the config)."""
    return _ACTIVATIONS[name]
