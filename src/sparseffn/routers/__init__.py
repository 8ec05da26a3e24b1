"""Routing rules; each returns a :class:`sparseffn.routing.Routing`.

Each module holds one routing rule: its config (a frozen dataclass registered under a
``type`` name) and its router class (registered with ``@implements``), so
:func:`build_router` makes the router a config describes with no table to keep.
"""

from ..registry import ROUTERS, RouterConfig, build_router
from .base import Router
from .classic import DenseGateRouter, DenseGateRouterConfig, HierarchicalRouter, HierarchicalRouterConfig
from .expert_choice import ExpertChoiceRouter, ExpertChoiceRouterConfig
from .gshard import GShardRouter, GShardRouterConfig, gshard_top2
from .noisy import NoisyTopKRouter, NoisyTopKRouterConfig
from .product_keys import ProductKeyRouter, ProductKeyRouterConfig, ProductKeyTopK
from .sbase import SBaseRouter, SBaseRouterConfig
from .sigma import SigmaRouter, SigmaRouterConfig, SoftmaxRouter, SoftmaxRouterConfig
from .switch import SwitchRouter, SwitchRouterConfig
from .tree import TreeRouter, TreeRouterConfig

__all__ = ["DenseGateRouter", "DenseGateRouterConfig", "ExpertChoiceRouter",
           "ExpertChoiceRouterConfig", "GShardRouter", "GShardRouterConfig",
           "HierarchicalRouter", "HierarchicalRouterConfig", "NoisyTopKRouter",
           "NoisyTopKRouterConfig", "ProductKeyRouter", "ProductKeyRouterConfig", "ProductKeyTopK",
           "ROUTERS", "Router", "RouterConfig", "SBaseRouter",
           "SBaseRouterConfig", "SigmaRouter", "SigmaRouterConfig", "SoftmaxRouter",
           "SoftmaxRouterConfig", "SwitchRouter", "SwitchRouterConfig", "TreeRouter",
           "TreeRouterConfig", "build_router", "gshard_top2"]
