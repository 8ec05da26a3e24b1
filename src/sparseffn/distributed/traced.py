"""The collectives of expert parallelism as ``torch.compile`` traces them: PyTorch's
functional collectives (``torch.distributed._functional_collectives``), which return a new
tensor instead of writing into one and which the compiler is written for.

Eagerly, the exchange and the global batch statistics run ``torch.distributed``'s in-place
collectives inside autograd Functions (``exchange.py``, ``batch.py``), whose errors name the
collective. Traced as they are, on PyTorch 2.11, Dynamo's handling of such a Function's
backward, with an in-place collective inside, gave wrong gradients through the fixed
exchange and the global batch statistics, and on a rank without tokens a backward whose
collectives the other ranks never matched, so the step hung. Under ``torch.compile`` the
exchange calls :func:`all_to_all` instead, and the global batch statistics' Function sums
with :func:`all_reduce_sum` in its forward and backward (PyTorch 2.13 traced both forms
correctly; tests compare compiled against eager gradients on two processes).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _functional():
    # imported at the first traced call, not with the package: only compiled
    # expert-parallel steps need it
    from torch.distributed import _functional_collectives as functional
    return functional


def _group(group):
    return group if group is not None else dist.group.WORLD


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int],
               group=None) -> torch.Tensor:
    """:func:`~sparseffn.distributed.all_to_all`, traceable: the functional all-to-all with
    PyTorch's own autograd formula (the gradient goes back by the inverse exchange)."""
    return _functional().all_to_all_single_autograd(x, list(recv_splits), list(send_splits),
                                                    _group(group))


def all_reduce_sum(values: torch.Tensor, group=None) -> torch.Tensor:
    """Σ of ``values`` over the processes of ``group``, out of place (not differentiable
    itself: ``batch.py``'s autograd Function sums the gradient the same way)."""
    return _functional().all_reduce(values.contiguous(), "sum", _group(group))
