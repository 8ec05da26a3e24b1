"""Routing rules; each returns a :class:`sparseffn.routing.Routing`.

:func:`build_router` makes the router a :class:`~sparseffn.router_config.RouterConfig`
describes.
"""

from ..router_config import (DenseGateRouterConfig, GShardRouterConfig,
                             HierarchicalRouterConfig, NoisyTopKRouterConfig, RouterConfig,
                             SBaseRouterConfig, SigmaRouterConfig, SoftmaxRouterConfig,
                             SwitchRouterConfig, TreeRouterConfig)
from .base import Router
from .classic import DenseGateRouter, HierarchicalRouter
from .gshard import GShardRouter, gshard_top2
from .noisy import NoisyTopKRouter
from .sbase import SBaseRouter
from .sigma import SigmaRouter, SoftmaxRouter
from .switch import SwitchRouter
from .tree import TreeRouter

ROUTERS: dict[type, type] = {
    SigmaRouterConfig: SigmaRouter,
    SoftmaxRouterConfig: SoftmaxRouter,
    NoisyTopKRouterConfig: NoisyTopKRouter,
    SwitchRouterConfig: SwitchRouter,
    GShardRouterConfig: GShardRouter,
    SBaseRouterConfig: SBaseRouter,
    DenseGateRouterConfig: DenseGateRouter,
    HierarchicalRouterConfig: HierarchicalRouter,
    TreeRouterConfig: TreeRouter,
}


def build_router(config: RouterConfig, d_model: int, num_experts: int, k: int,
                 init: str = "sigma_moe", n_layers: int = 1) -> Router:
    """The router ``config`` describes, selecting ``k`` of ``num_experts`` experts."""
    try:
        cls = ROUTERS[type(config)]
    except KeyError:
        raise TypeError(f"no router is registered for {type(config).__name__}") from None
    return cls(config, d_model, num_experts, k, init=init, n_layers=n_layers)


__all__ = ["DenseGateRouter", "GShardRouter", "HierarchicalRouter", "NoisyTopKRouter",
           "ROUTERS", "Router", "SBaseRouter", "SigmaRouter", "SoftmaxRouter", "SwitchRouter",
           "TreeRouter", "build_router", "gshard_top2"]
