"""Expert stores: the experts' parameters and the arithmetic over them,
``store(x: [T, d_model], routing) -> [T, d_out]``."""

from .base import ExpertStore
from .mlp import MLP_EXPERT_INITS, MLPExperts
from .rows import NeuronExperts, ValueRows

__all__ = ["ExpertStore", "MLPExperts", "MLP_EXPERT_INITS", "NeuronExperts", "ValueRows"]
