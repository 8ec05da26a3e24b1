"""Drop-in FFN layers: ``forward(x: [..., d_model]) -> [..., d_model]``."""

from .dense import DenseMLP
from .moe import MoE
from .sigma_moe import SigmaMoE
from .topk import TopKMLP

__all__ = ["DenseMLP", "MoE", "SigmaMoE", "TopKMLP"]
