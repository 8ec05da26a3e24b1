"""Data parallelism with sparse-gradient tables (PKM values and PEER experts built with
``sparse_grad=True``).

``DistributedDataParallel`` expects sparse gradients only from ``nn.Embedding`` and
``nn.EmbeddingBag``; for any other parameter it allocates a dense bucket, and its backward
fails with "Cannot access storage of SparseTensorImpl". So: keep those tables out of DDP and
average their gradients yourself, one collective per table::

    sparseffn.distributed.ddp_ignore_sparse_grad_parameters(model)
    ddp = DistributedDataParallel(model)
    loss(ddp(x)).backward()
    sparseffn.distributed.all_reduce_sparse_grads(model)     # before optimizer.step()

Every other parameter is averaged by DDP as usual. (Or build the tables with
``sparse_grad=False``: dense gradients, which DDP handles, at the memory cost of a full
table gradient per step.)
"""

from __future__ import annotations

import torch
from torch import nn

from ..auxiliary import sparse_grad_parameters
from ..ops.rows import row_sparse
from .ddp import ddp_ignore


def ddp_ignore_sparse_grad_parameters(model: nn.Module) -> list[str]:
    """Mark the sparse-gradient parameters of ``model`` so that a
    ``DistributedDataParallel(model)`` built afterwards neither buckets nor broadcasts them;
    returns their names. Give every replica the same initial tables yourself (same seed, or
    load one checkpoint), since DDP no longer broadcasts them."""
    sparse = {id(p) for p in sparse_grad_parameters(model)}
    return ddp_ignore(model, [name for name, p in model.named_parameters() if id(p) in sparse])


def all_reduce_sparse_grads(model: nn.Module, group=None) -> None:
    """Average the sparse gradients of ``model``'s sparse-gradient tables over the processes
    of ``group`` (default: the world), as DDP averages the dense ones. A table that got no
    gradient on this replica takes part with an empty one, so no process waits forever. A
    no-op without an initialised process group.

    Any backend: NCCL has no all-reduce of sparse tensors ("NCCL does not support all_reduce
    with sparse tensors"), so each table's rows are all-gathered instead, padded to the
    longest rank's (one all-gather of every table's row count first, read on the host, as
    coalescing a sparse gradient reads it anyway), and every rank adds them up in rank order:
    the same result on every rank, what gloo's sparse all-reduce computes."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    tables = sparse_grad_parameters(model)
    if not tables:
        return
    world = dist.get_world_size(group)
    grads = [_coalesced_grad(p) for p in tables]
    counts = torch.tensor([g._nnz() for g in grads], dtype=torch.long, device=tables[0].device)
    every_count = [torch.empty_like(counts) for _ in range(world)]
    dist.all_gather(every_count, counts, group=group)
    every_count = torch.stack(every_count).tolist()          # [rank][table]
    for i, (p, grad) in enumerate(zip(tables, grads)):
        rows = [every_count[r][i] for r in range(world)]
        longest = max(rows)
        indices = _padded(grad._indices()[0], longest)
        values = _padded(grad._values(), longest)
        every_indices = [torch.empty_like(indices) for _ in range(world)]
        every_values = [torch.empty_like(values) for _ in range(world)]
        dist.all_gather(every_indices, indices, group=group)
        dist.all_gather(every_values, values, group=group)
        summed = row_sparse(torch.cat([ix[:n] for ix, n in zip(every_indices, rows)]),
                            torch.cat([v[:n] for v, n in zip(every_values, rows)]),
                            p.shape[0], coalesced=False).coalesce()
        p.grad = row_sparse(summed._indices()[0], summed._values() / world, p.shape[0])


def _coalesced_grad(p: nn.Parameter) -> torch.Tensor:
    """``p.grad`` coalesced; an empty sparse gradient where it has none."""
    if p.grad is None:
        return row_sparse(torch.zeros(0, dtype=torch.long, device=p.device),
                          p.new_zeros(0, *p.shape[1:]), p.shape[0])
    if not p.grad.is_sparse:
        raise TypeError(f"all_reduce_sparse_grads: a sparse-gradient table has a dense "
                        f"gradient {tuple(p.grad.shape)}; was it built with sparse_grad?")
    return p.grad.coalesce()


def _padded(t: torch.Tensor, length: int) -> torch.Tensor:
    """``t`` [n, ...] with zero rows appended up to ``length``."""
    return torch.cat([t, t.new_zeros(length - t.shape[0], *t.shape[1:])])
