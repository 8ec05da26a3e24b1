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


def ddp_ignore_sparse_grad_parameters(model: nn.Module) -> list[str]:
    """Mark the sparse-gradient parameters of ``model`` so that a
    ``DistributedDataParallel(model)`` built afterwards neither buckets nor broadcasts them;
    returns their names. Give every replica the same initial tables yourself (same seed, or
    load one checkpoint), since DDP no longer broadcasts them."""
    from torch.nn.parallel import DistributedDataParallel
    sparse = {id(p) for p in sparse_grad_parameters(model)}
    names = [name for name, p in model.named_parameters() if id(p) in sparse]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, names)
    return names


def all_reduce_sparse_grads(model: nn.Module, group=None) -> None:
    """Average the sparse gradients of ``model``'s sparse-gradient tables over the processes
    of ``group`` (default: the world), as DDP averages the dense ones. A table that got no
    gradient on this replica takes part with an empty one, so no process waits forever. A
    no-op without an initialised process group."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    world = dist.get_world_size(group)
    for p in sparse_grad_parameters(model):
        grad = p.grad
        if grad is None:
            grad = row_sparse(torch.zeros(0, dtype=torch.long, device=p.device),
                              p.new_zeros(0, *p.shape[1:]), p.shape[0])
        elif not grad.is_sparse:
            raise TypeError(f"all_reduce_sparse_grads: a sparse-gradient table has a dense "
                            f"gradient {tuple(grad.shape)}; was it built with sparse_grad?")
        grad = grad.coalesce()
        dist.all_reduce(grad, group=group)
        p.grad = (grad / world).coalesce()
