"""Router configurations (each now lives beside its router in :mod:`sparseffn.routers`; this
module keeps the names importable from here).

A :class:`~sparseffn.config.MoEConfig` holds one of these as its ``router`` field. Each
round-trips through a dict with a ``type`` field, so in TOML a router is a sub-table::

    [ffn]
    type = "moe"
    d_model = 512
    num_experts = 16
    expert_size = 128
    k = 1
    [ffn.router]
    type = "switch"
    capacity_factor = 1.25

``RouterConfig.check_layer(num_experts, k)`` rejects a router that cannot run with the
layer's ``num_experts`` and ``k`` (Switch is top-1, GShard top-2, a dense gate uses every
expert), naming what is allowed.
"""

from .registry import RouterConfig, require_capacity_factor, router_config_from
from .routers.classic import DenseGateRouterConfig, HierarchicalRouterConfig
from .routers.expert_choice import EXPERT_CHOICE_EVAL_ROUTINGS, ExpertChoiceRouterConfig
from .routers.gshard import GSHARD_SECOND_EXPERT, GShardRouterConfig
from .routers.noisy import NoisyTopKRouterConfig
from .routers.sbase import SBASE_ASSIGNMENTS, SBASE_ROUNDINGS, SBaseRouterConfig
from .routers.sigma import SIGMA_GATES, SigmaRouterConfig, SoftmaxRouterConfig
from .routers.switch import SwitchRouterConfig
from .routers.tree import TREE_FORMULATIONS, TREE_INITS, TreeRouterConfig, tree_depth

__all__ = ["DenseGateRouterConfig", "EXPERT_CHOICE_EVAL_ROUTINGS", "ExpertChoiceRouterConfig",
           "GSHARD_SECOND_EXPERT", "GShardRouterConfig",
           "HierarchicalRouterConfig", "NoisyTopKRouterConfig", "RouterConfig", "SBASE_ASSIGNMENTS",
           "SBASE_ROUNDINGS", "SBaseRouterConfig", "SIGMA_GATES", "SigmaRouterConfig",
           "SoftmaxRouterConfig", "SwitchRouterConfig", "TREE_FORMULATIONS", "TREE_INITS",
           "TreeRouterConfig", "require_capacity_factor", "router_config_from", "tree_depth"]
