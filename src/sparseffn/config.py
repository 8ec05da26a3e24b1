"""Layer configurations: one frozen dataclass per layer family, validated at construction.

Each config lives beside its layer (:mod:`sparseffn.layers`); this module keeps the names
importable from here.

Every config round-trips through plain dicts (and so through JSON/TOML) with a ``type``
field naming the family, so that an experiment is one file::

    cfg = SigmaMoEConfig(d_model=512, num_experts=16, expert_size=128, k=4)
    assert config_from_dict(cfg.to_dict()) == cfg

An impossible config raises ``ValueError`` naming the field and what is allowed.
"""

from .activations import ACTIVATIONS
from .layers.dense import DenseMLPConfig
from .layers.fff import FFF_EVAL_MODES, FFF_TRAIN_MODES, FFFConfig
from .layers.moe import MOE_INITS, MoEConfig
from .layers.product_keys import PKM_INITS, PKM_SCORES, PEERConfig, PKMConfig

PKM_ACTIVATIONS = PKM_SCORES   # the old name of PKMConfig.score's choices
from .layers.sigma_moe import SIGMA_MOE_GATES, SIGMA_MOE_INITS, SigmaMoEConfig
from .layers.topk import TopKMLPConfig
from .registry import LayerConfig, LayerCost, config_from_dict
from .routers.product_keys import PEER_SCORES, PK_QUERIES, PK_QUERY_NORMS, ProductKeySpec

__all__ = ["ACTIVATIONS", "DenseMLPConfig", "FFFConfig", "FFF_EVAL_MODES", "FFF_TRAIN_MODES",
           "LayerConfig", "LayerCost", "MOE_INITS", "MoEConfig", "PEERConfig", "PEER_SCORES",
           "PKMConfig", "PKM_ACTIVATIONS", "PKM_INITS", "PKM_SCORES", "PK_QUERIES", "PK_QUERY_NORMS",
           "ProductKeySpec", "SIGMA_MOE_GATES", "SIGMA_MOE_INITS", "SigmaMoEConfig",
           "TopKMLPConfig", "config_from_dict"]
