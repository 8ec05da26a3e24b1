"""sparseffn on several processes (``torch.distributed``).

- :mod:`~sparseffn.distributed.expert_parallel`: the experts of a mixture sharded across
  ranks, tokens exchanged by all-to-all (:func:`shard_experts`, :func:`sync_gradients`,
  :func:`gathered_state_dict`);
- :mod:`~sparseffn.distributed.sparse_grads`: data parallelism with sparse-gradient tables
  (PKM values and PEER experts built with ``sparse_grad=True``);
- :mod:`~sparseffn.distributed.ddp`: what ``DistributedDataParallel`` must leave alone (the
  ``ddp_ignore_*`` helpers add to one list, so they compose);
- :mod:`~sparseffn.distributed.checkpointing`: activation checkpointing of sharded experts
  under ``torch.compile`` (:func:`~sparseffn.distributed.checkpointing.keeping_exchanges`).
"""

from .batch import GroupBatchSum
from .ddp import ddp_ignore_usage_buffers
from .errors import ExchangeError
from .exchange import all_to_all, exchange_counts
from .expert_parallel import (ExpertParallelMLP, FixedExchange, ddp_ignore_expert_parameters,
                              exchange_drops, expert_parameters, gathered_state_dict,
                              scale_expert_gradients, shard_experts, sharded_stores,
                              split_state_dict, sync_gradients)
from .sparse_grads import all_reduce_sparse_grads, ddp_ignore_sparse_grad_parameters

__all__ = ["ExchangeError", "ExpertParallelMLP", "FixedExchange", "GroupBatchSum",
           "all_reduce_sparse_grads", "all_to_all",
           "ddp_ignore_expert_parameters", "ddp_ignore_sparse_grad_parameters",
           "ddp_ignore_usage_buffers",
           "exchange_counts", "exchange_drops", "expert_parameters", "gathered_state_dict",
           "scale_expert_gradients", "shard_experts", "sharded_stores", "split_state_dict",
           "sync_gradients"]
