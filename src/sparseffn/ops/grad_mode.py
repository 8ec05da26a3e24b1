"""Whether autograd will record an op: the test behind every inference-only path (the expert
MLPs of a few tokens, the exported ``If`` between those and the plan, product-key scores
without a backward, the tree's expansion without an autograd node, the rows' shared index)."""

from __future__ import annotations

from typing import Optional

import torch


def grad_wanted(*tensors: Optional[torch.Tensor]) -> bool:
    """True when autograd records an op on ``tensors``: grad mode is on and one of them
    (None entries skipped) requires grad. False is inference, where a path with no backward
    may run."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
