"""What ``DistributedDataParallel`` must leave alone in a model with sparse layers.

DDP reads the names of the parameters and buffers it neither averages nor broadcasts from
one attribute of the module it wraps, when it is built. Each ``ddp_ignore_*`` helper adds
its names to that list rather than replacing it, so they compose: a model with sharded
experts, sparse-gradient tables and usage statistics calls the ones it needs, in any order,
then builds ``DistributedDataParallel(model)``.
"""

from __future__ import annotations

from torch import nn

from ..auxiliary import usage_buffer_names


def ddp_ignore(model: nn.Module, names: list[str]) -> list[str]:
    """Add ``names`` (of ``model``'s parameters and buffers) to those a
    ``DistributedDataParallel(model)`` built afterwards leaves alone; returns ``names``."""
    from torch.nn.parallel import DistributedDataParallel
    ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    ignored += [name for name in names if name not in ignored]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, ignored)
    return names


def ddp_ignore_usage_buffers(model: nn.Module) -> list[str]:
    """Keep every sparse layer's accumulated usage (``usage_counts``, ``usage_mass``) out of
    a ``DistributedDataParallel(model)`` built afterwards; returns the buffers' names.

    DDP broadcasts rank 0's buffers to the other ranks before every forward (its default,
    ``broadcast_buffers=True``), which replaces each other rank's accumulated usage by rank
    0's: :func:`sparseffn.all_reduce_usage` would then count rank 0's earlier batches once
    per rank, and the other ranks' not at all. (``broadcast_buffers=False`` avoids it too,
    but then every buffer stays per rank, BatchNorm's running statistics included, such as
    those of PEER's query BatchNorm.)"""
    return ddp_ignore(model, usage_buffer_names(model))
