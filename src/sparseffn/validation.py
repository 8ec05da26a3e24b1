"""Config validation: each check raises ``ValueError`` naming the config, the field and what is
allowed."""

from __future__ import annotations

import dataclasses
import math
from typing import Any


def from_typed_dict(registry: dict[str, type], data: dict[str, Any], kind: str) -> Any:
    """Build the dataclass ``registry[data["type"]]`` from the other fields of ``data``;
    an unknown type or field is a ValueError naming what is allowed."""
    data = dict(data)
    type_name = data.pop("type", None)
    if type_name not in registry:
        raise ValueError(f"{kind} 'type' must be one of {', '.join(sorted(registry))}, "
                         f"got {type_name!r}")
    cls = registry[type_name]
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names - set(getattr(cls, "renamed_fields", {})))
    if unknown:
        raise ValueError(f"{cls.__name__} has no field(s) {unknown}; fields are {sorted(names)}")
    return cls(**data)


def require_positive_int(config: object, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{type(config).__name__}.{name} must be a positive integer, got {value!r}"
        )


def require_non_negative_int(config: object, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{type(config).__name__}.{name} must be a non-negative integer, got {value!r}"
        )


def require_choice(config: object, name: str, allowed: tuple[str, ...]) -> None:
    value = getattr(config, name)
    if value not in allowed:
        raise ValueError(
            f"{type(config).__name__}.{name} must be one of {', '.join(map(repr, allowed))}, "
            f"got {value!r}"
        )


def require_probability(config: object, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
        raise ValueError(
            f"{type(config).__name__}.{name} must be a number in [0, 1), got {value!r}"
        )


def require_non_negative(config: object, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise ValueError(
            f"{type(config).__name__}.{name} must be a finite non-negative number, got {value!r}"
        )


def require_k(config: object, upper_name: str) -> None:
    k = getattr(config, "k")
    upper = getattr(config, upper_name)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= upper:
        raise ValueError(
            f"{type(config).__name__}.k must be an integer in [1, {upper_name}={upper}], got {k!r}"
        )


def require_bool(config: object, name: str) -> None:
    value = getattr(config, name)
    if not isinstance(value, bool):
        raise ValueError(f"{type(config).__name__}.{name} must be true or false, got {value!r}")


def matrix_tuple(config: object, name: str) -> tuple[tuple[float, ...], ...] | None:
    """A config field holding a small matrix (nested lists from TOML/JSON) as a tuple of
    equal-length tuples of floats; None stays None."""
    value = getattr(config, name)
    if value is None:
        return None
    try:
        rows = tuple(tuple(float(v) for v in row) for row in value)
    except (TypeError, ValueError):
        raise ValueError(f"{type(config).__name__}.{name} must be a matrix (a list of rows of "
                         f"numbers), got {value!r}") from None
    if not all(math.isfinite(v) for row in rows for v in row):
        raise ValueError(f"{type(config).__name__}.{name} must hold finite numbers, got NaN or "
                         f"an infinity")
    if not rows or not rows[0] or any(len(row) != len(rows[0]) for row in rows):
        raise ValueError(f"{type(config).__name__}.{name} must be a non-empty matrix with rows "
                         f"of equal length")
    return rows
