"""Activation checkpointing around sharded experts, compiled: the exchanges are kept, not
recomputed.

A non-reentrant checkpoint recomputes a block's forward in the backward; compiled, AOT
autograd's min-cut partitioner chooses per tensor whether to keep or recompute it, from this
rank's shapes. Ranks with different shapes then disagree: with one rank holding no tokens,
rank 0's backward ran three of the forward's all-to-alls again and rank 1's two, in another
order, so the ranks' collectives no longer matched (gloo aborted the step; NCCL waits
forever). :func:`keeping_exchanges`, a selective-checkpoint policy, keeps the output of every
functional collective, so each rank's backward runs the same exchanges (the backward's own),
and none of the forward's is sent twice. Everything else is recomputed as before.

Only where ``torch.compile`` traces the checkpoint: eagerly every rank replays the same
exchanges, and an eager selective checkpoint needs a recomputation that repeats the forward
op for op, which the sparse layers' (skipping their usage counts and aux-loss records) is
not. ``TransformerLM`` passes it for each block that holds sharded experts while compiling;
code that checkpoints a sharded layer itself under ``torch.compile`` passes
``checkpoint(..., use_reentrant=False, context_fn=keeping_exchanges)``.
"""

from __future__ import annotations

from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

# the functional collectives (the fixed exchange's all-to-alls, the global statistics'
# all-reduce, and the waits that hand back their results), in or out of autograd
_COLLECTIVES = ("_c10d_functional", "_c10d_functional_autograd")


def _keep_collectives(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    if getattr(op, "namespace", None) in _COLLECTIVES:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def keeping_exchanges():
    """``context_fn`` for ``torch.utils.checkpoint.checkpoint``: keep the collectives'
    outputs, recompute the rest."""
    return create_selective_checkpoint_contexts(_keep_collectives)
