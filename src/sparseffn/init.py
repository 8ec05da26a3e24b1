"""Initialisation schemes of Csordás et al. 2023 §5."""

from __future__ import annotations

import math

import torch


def dense_init_std(fan_in: int, init_depth: int) -> float:
    """``sqrt(2 / (fan_in · init_depth))``: Csordás et al.'s pre-LayerNorm init of an MLP matrix whose
    input has ``fan_in`` units, for a stack of ``init_depth`` blocks."""
    return math.sqrt(2.0 / (fan_in * init_depth))


@torch.no_grad()
def equal_norm_rows_(weight: torch.Tensor, std: float) -> torch.Tensor:
    """σ-MoE's selection init (Csordás et al. 2023 §5): draw N(0, 1), rescale every row to norm 1,
    then rescale the whole matrix so that its entries have RMS ``std``. All rows keep equal norm,
    so at
    initialisation only the angle between x and a row decides its score."""
    weight.normal_()
    # Unit rows have an RMS entry of 1/sqrt(fan_in); scale it to ``std``.
    fan_in = weight.shape[-1]
    weight.div_(weight.norm(dim=-1, keepdim=True).clamp_min(1e-12))
    weight.mul_(std * math.sqrt(fan_in))
    return weight
