"""The registries of routers and layers, the base classes of their configs, and the functions
that build a router or a layer from its config.

Every config is a frozen dataclass with a ``type_name``; defining one registers it under that
name (so ``config_from_dict`` / ``router_config_from`` can read it back from a dict, JSON or
TOML). Its module class registers itself with :func:`implements`::

    @dataclass(frozen=True)
    class MyRouterConfig(RouterConfig):
        type_name: ClassVar[str] = "mine"
        ...

    @implements(MyRouterConfig)
    class MyRouter(LinearRouter):
        ...

so :func:`build_router` and :func:`build_layer` need no second table.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import warnings
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from .validation import from_typed_dict


def implements(config_cls: type) -> Callable[[type], type]:
    """Class decorator: the decorated router or layer is what ``config_cls`` builds."""
    def register(module_cls: type) -> type:
        config_cls.module_class = module_cls
        return module_cls
    return register


class RegisteredConfig:
    """Base of the router and layer config families: defining a config registers it in its
    family's registry under its ``type_name``; ``to_dict`` writes that name as ``type``."""

    type_name: ClassVar[str]
    module_class: ClassVar[type]
    _registry: ClassVar[dict[str, type]]      # one per family, set on the family's base

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "_registry" not in cls.__dict__:   # a config, not a family's base
            cls._registry[cls.type_name] = cls
        own = cls.__dict__.get("__post_init__")
        if own is not None and not getattr(own, "checks_numbers", False):
            @functools.wraps(own)
            def __post_init__(self, _own=own):
                check_finite_numbers(self)
                _own(self)
            __post_init__.checks_numbers = True
            cls.__post_init__ = __post_init__

    def __post_init__(self) -> None:
        check_finite_numbers(self)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type_name, **dataclasses.asdict(self)}  # type: ignore[call-overload]


_FLOAT_ANNOTATIONS = {"float", "float | None", "Optional[float]", float}


def check_finite_numbers(config: Any) -> None:
    """Every field annotated ``float`` (or ``float | None``) of a config holds a finite real
    number (or None): a weight, rate or capacity of NaN, ±inf, a bool or a string is a
    ValueError naming the field (every registered config runs this before its own checks)."""
    for f in dataclasses.fields(config):
        if f.type not in _FLOAT_ANNOTATIONS:
            continue
        value = getattr(config, f.name)
        if value is None and f.type != "float" and f.type is not float:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value):
            raise ValueError(f"{type(config).__name__}.{f.name} must be a finite number, got "
                             f"{value!r}")


def config_argument(config_cls: type, config: Any, fields: dict[str, Any], owner: str) -> Any:
    """The config a layer's ``__init__`` was given: an instance of ``config_cls``, a dict of
    its fields (with or without its ``type``), or, with ``config=None``, keyword fields.
    Anything else is a TypeError naming what the layer takes."""
    if config is None:
        return config_cls(**fields)
    if fields:
        raise TypeError(f"{owner}: give a config or keyword fields, not both")
    if isinstance(config, dict):
        data = dict(config)
        type_name = data.pop("type", config_cls.type_name)
        if type_name != config_cls.type_name:
            raise TypeError(f"{owner} builds {config_cls.type_name!r} layers, got a dict of type "
                            f"{type_name!r} (sparseffn.build_layer builds any type)")
        return config_cls(**data)
    if not isinstance(config, config_cls):
        raise TypeError(f"{owner} takes a {config_cls.__name__} (or a dict of its fields), got "
                        f"{type(config).__name__}")
    return config


def _module_class(config: RegisteredConfig, kind: str) -> type:
    cls = getattr(type(config), "module_class", None)
    if cls is None:
        raise TypeError(f"no {kind} is registered for {type(config).__name__}")
    return cls


# ---------------------------------------------------------------------------------------------
# Routers

class RouterConfig(RegisteredConfig):
    """Base of router configs."""

    _registry: ClassVar[dict[str, type]] = {}

    def check_layer(self, num_experts: int, k: int) -> None:
        """Raise ValueError if this router cannot select ``k`` of ``num_experts`` experts."""

    def num_params(self, d_model: int, num_experts: int) -> int:
        """Parameters of the selection network."""
        return num_experts * d_model

    def aux_loss_weights(self) -> dict[str, float]:
        """The weight of each auxiliary loss the router records."""
        return {}


ROUTERS = RouterConfig._registry
"""Router config classes by type name (every router module adds its own)."""


def router_config_from(value: Any) -> RouterConfig:
    """A router config from a config object, a dict with ``type`` or a bare type name."""
    if isinstance(value, RouterConfig):
        return value
    if isinstance(value, str):
        value = {"type": value}
    if not isinstance(value, dict):
        raise ValueError(f"router must be a router config, a dict with 'type' or a router "
                         f"name, got {value!r}")
    return from_typed_dict(RouterConfig._registry, value, "router")


def build_router(config: RouterConfig, d_model: int, num_experts: int, k: int,
                 init: str = "sigma_moe", init_depth: int = 1):
    """The router ``config`` describes, selecting ``k`` of ``num_experts`` experts."""
    return _module_class(config, "router")(config, d_model, num_experts, k, init=init,
                                           init_depth=init_depth)


