"""All-to-all with variable sizes, differentiable: the exchange of expert parallelism
(GShard, Lepikhin et al. 2020, arXiv:2006.16668 §2.2; Switch Transformer, Fedus et al. 2022,
arXiv:2101.03961 §2.2).

Rank r sends ``send_splits[s]`` rows to each rank s and receives ``recv_splits[s]`` from each;
the backward pass sends the gradients back the same way with the splits swapped. The split
sizes are Python ints (``torch.distributed.all_to_all_single`` takes them so): exchanging the
counts first is one small collective and one read of ``world`` numbers on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import traced
from .errors import explained


def _all_to_all_single(out, x, recv_splits, send_splits, group, what: str) -> None:
    with explained(f"all-to-all ({what})", group):
        dist.all_to_all_single(out, x, output_split_sizes=recv_splits,
                               input_split_sizes=send_splits, group=group)


def exchange_counts(send_counts: torch.Tensor, group=None) -> torch.Tensor:
    """int64 [world]: how many rows each rank will send here, given how many this rank sends
    to each (``send_counts`` int64 [world])."""
    recv = torch.empty_like(send_counts)
    _all_to_all_single(recv, send_counts.contiguous(), None, None, group, "counts")
    return recv


def _exchange(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group
              ) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits), *x.shape[1:]))
    _all_to_all_single(out, x.contiguous(), recv_splits, send_splits, group, "rows")
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.splits, ctx.group = (send_splits, recv_splits), group
        return _exchange(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        send_splits, recv_splits = ctx.splits
        return _exchange(grad, recv_splits, send_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
               group=None) -> torch.Tensor:
    """Send ``x`` [sum(send_splits), ...] in consecutive chunks, one per rank, and return the
    chunks received, [sum(recv_splits), ...], in rank order; differentiable (the gradient
    travels back by the inverse exchange). Every rank of ``group`` must call it, in the same
    order as the others, forward and backward. Under ``torch.compile``: the traceable form
    (``traced.py``)."""
    if torch.compiler.is_compiling():
        return traced.all_to_all(x, send_splits, recv_splits, group)
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)


def capacity_layout(owner: torch.Tensor, world: int, capacity: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lay out this rank's (token, slot) pairs in ``world`` blocks of ``capacity`` rows, one
    block per destination rank: the send buffer of a fixed-size exchange, as GShard sends each
    expert group a buffer of fixed capacity (Lepikhin et al. 2020, arXiv:2006.16668, §2.2 and
    Algorithm 1). A destination's pairs fill its block in pair order; those past ``capacity``
    are not sent. Everything is computed on the device (a sort and a binary search): no
    host read, and the shapes depend only on ``P``, ``world`` and ``capacity``.

    owner: int64 [P], the rank each pair goes to, in ``[0, world]``; ``world`` for a pair
      that is never sent (dropped by its router).
    Returns
      order: int64 [P], the pairs sorted by destination, stable (``order[j]`` is the pair at
        sorted position j);
      source: int64 [world·capacity], the sorted position each buffer row carries (clamped
        into ``[0, P)`` where the row is empty; 0 when P = 0);
      filled: bool [world·capacity], whether the row carries a pair.
    """
    pairs = owner.shape[0]
    device = owner.device
    order = torch.argsort(owner, stable=True)
    sorted_owner = owner.index_select(0, order)
    # starts[r]: the first sorted position of rank r's pairs; starts[world]: of the unsent
    starts = torch.searchsorted(sorted_owner, torch.arange(world + 1, device=device))
    rows = torch.arange(world * capacity, device=device)
    block = torch.div(rows, max(capacity, 1), rounding_mode="floor")   # rows is empty at 0
    offset = rows - block * capacity
    # row `offset` of rank `block`'s block: the offset-th of that rank's run, if it has one
    source = starts.index_select(0, block) + offset
    filled = source < starts.index_select(0, block + 1)
    return order, source.clamp(max=max(pairs - 1, 0)), filled
