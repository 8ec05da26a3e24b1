"""A key-value cache for :class:`~sparseffn.models.lm.TransformerLM`: the attention keys and
values of the positions already processed, so that generating a token runs the model on
that one position instead of on the whole window.

The cache holds ``context`` positions at most (the model's learned position table ends
there); :func:`sparseffn.models.generate.generate` goes back to running the window once it
is full.
"""

from __future__ import annotations

import torch


class AttentionCache:
    """One attention layer's keys and values, [B, H, context, d_head] each, filled from the
    front; allocated by the first :meth:`extend`, in the dtype and on the device of the keys
    it is given (bf16 under bf16 autocast)."""

    def __init__(self, context: int) -> None:
        self.context = context
        self.length = 0
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append the new positions' ``keys`` and ``values`` [B, H, t, d_head]; return every
        position's so far, [B, H, length + t, d_head] each (views of the cache)."""
        start, end = self.length, self.length + keys.shape[2]
        if end > self.context:
            raise ValueError(f"KVCache: {end} positions exceed the model's context of "
                             f"{self.context}")
        if self.keys is None:
            b, h, _, d = keys.shape
            self.keys = keys.new_empty(b, h, self.context, d)
            self.values = values.new_empty(b, h, self.context, d)
        elif keys.shape[0] != self.keys.shape[0] or keys.dtype != self.keys.dtype:
            raise ValueError(f"KVCache: the cache holds {self.keys.shape[0]} sequences in "
                             f"{self.keys.dtype}, got {keys.shape[0]} in {keys.dtype}")
        self.keys[:, :, start:end] = keys
        self.values[:, :, start:end] = values
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class KVCache:
    """Every attention layer's :class:`AttentionCache` of one batch of sequences.

    ``length``: the positions processed so far; a forward with the cache gives its tokens
    the positions ``length, length + 1, ...`` and adds them. Made by
    :meth:`TransformerLM.new_kv_cache`; used as ``model(tokens, cache=cache)``. A forward
    that raises before it writes (too many tokens, another batch or dtype) leaves the cache as
    it was; one that fails inside a later block leaves the layers at different lengths, and
    the cache should be dropped.
    """

    def __init__(self, layers: int, context: int) -> None:
        self.context = context
        self.layers = [AttentionCache(context) for _ in range(layers)]

    @property
    def length(self) -> int:
        return self.layers[0].length if self.layers else 0

    @property
    def full(self) -> bool:
        """Whether no position is left: the next token needs the window run again."""
        return self.length >= self.context


def causal_mask(new: int, past: int, device: torch.device) -> torch.Tensor | None:
    """The attention mask of ``new`` queries that follow ``past`` cached positions: bool
    [new, past + new], query i seeing keys 0..past + i. None where every query sees every key
    (one new token)."""
    if new == 1:
        return None
    return torch.ones(new, past + new, dtype=torch.bool, device=device).tril(diagonal=past)
