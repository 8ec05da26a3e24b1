"""Models built around sparse FFN layers: a causal Transformer LM and a classifier."""

from .classifier import ClassifierConfig, SparseClassifier
from .generate import Decoder, generate
from .lm import LMConfig, TransformerLM
from .presets import PRESETS, FFNLayout, ffn_preset

__all__ = ["ClassifierConfig", "Decoder", "FFNLayout", "LMConfig", "PRESETS", "SparseClassifier",
           "TransformerLM", "ffn_preset", "generate"]
