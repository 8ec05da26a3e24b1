"""Drop-in FFN layers: ``forward(x: [..., d_model]) -> [..., d_model]``, and the classic
mixtures of seed 004."""

from .classic import (DeepMixtureOfExperts, ExpertBank, GatedMixture,
                      HierarchicalMixtureOfExperts, MixtureOfExperts)
from .dense import DenseMLP
from .fff import FastFeedForward
from .moe import MoE
from .product_keys import PEER, ProductKeyMemory
from .sigma_moe import SigmaMoE
from .topk import TopKMLP

__all__ = ["DeepMixtureOfExperts", "DenseMLP", "ExpertBank", "FastFeedForward", "GatedMixture",
           "HierarchicalMixtureOfExperts", "MixtureOfExperts", "MoE", "PEER", "ProductKeyMemory",
           "SigmaMoE", "TopKMLP"]
