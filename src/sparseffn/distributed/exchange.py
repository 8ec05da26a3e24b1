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
    order as the others, forward and backward."""
    return _AllToAll.apply(x, list(send_splits), list(recv_splits), group)
