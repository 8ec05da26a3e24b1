"""A key-value cache for :class:`~sparseffn.models.lm.TransformerLM`: the attention keys and
values of the positions already processed, so that generating a token runs the model on
that one position instead of on the whole window.

The cache holds ``context`` positions at most (the model's learned position table ends
there); :func:`sparseffn.models.generate.generate` goes back to running the window once it
is full.
"""

from __future__ import annotations

import math

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
    def num_layers(self) -> int:
        return len(self.layers)

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


def first_position(owner: str, tokens: torch.Tensor, batch: int, length: int,
                   context: int) -> int:
    """The first position of ``tokens`` [B, t] continuing ``batch`` sequences of ``length``
    cached positions, and a ValueError naming ``owner`` if they do not fit:
    another batch size, or more positions than the ``context`` has left."""
    b, t = tokens.shape
    if b != batch:
        raise ValueError(f"{owner}: the cache holds {batch} sequences, got {b}")
    if length + t > context:
        raise ValueError(f"{owner}: {length} cached and {t} new tokens exceed the model's "
                         f"context of {context}")
    return length


class StaticKVCache:
    """Every attention layer's keys and values of ``batch`` sequences, [batch, heads,
    context, d_head] each, allocated (zeroed) when the cache is made: a forward of t new
    tokens against it writes them at their positions and attends over all ``context``
    positions under a mask, so its shapes are the same at every position and it reads nothing
    on the host. That is what lets ``torch.compile`` make one graph for every decoding step
    (and CUDA graphs replay it); :class:`~sparseffn.models.generate.Decoder` uses it.

    ``length`` (a host count) is checked and advanced by ``model(tokens, cache=cache)``;
    :meth:`~sparseffn.models.lm.TransformerLM.forward_at` takes the positions as a tensor and
    checks nothing (the compiled step). The tensors are marked static for the compiler
    (``torch._dynamo.mark_static_address``), so a compiled step keeps to one cache: reuse it
    with :meth:`reset` rather than making a new one.
    """

    def __init__(self, layers: int, batch: int, heads: int, context: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str) -> None:
        self.context = context
        self.batch = batch
        self.length = 0
        shape = (batch, heads, context, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        for tensor in self.keys + self.values:
            torch._dynamo.mark_static_address(tensor)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype if self.keys else torch.get_default_dtype()

    @property
    def full(self) -> bool:
        """Whether no position is left: the next token needs the window run again."""
        return self.length >= self.context

    def reset(self) -> None:
        """Empty the cache for new sequences (the memory is kept, and zeroed: a position not
        yet written holds zeros, which the mask hides, never a NaN an old sequence left)."""
        for tensor in self.keys + self.values:
            tensor.zero_()
        self.length = 0

    def claim(self, tokens: torch.Tensor) -> int:
        """The first position of ``tokens`` [B, t] and a ValueError if they do not fit: another
        batch size, or more positions than the context has left. Advances nothing."""
        return first_position("StaticKVCache", tokens, self.batch, self.length, self.context)

    def slots(self, positions: torch.Tensor) -> list["StaticSlot"]:
        """Each layer's view of a forward of tokens at ``positions`` (int64 [t], on the cache's
        device): the tensors to write and the mask [t, context], query i seeing the keys at
        positions 0..positions[i]."""
        seen = torch.arange(self.context, device=positions.device) <= positions[:, None]
        return [StaticSlot(keys, values, positions, seen)
                for keys, values in zip(self.keys, self.values)]


class StaticSlot:
    """One attention layer's part of a :class:`StaticKVCache` in one forward (see
    :meth:`StaticKVCache.slots`)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor) -> None:
        self.keys, self.values, self.positions, self.mask = keys, values, positions, mask

    def extend(self, keys: torch.Tensor, values: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new positions' ``keys`` and ``values`` [B, H, t, d_head] in place; return
        the cache's, [B, H, context, d_head] each."""
        if keys.dtype != self.keys.dtype:
            raise ValueError(f"StaticKVCache: the cache holds {self.keys.dtype}, the "
                             f"attention computes {keys.dtype} (make the cache in the dtype "
                             f"autocast gives)")
        self.keys.index_copy_(2, self.positions, keys)
        self.values.index_copy_(2, self.positions, values)
        return self.keys, self.values


def past_slots(past_keys: list[torch.Tensor], past_values: list[torch.Tensor],
               positions: torch.Tensor) -> list["PastSlot"]:
    """Each layer's :class:`PastSlot` for new tokens at ``positions`` (int64 [t]) over its
    past keys and values [B, H, context, d_head], the masks built once for all: query i sees
    the past slots before its position that no new token overwrites, and the new tokens at
    positions up to its own."""
    context = past_keys[0].shape[2] if past_keys else 0
    slots = torch.arange(context, device=positions.device)
    overwritten = (slots[None, :] == positions[:, None]).any(0)                       # [C]
    sees_past = (slots[None, :] <= positions[:, None]) & ~overwritten                 # [t, C]
    sees_new = positions[None, :] <= positions[:, None]                                # [t, t]
    return [PastSlot(keys, values, sees_past, sees_new)
            for keys, values in zip(past_keys, past_values)]


class PastSlot:
    """One attention layer's part of a functional forward
    (:meth:`~sparseffn.models.lm.TransformerLM.forward_with_past`; made by
    :func:`past_slots`): the keys and values of the positions already processed, [B, H,
    context, d_head] each, read and never written, and which of them (bool [t, context]) and
    of the new tokens (bool [t, t]) each new token sees.

    :meth:`attend` computes attention over the past positions and the new ones without
    writing the new keys into the past (no copy of the cache: what a program exported for ONNX
    Runtime reads instead of rewriting), and keeps the new keys and values [B, H, t, d_head]
    for the caller to store at their positions."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, sees_past: torch.Tensor,
                 sees_new: torch.Tensor) -> None:
        self.keys, self.values = keys, values
        self.sees_past, self.sees_new = sees_past, sees_new
        self.new_keys: torch.Tensor | None = None
        self.new_values: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q kᵀ / sqrt(d_head)) v over the keys query i sees (Vaswani et al. 2017,
        arXiv:1706.03762, Eq. 1). ``q``, ``k``, ``v`` [B, H, t, d_head] -> [B, H, t, d_head].
        The past slots it does not see get weight 0, so they must hold finite values."""
        if k.dtype != self.keys.dtype:
            raise ValueError(f"forward_with_past: the past keys are {self.keys.dtype}, the "
                             f"attention computes {k.dtype}")
        self.new_keys, self.new_values = k, v
        scale = 1.0 / math.sqrt(q.shape[-1])
        past = torch.matmul(q, self.keys.transpose(-1, -2)).float() * scale
        new = torch.matmul(q, k.transpose(-1, -2)).float() * scale
        weights = torch.cat([past.masked_fill(~self.sees_past, -math.inf),
                             new.masked_fill(~self.sees_new, -math.inf)], dim=-1).softmax(-1)
        weights = weights.to(q.dtype)
        context = self.keys.shape[2]
        return (torch.matmul(weights[..., :context], self.values)
                + torch.matmul(weights[..., context:], v))
