"""Named FFN presets sized to a dense MLP's parameters, for comparing layers at equal
parameters (Csordás et al. 2023 §6: every sparse layer is compared with the dense MLP of the same
size).

``ffn_preset(name, d_model, d_ff, n_layers)`` returns the block layout of an LM whose FFNs each
have at most the parameters of ``DenseMLPConfig(d_model, d_ff)`` (as close as the layer's
granularity allows; :meth:`LMConfig.cost` reports the exact counts):

| name | layer | source |
|---|---|---|
| ``dense`` | the dense MLP itself | Csordás et al. 2023 Eq. 1-2 |
| ``sigma_moe`` | σ-MoE, 8 experts, k = 2, entropy regulariser | Csordás et al. 2023 §5 |
| ``softmax_moe`` | σ-MoE's experts behind softmax top-k gates | Csordás et al. 2023 Table 4 |
| ``sbase`` | σ-MoE's experts behind S-BASE (Sinkhorn) routing, as in Table 4 | Clark et al. 2022 |
| ``switch`` | MoE with the Switch router: top-1, capacity 1.25, balance + z-loss | Fedus et al. 2022 |
| ``glam`` | GShard top-2 MoE in every other block, dense MLPs between | GLaM (Du et al. 2022) |
| ``fff`` | a fast feed-forward tree of 8 leaves | Chaunin & Mikhailovskiy |
| ``fff_sparse`` | the same tree trained on its top-2 leaves by R, renormalised (σ-MoE's active width) | |
| ``pkm`` | a product-key memory, 4 heads, k = 32 | Csordás et al. 2023 §3.2 |
| ``peer`` | PEER, 4 heads × k = 8 single-neuron experts | He 2024 §3 |

``overrides`` change the preset's fields (``num_experts``, ``k``, ``depth``, ``heads`` ...);
the size field (expert_size, leaf_width, num_subkeys, num_experts for PEER) is then fitted
to the budget again unless it is given too. A ``router`` override given as a dict without
``type`` (a TOML ``[model.ffn_options.router]`` table) changes only the fields it names of the
preset's router; one with ``type``, or a router config, replaces it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..config import (DenseMLPConfig, FFFConfig, LayerConfig, MoEConfig, PEERConfig, PKMConfig,
                      SigmaMoEConfig)
from ..layers.product_keys import _largest_fitting
from ..registry import RouterConfig, resolve_router
from ..router_config import (GShardRouterConfig, SBaseRouterConfig, SoftmaxRouterConfig,
                             SwitchRouterConfig)


@dataclass(frozen=True)
class FFNLayout:
    """Which FFN each block of an LM gets: ``ffn`` in every ``sparse_every``-th block,
    ``dense_ffn`` in the others."""

    ffn: LayerConfig
    sparse_every: int = 1
    dense_ffn: LayerConfig | None = None


def _budget(d_model: int, d_ff: int) -> int:
    return DenseMLPConfig(d_model=d_model, d_ff=d_ff).cost().total_params


def _fitted(cls, size_field: str, d_model: int, d_ff: int, fields: dict) -> LayerConfig:
    """``cls(d_model, **fields)`` with ``size_field`` the largest value whose parameters fit
    the dense budget (or as given in ``fields``)."""
    if size_field in fields:
        return cls(d_model=d_model, **fields)
    def make(n: int) -> LayerConfig:
        return cls(d_model=d_model, **{size_field: n}, **fields)
    budget = _budget(d_model, d_ff)
    return make(_largest_fitting(lambda n: make(n).cost().total_params, budget,
                                 f"{cls.__name__} preset"))


def _with_overrides(defaults: dict, overrides: dict) -> dict:
    """A preset's fields ``defaults`` with ``overrides`` on top, where a ``router`` dict
    without ``type`` changes only the fields it names of the preset's router (a router config,
    or a dict of fields the layer's own default router takes)."""
    fields = {**defaults, **overrides}
    preset_router, given = defaults.get("router"), overrides.get("router")
    if isinstance(given, dict) and "type" not in given:
        if isinstance(preset_router, dict):
            fields["router"] = {**preset_router, **given}
        elif isinstance(preset_router, RouterConfig):
            fields["router"] = resolve_router(given, preset_router, RouterConfig, "ffn_options")
    return fields


def _moe(d_model: int, d_ff: int, n_layers: int, defaults: dict, overrides: dict,
         cls=MoEConfig) -> LayerConfig:
    return _fitted(cls, "expert_size", d_model, d_ff,
                   {"init_depth": n_layers, **_with_overrides(defaults, overrides)})