def require_router_k(config: RouterConfig, k: int, allowed: int, why: str) -> None:
    if k != allowed:
        raise ValueError(f"{type(config).__name__} routes every token to {why}: the layer's k "
                         f"must be {allowed}, got k={k}")


def require_capacity_factor(config: object, name: str = "capacity_factor") -> None:
    value = getattr(config, name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{type(config).__name__}.{name} must be a non-negative number "
                         f"(0 or None: dropless), got {value!r}")


def renamed_fields(**old_to_new: str) -> Callable[[type], type]:
    """Class decorator for a config dataclass (applied above ``@dataclass``): old field names
    still work, with a ``DeprecationWarning``, as constructor keywords, in dicts read by
    ``config_from_dict`` and as read-only attributes.

    A new name ``"router.gate"`` moves a flat field into the embedded router config: the old
    values are collected into the ``router`` argument (a config, a dict with ``type``, or a
    partial dict of fields that the config's ``__post_init__`` applies to its default router).
    """
    def decorate(cls: type) -> type:
        generated = cls.__init__

        @functools.wraps(generated)
        def __init__(self, *args, **kwargs):
            nested: dict[str, dict[str, Any]] = {}
            for old, new in old_to_new.items():
                if old not in kwargs:
                    continue
                if "." not in new and new in kwargs:
                    raise TypeError(f"{cls.__name__}: give {new!r}, not both {new!r} and its "
                                    f"old name {old!r}")
                warnings.warn(f"{cls.__name__}.{old} is now called {new!r}", DeprecationWarning,
                              stacklevel=2)
                value = kwargs.pop(old)
                if "." in new:
                    field, name = new.split(".", 1)
                    nested.setdefault(field, {})[name] = value
                else:
                    kwargs[new] = value
            for field, values in nested.items():
                kwargs[field] = _with_fields(kwargs.get(field), values)
            generated(self, *args, **kwargs)

        cls.__init__ = __init__
        cls.renamed_fields = dict(getattr(cls, "renamed_fields", {}), **old_to_new)
        for old, new in old_to_new.items():
            def read(self, _old=old, _new=new):
                warnings.warn(f"{type(self).__name__}.{_old} is now called {_new!r}",
                              DeprecationWarning, stacklevel=2)
                value = self
                for part in _new.split("."):
                    value = getattr(value, part)
                return value
            setattr(cls, old, property(read))
        return cls
    return decorate


def _with_fields(config: Any, values: dict[str, Any]) -> Any:
    """``config`` (None, a partial dict, a dict with ``type``, or a config) with ``values`` set."""
    if config is None:
        return dict(values)
    if isinstance(config, dict):
        return {**config, **values}
    return dataclasses.replace(config, **values)


def resolve_router(config: Any, default: RouterConfig, expected: type, owner: str) -> RouterConfig:
    """The router of a layer config that embeds one: ``default`` when None, ``default`` with
    some fields changed for a dict without ``type`` (as a TOML sub-table), else any router
    config form :func:`router_config_from` takes; it must be an ``expected``."""
    if config is None:
        router = default
    elif isinstance(config, dict) and "type" not in config:
        names = {f.name for f in dataclasses.fields(default)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(f"{owner}.router has no field(s) {unknown}; fields of "
                             f"{type(default).__name__} are {sorted(names)}")
        router = dataclasses.replace(default, **config)
    else:
        router = router_config_from(config)
    if not isinstance(router, expected):
        raise ValueError(f"{owner}.router must be a {expected.__name__}, got "
                         f"{type(router).__name__} (a MoEConfig takes any router)")
    return router


# ---------------------------------------------------------------------------------------------
# Layers

@dataclass(frozen=True)
class LayerCost:
    """What one layer costs, counted from its config.

    total_params: every parameter of the layer.
    active_params: parameters a single token reads in the forward pass.
    flops: forward FLOPs per token (a multiply-add is 2 FLOPs; activations, sorting and
      other elementwise work are not counted).
    expert_flops: the part of ``flops`` spent in the experts / value rows, i.e. without the
      selection network; Csordás et al. 2023 (arXiv:2310.10837) Table 7 reports
      ``expert_flops`` relative to dense.
    """

    total_params: int
    active_params: int
    flops: int
    expert_flops: int


class LayerConfig(RegisteredConfig):
    """Base of layer configs (with a JSON round trip and a cost)."""

    _registry: ClassVar[dict[str, type]] = {}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    def cost(self) -> LayerCost:
        raise NotImplementedError

    def replace(self, **changes: Any):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]


LAYERS = LayerConfig._registry
"""Layer config classes by type name (every layer module adds its own)."""


def config_from_dict(data: dict[str, Any]) -> LayerConfig:
    """Build the config a ``to_dict()`` produced; unknown types and fields are errors."""
    return from_typed_dict(LayerConfig._registry, data, "config")


def build_layer(config: LayerConfig):
    """The layer a config describes."""
    return _module_class(config, "layer")(config)
