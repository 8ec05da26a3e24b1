"""Batch statistics over the global batch: the aux losses of routers computed as the papers
define them (over every token of the step), not per process."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..losses import BatchSum
from . import traced
from .errors import explained


def _all_reduce(values: torch.Tensor, group) -> None:
    with explained("all-reduce (global batch statistics)", group):
        dist.all_reduce(values, group=group)


def _summed(values: torch.Tensor, group) -> torch.Tensor:
    """Σ of ``values`` over the processes of ``group``, out of place: under ``torch.compile``
    the functional all-reduce (``traced.py``), eagerly the in-place one on a copy."""
    if torch.compiler.is_compiling():
        return traced.all_reduce_sum(values, group)
    out = values.clone()
    _all_reduce(out, group)
    return out


class _AllReduceSum(torch.autograd.Function):
    """Σ over the processes of ``group``; the gradient is summed the same way (every process
    computes the same loss from the sum, and the training objective averages them)."""

    @staticmethod
    def forward(ctx, values, group):
        ctx.group = group
        return _summed(values, group)

    @staticmethod
    def backward(ctx, grad):
        return _summed(grad, ctx.group), None


class GroupBatchSum(BatchSum):
    """:class:`~sparseffn.losses.BatchSum` over the processes of a ``torch.distributed`` group
    (default: the world): one all-reduce of a few numbers per loss and forward."""

    def __init__(self, group=None) -> None:
        self.group = group

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(values, self.group)   # no graph without a gradient

    def __deepcopy__(self, memo) -> "GroupBatchSum":
        return GroupBatchSum(self.group)     # a process group is shared, never copied
