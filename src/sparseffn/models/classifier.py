"""A classifier for vectors and images built around one sparse layer (Chaunin & Mikhailovskiy
§3.1 and slides' setup: a single FFF/MoE layer whose experts are two-layer MLPs of width 8/16/32, dropout
0.2).

    cfg = ClassifierConfig(in_features=784, num_classes=10,
                           layer=FFFConfig(d_model=784, depth=3, leaf_width=16, d_out=10,
                           dropout=0.2))
    logits = SparseClassifier(cfg)(images)     # images: [B, *shape] -> [B, num_classes]

The input is flattened. A layer whose output has ``num_classes`` units (an FFF with ``d_out``)
gives the logits directly, as in the papers; a drop-in layer (d_model -> d_model: MoE, PKM,
PEER, dense) is followed by dropout and a linear read-out to the classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LayerConfig, config_from_dict
from ..validation import require_positive_int, require_probability


@dataclass(frozen=True)
class ClassifierConfig:
    kind: ClassVar[str] = "classifier"

    in_features: int
    num_classes: int
    layer: Any
    dropout: float = 0.2

    def __post_init__(self) -> None:
        require_positive_int(self, "in_features")
        require_positive_int(self, "num_classes")
        require_probability(self, "dropout")
        layer = config_from_dict(self.layer) if isinstance(self.layer, dict) else self.layer
        if not isinstance(layer, LayerConfig):
            raise ValueError("ClassifierConfig.layer must be a layer config or a table with 'type'")
        if layer.d_model != self.in_features:  # type: ignore[attr-defined]
            raise ValueError(f"ClassifierConfig.layer.d_model={layer.d_model} must equal "
                             f"in_features={self.in_features} (the flattened input)")
        object.__setattr__(self, "layer", layer)

    @property
    def has_head(self) -> bool:
        return getattr(self.layer, "output_width", self.in_features) != self.num_classes

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["layer"] = self.layer.to_dict()
        return {"kind": self.kind, **data}

    def replace(self, **changes: Any) -> "ClassifierConfig":
        return dataclasses.replace(self, **changes)

    def cost(self) -> dict[str, int]:
        layer = self.layer.cost()
        width = getattr(self.layer, "output_width", self.in_features)
        head = (width + 1) * self.num_classes if self.has_head else 0
        return {"total_params": layer.total_params + head,
                "active_params": layer.active_params + head,
                "flops_per_token": layer.flops + 2 * width * self.num_classes * self.has_head,
                "ffn_params": layer.total_params}


class SparseClassifier(nn.Module):
    """forward(x: [B, *shape]) -> logits [B, num_classes]."""

    def __init__(self, config: ClassifierConfig) -> None:
        super().__init__()
        from .. import build_layer
        self.config = config
        self.layer = build_layer(config.layer)
        width = getattr(config.layer, "output_width", config.in_features)
        self.dropout = nn.Dropout(config.dropout)
        self.head = nn.Linear(width, config.num_classes) if config.has_head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(x.shape[0], -1)
        if x.shape[1] != self.config.in_features:
            raise ValueError(f"SparseClassifier expects {self.config.in_features} features per "
                             f"example, got {x.shape[1]}")
        y = self.layer(x)
        return y if self.head is None else self.head(self.dropout(y))

    def loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(x).float(), labels)
