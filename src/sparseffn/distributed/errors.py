"""What a user sees when a collective fails: which exchange, on which rank, and the likely
cause, instead of a transport's message alone."""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist


class ExchangeError(RuntimeError):
    """An expert-parallel collective failed: another rank stopped, or did not arrive within the
    process group's timeout."""


@contextmanager
def explained(what: str, group=None):
    """Re-raise a failure of the collective run inside as an :class:`ExchangeError` naming
    ``what`` and this rank."""
    try:
        yield
    except (RuntimeError, ValueError) as error:    # gloo / NCCL errors, timeouts
        if isinstance(error, ExchangeError):
            raise
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        raise ExchangeError(
            f"expert-parallel {what} failed on rank {rank} of {world}: another rank stopped or "
            f"did not arrive within the process group's timeout (set it with "
            f"init_process_group(timeout=...)). Cause: {error}") from error
