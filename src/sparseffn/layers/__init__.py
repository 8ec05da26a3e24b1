"""Drop-in FFN layers, ``forward(x: [..., d_model]) -> [..., d_model]``, each beside its
config: the dense MLP, the top-K MLP, the mixture of experts with any router (σ-MoE its
preset), the fast feed-forward tree, the product-key memory and PEER, and the classic
mixtures (Jacobs et al. 1991; Jordan & Jacobs 1994; Eigen, Ranzato & Sutskever 2013)."""

from .classic import (DeepMixtureOfExperts, ExpertBank, GatedMixture,
                      HierarchicalMixtureOfExperts, MixtureOfExperts)
from .dense import DenseMLP, DenseMLPConfig
from .fff import FastFeedForward, FFFConfig
from .moe import MoE, MoEConfig
from .product_keys import PEER, PEERConfig, PKMConfig, ProductKeyMemory
from .sigma_moe import SigmaMoE, SigmaMoEConfig
from .topk import TopKMLP, TopKMLPConfig

__all__ = ["DeepMixtureOfExperts", "DenseMLP", "DenseMLPConfig", "ExpertBank", "FFFConfig",
           "FastFeedForward", "GatedMixture", "HierarchicalMixtureOfExperts", "MixtureOfExperts",
           "MoE", "MoEConfig", "PEER", "PEERConfig", "PKMConfig", "ProductKeyMemory", "SigmaMoE",
           "SigmaMoEConfig", "TopKMLP", "TopKMLPConfig"]