def _dense(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    return FFNLayout(DenseMLPConfig(d_model=d_model, d_ff=d_ff, init_depth=n_layers, **overrides))


def _sigma_moe(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    defaults = {"num_experts": 8, "k": 2}
    return FFNLayout(_moe(d_model, d_ff, n_layers, defaults, overrides, SigmaMoEConfig))


def _softmax_moe(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    # Csordás et al. 2023 Table 4 compares the MoE variants at σ-MoE's K and G: only the
    # router differs, so FLOPs and memory are those of sigma_moe (their §6)
    defaults = {"num_experts": 8, "k": 2, "router": SoftmaxRouterConfig()}
    return FFNLayout(_moe(d_model, d_ff, n_layers, defaults, overrides))


def _sbase(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    # S-BASE extended to k > 1 as in Csordás et al. 2023 Table 4 ("S-BASE, K=4"), with their
    # entropy regulariser (App. B, Table 9); the Sinkhorn plan is the training assignment
    defaults = {"num_experts": 8, "k": 2, "router": SBaseRouterConfig()}
    return FFNLayout(_moe(d_model, d_ff, n_layers, defaults, overrides))


def _switch(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    router = SwitchRouterConfig(capacity_factor=1.25, balance_weight=0.01, z_loss_weight=1e-3)
    defaults = {"num_experts": 8, "k": 1, "router": router, "init": "switch"}
    return FFNLayout(_moe(d_model, d_ff, n_layers, defaults, overrides))


def _glam(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    router = GShardRouterConfig(capacity_factor=2.0)
    defaults = {"num_experts": 8, "k": 2, "router": router}
    dense = DenseMLPConfig(d_model=d_model, d_ff=d_ff, init_depth=n_layers)
    return FFNLayout(_moe(d_model, d_ff, n_layers, defaults, overrides), 2, dense)


def _fff(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    fields = {"depth": 3, "init_depth": n_layers, "init": "sigma_moe", **overrides}
    return FFNLayout(_fitted(FFFConfig, "leaf_width", d_model, d_ff, fields))


def _fff_sparse(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    """``fff`` trained and evaluated on each token's 2 leaves of largest R through the MoE
    kernels, not on all 8 (beyond the papers, which train soft): the active width of
    ``sigma_moe``, so its step can cost less than dense, where soft training cannot.

    The two leaves' weights are renormalised to sum to one, and the tree's leaf-usage
    regulariser keeps its default weight. In ``compare_pydoc``'s LM (600 steps, two seeds,
    docs/fff.md) this reached soft training's bpc (2.791 against 2.794); unnormalised, 2.849."""
    defaults = {"train_mode": "sparse", "k": 2, "router": {"renormalize": True}}
    return _fff(d_model, d_ff, n_layers, _with_overrides(defaults, overrides))


def _pkm(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    fields = {"init_depth": n_layers, **overrides}
    if "num_subkeys" in fields:
        return FFNLayout(PKMConfig(d_model=d_model, **fields))
    return FFNLayout(PKMConfig.from_dense(d_model, d_ff, **fields))


def _peer(d_model, d_ff, n_layers, overrides) -> FFNLayout:
    fields = {"heads": 4, "k": 8, "init_depth": n_layers, **overrides}
    if "num_experts" in fields:
        return FFNLayout(PEERConfig(d_model=d_model, **fields))
    return FFNLayout(PEERConfig.from_dense(d_model, d_ff, **fields))


PRESETS: dict[str, Callable[..., FFNLayout]] = {
    "dense": _dense, "sigma_moe": _sigma_moe, "softmax_moe": _softmax_moe, "sbase": _sbase,
    "switch": _switch, "glam": _glam, "fff": _fff, "fff_sparse": _fff_sparse, "pkm": _pkm,
    "peer": _peer,
}


def ffn_preset(name: str, d_model: int, d_ff: int, n_layers: int = 1,
               **overrides: Any) -> FFNLayout:
    """The named FFN layout with at most the parameters of a dense MLP of width ``d_ff`` per
    block. Unknown names and fields are ValueErrors naming what is allowed."""
    if name not in PRESETS:
        raise ValueError(f"unknown FFN preset {name!r}; presets are {', '.join(PRESETS)}")
    try:
        return PRESETS[name](d_model, d_ff, n_layers, overrides)
    except TypeError as err:   # an override that is no field of the layer
        raise ValueError(f"FFN preset {name!r}: {err}") from None
