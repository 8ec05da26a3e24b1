"""A pre-LayerNorm causal Transformer language model whose FFN in every block is any sparseffn
layer (Csordás et al. 2023 replaces every MLP block; Fedus et al. 2022's Switch Transformer).

    cfg = LMConfig(vocab_size=256, d_model=128, n_layers=4, n_heads=4, context=128,
                   ffn=SigmaMoEConfig(d_model=128, num_experts=8, expert_size=64, k=2))
    model = TransformerLM(cfg)
    logits = model(tokens)                    # tokens: int64 [batch, time] -> [batch, time, vocab]

A block is ``x + Attn(LN(x))`` then ``x + FFN(LN(x))``. With ``sparse_every = 2`` only every
second block (blocks 1, 3, ...) uses ``ffn`` and the others use ``dense_ffn``: GLaM's layout
(a MoE layer in every other block).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..config import DenseMLPConfig, LayerConfig, config_from_dict
from ..matching import compute_equal_dense, param_equal_dense
from ..validation import (require_bool, require_positive_int, require_probability)
from .kv_cache import (AttentionCache, KVCache, PastSlot, StaticKVCache, StaticSlot,
                       causal_mask, past_slots)


def _layer_config(value: Any, field: str) -> LayerConfig | None:
    if value is None or isinstance(value, LayerConfig):
        return value
    if isinstance(value, dict):
        return config_from_dict(value)
    raise ValueError(f"LMConfig.{field} must be a layer config or a table with 'type', got "
                     f"{type(value).__name__}")


@dataclass(frozen=True)
class LMConfig:
    """A causal Transformer LM.

    Fields
    - ``vocab_size``: 256 for bytes; a tokenizer's size otherwise.
    - ``context``: the longest sequence (learned positional embeddings of that many rows).
    - ``ffn``: the FFN layer config of the blocks (any registered layer; its ``d_model`` must be
      this model's).
    - ``sparse_every``: 1 puts ``ffn`` in every block; m > 1 puts it in blocks m-1, 2m-1, ...
      and ``dense_ffn`` in the others (GLaM: m = 2).
    - ``dropout``: on the embeddings, the attention probabilities and each residual branch.
    - ``tie_embeddings``: the output projection is the token embedding (saves vocab·d_model).
    """

    kind: ClassVar[str] = "lm"

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    context: int
    ffn: Any
    sparse_every: int = 1
    dense_ffn: Any = None
    dropout: float = 0.0
    tie_embeddings: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "context", "sparse_every"):
            require_positive_int(self, name)
        require_probability(self, "dropout")
        require_bool(self, "tie_embeddings")
        if self.d_model % self.n_heads:
            raise ValueError(f"LMConfig: d_model={self.d_model} must be divisible by "
                             f"n_heads={self.n_heads}")
        object.__setattr__(self, "ffn", _layer_config(self.ffn, "ffn"))
        object.__setattr__(self, "dense_ffn", _layer_config(self.dense_ffn, "dense_ffn"))
        if self.ffn is None:
            raise ValueError("LMConfig.ffn is required: the FFN layer config of the blocks")
        for name in ("ffn", "dense_ffn"):
            layer = getattr(self, name)
            if layer is not None and layer.d_model != self.d_model:  # type: ignore[attr-defined]
                raise ValueError(f"LMConfig.{name}.d_model={layer.d_model} must equal the "
                                 f"model's d_model={self.d_model}")
            if layer is not None and getattr(layer, "output_width", self.d_model) != self.d_model:
                raise ValueError(f"LMConfig.{name} must map d_model to d_model (a Transformer "
                                 f"block is residual); unset its d_out")
        if self.sparse_every > 1 and self.dense_ffn is None:
            raise ValueError(f"LMConfig: sparse_every={self.sparse_every} leaves some blocks "
                             f"without the sparse FFN; set dense_ffn for them")
        if self.sparse_every > self.n_layers:
            raise ValueError(f"LMConfig: sparse_every={self.sparse_every} exceeds n_layers="
                             f"{self.n_layers}, so no block would be sparse")

    def block_ffn(self, index: int) -> LayerConfig:
        """The FFN config of block ``index`` (0-based)."""
        sparse = (index + 1) % self.sparse_every == 0
        return self.ffn if sparse else self.dense_ffn

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["ffn"] = self.ffn.to_dict()
        data["dense_ffn"] = None if self.dense_ffn is None else self.dense_ffn.to_dict()
        return {"kind": self.kind, **{k: v for k, v in data.items() if v is not None}}

    def replace(self, **changes: Any) -> "LMConfig":
        return dataclasses.replace(self, **changes)

    # -- costs ------------------------------------------------------------------------------

    def non_ffn_params(self) -> int:
        """Embeddings, attention and LayerNorms (the parameters every variant shares)."""
        d = self.d_model
        embed = self.vocab_size * d + self.context * d
        head = 0 if self.tie_embeddings else self.vocab_size * d
        attention = 4 * d * d          # q, k, v, out projections, no bias
        norms = 2 * 2 * d              # two LayerNorms per block
        return embed + head + self.n_layers * (attention + norms) + 2 * d

    def cost(self) -> dict[str, int]:
        """Total parameters, parameters read per token and forward FLOPs per token (matrix
        products; attention's score and mix products counted at the full context)."""
        d = self.d_model
        ffns = [self.block_ffn(i).cost() for i in range(self.n_layers)]
        shared = self.non_ffn_params()
        # per token: one token and one position row of the tables; the output projection
        # (the token table itself when tied) reads all of its vocab_size rows
        tables = self.vocab_size * d + self.context * d
        active_shared = shared - tables + 2 * d + (self.vocab_size * d if self.tie_embeddings else 0)
        attn_flops = self.n_layers * (2 * 4 * d * d + 2 * 2 * self.context * d)
        head_flops = 2 * d * self.vocab_size
        return {
            "total_params": shared + sum(c.total_params for c in ffns),
            "active_params": active_shared + sum(c.active_params for c in ffns),
            "flops_per_token": attn_flops + head_flops + sum(c.flops for c in ffns),
            "ffn_params": sum(c.total_params for c in ffns),
        }

    def dense_baseline(self, by: str = "params") -> "LMConfig":
        """The same model with every FFN replaced by a dense MLP: with ``by="params"`` the
        parameter-equal one (the evaluation rule of Csordás et al. 2023: total parameters equal
        to within d_model per block), with ``by="compute"`` the one with the sparse layer's
        active parameters per token (Fedus et al. 2022's FLOP-matched baseline)."""
        if by not in ("params", "compute"):
            raise ValueError(f"dense_baseline: by must be 'params' or 'compute', got {by!r}")
        matched = param_equal_dense if by == "params" else compute_equal_dense
        def dense(layer: LayerConfig) -> DenseMLPConfig:
            return layer if isinstance(layer, DenseMLPConfig) else matched(layer)
        return self.replace(ffn=dense(self.ffn),
                            dense_ffn=None if self.dense_ffn is None else dense(self.dense_ffn))


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention. forward(x: [B, T, d], cache=None) -> [B, T, d].

    With an :class:`~sparseffn.models.kv_cache.AttentionCache` the T positions follow the
    cache's: their keys and values are added to it and each attends to every cached position
    and to the new ones up to itself. With a :class:`~sparseffn.models.kv_cache.StaticSlot`
    they are written at the slot's positions and each attends over the whole cache under the
    slot's mask. With a :class:`~sparseffn.models.kv_cache.PastSlot` they attend to the
    slot's past and to each other, and the slot keeps their keys and values."""

    def __init__(self, d_model: int, n_heads: int, dropout: float, n_layers: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)
        self.dropout = dropout
        nn.init.normal_(self.qkv.weight, 0.0, 1.0 / math.sqrt(d_model))
        # scaled by depth so the residual stream's variance grows slowly (GPT-2)
        nn.init.normal_(self.out.weight, 0.0, 1.0 / math.sqrt(d_model * 2 * n_layers))

    def forward(self, x: torch.Tensor, cache: AttentionCache | StaticSlot | PastSlot | None = None
                ) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        dropout = self.dropout if self.training else 0.0
        if isinstance(cache, PastSlot):
            y = cache.attend(q, k, v)
            return self.out(y.transpose(1, 2).reshape(b, t, d))
        if isinstance(cache, StaticSlot):
            k, v = cache.extend(k, v)
            y = F.scaled_dot_product_attention(q, k, v, cache.mask, dropout_p=dropout)
            return self.out(y.transpose(1, 2).reshape(b, t, d))
        past = 0 if cache is None else cache.length
        if cache is not None:
            k, v = cache.extend(k, v)
        if past == 0:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, causal_mask(t, past, x.device),
                                               dropout_p=dropout)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """``x + Attn(LN(x))``, then ``x + FFN(LN(x))`` (pre-LayerNorm)."""

    def __init__(self, config: LMConfig, ffn: LayerConfig) -> None:
        super().__init__()
        from .. import build_layer
        self.norm1 = nn.LayerNorm(config.d_model)
        self.attention = CausalSelfAttention(config.d_model, config.n_heads, config.dropout,
                                             config.n_layers)
        self.norm2 = nn.LayerNorm(config.d_model)
        self.ffn = build_layer(ffn)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, cache: AttentionCache | StaticSlot | PastSlot | None = None
                ) -> torch.Tensor:
        x = x + self.dropout(self.attention(self.norm1(x), cache))
        return x + self.dropout(self.ffn(self.norm2(x)))


def _checkpoint_options(block: nn.Module) -> dict:
    """Compiled, a block whose experts are sharded keeps its exchanges' outputs rather than
    recompute them: ranks with different shapes recomputed different exchanges, and their
    collectives no longer matched (sparseffn/distributed/checkpointing.py). Eagerly every
    rank replays the same exchanges, and the recomputation (which skips the layers' side
    effects) is not the op-for-op replay that an eager selective checkpoint requires."""
    if not torch.compiler.is_compiling():
        return {}
    # (imported here: sparseffn.distributed imports Dynamo, which compiling has loaded)
    from ..distributed import sharded_stores
    from ..distributed.checkpointing import keeping_exchanges
    if next(sharded_stores(block), None) is None:
        return {}
    return {"context_fn": keeping_exchanges}


class TransformerLM(nn.Module):
    """forward(tokens: int64 [B, T], cache=None) -> logits [B, T, vocab_size], T <= context.

    ``cache``: a :class:`~sparseffn.models.kv_cache.KVCache` from :meth:`new_kv_cache` or a
    :class:`~sparseffn.models.kv_cache.StaticKVCache` from :meth:`new_static_kv_cache`. The
    tokens then continue the sequences the cache holds (positions ``cache.length`` on, at
    most ``context`` in all) and are added to it; used by :meth:`generate` to run one new
    token at a time (the static cache by :class:`~sparseffn.models.generate.Decoder`, whose
    compiled step calls :meth:`forward_at`).

    ``activation_checkpointing = True`` (an attribute, off by default; ``train.
    activation_checkpointing`` sets it) keeps only each block's input while a forward builds
    a graph and recomputes the block's activations in the backward
    (``torch.utils.checkpoint``, non-reentrant, RNG state preserved): the same losses and
    gradients for about one more forward's compute, with one block's activations alive at a
    time instead of every block's. Sparse layers record their aux losses and usage once (the
    recomputation records nothing)."""

    activation_checkpointing: bool = False

    def __init__(self, config: LMConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.position = nn.Embedding(config.context, config.d_model)
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config, config.block_ffn(i))
                                    for i in range(config.n_layers))
        self.norm = nn.LayerNorm(config.d_model)
        self.head = None if config.tie_embeddings else nn.Linear(config.d_model, config.vocab_size,
                                                                 bias=False)
        nn.init.normal_(self.embed.weight, 0.0, 1.0)
        nn.init.normal_(self.position.weight, 0.0, 0.02)
        if self.head is not None:
            nn.init.normal_(self.head.weight, 0.0, 1.0 / math.sqrt(config.d_model))

    def forward(self, tokens: torch.Tensor, cache: KVCache | StaticKVCache | None = None
                ) -> torch.Tensor:
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"TransformerLM expects int64 tokens [batch, time], got "
                             f"{tuple(tokens.shape)} {tokens.dtype}")
        if cache is not None and cache.num_layers != len(self.blocks):
            raise ValueError(f"TransformerLM: a {type(cache).__name__} of {cache.num_layers} "
                             f"layers for a model of {len(self.blocks)} blocks (make it with "
                             f"model.new_kv_cache() or model.new_static_kv_cache())")
        if isinstance(cache, StaticKVCache):
            start = cache.claim(tokens)
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
            logits = self.forward_at(tokens, positions, cache)
            cache.length = start + tokens.shape[1]
            return logits
        past = 0 if cache is None else cache.length
        t = tokens.shape[1]
        if past + t > self.config.context:
            what = f"{past} cached and {t} new tokens exceed" if past \
                else f"sequence of {t} tokens exceeds"
            raise ValueError(f"TransformerLM: {what} context={self.config.context}")
        positions = torch.arange(past, past + t, device=tokens.device)
        return self._logits(tokens, positions, None if cache is None else cache.layers)

    def forward_at(self, tokens: torch.Tensor, positions: torch.Tensor,
                   cache: StaticKVCache) -> torch.Tensor:
        """The logits [B, t, vocab_size] of ``tokens`` [B, t] at ``positions`` (int64 [t], on
        the tokens' device, in [0, context)) of the sequences ``cache`` holds, their keys and
        values written into it. Nothing is read on the host and nothing is checked: positions
        out of range are an indexing error on the device, and ``cache.length`` is not
        advanced (``model(tokens, cache=cache)`` checks and advances it). This is the step
        :class:`~sparseffn.models.generate.Decoder` compiles: its shapes depend on t alone."""
        return self._logits(tokens, positions, cache.slots(positions))

    def forward_with_past(self, tokens: torch.Tensor, positions: torch.Tensor,
                          past_keys: list[torch.Tensor], past_values: list[torch.Tensor]
                          ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        """The functional form of a forward with a KV cache, nothing written: the logits
        [B, t, vocab_size] of ``tokens`` [B, t] at ``positions`` (int64 [t], in [0,
        context)), each attending to the keys and values of the earlier positions in
        ``past_keys`` / ``past_values`` (one [B, n_heads, context, d_head] tensor per block;
        the slots no earlier token wrote get weight 0, so they must hold finite values: a
        cache of zeros starts sequences) and to the new tokens at positions up to its own.
        Returns the logits and the new tokens' keys and values per block, [B, n_heads, t,
        d_head] each: the caller stores them at ``positions`` of its cache.

        This is the program :func:`sparseffn.decoder_to_onnx` exports (the prompt and each
        decoding step); the past is only read, so an exported step copies no cache. As in
        :meth:`forward_at`, nothing is checked on the host."""
        if not len(past_keys) == len(past_values) == len(self.blocks):
            raise ValueError(f"forward_with_past: {len(past_keys)} past keys and "
                             f"{len(past_values)} past values for a model of "
                             f"{len(self.blocks)} blocks")
        slots = past_slots(past_keys, past_values, positions)
        logits = self._logits(tokens, positions, slots)
        return (logits, [slot.new_keys for slot in slots],
                [slot.new_values for slot in slots])

    def _logits(self, tokens: torch.Tensor, positions: torch.Tensor,
                caches: list | None) -> torch.Tensor:
        """The logits of ``tokens`` [B, t] at ``positions`` [t], each block given its cache
        (``caches[i]``) or none."""
        x = self.dropout(self.embed(tokens) + self.position(positions))
        recompute = self.activation_checkpointing and torch.is_grad_enabled() and caches is None
        for index, block in enumerate(self.blocks):
            if recompute:
                x = checkpoint(block, x, use_reentrant=False, **_checkpoint_options(block))
            else:
                x = block(x, None if caches is None else caches[index])
        x = self.norm(x)
        if self.head is None:
            # tied: logits = x Eᵀ / sqrt(d), so unit-variance embeddings give unit-scale logits
            return F.linear(x, self.embed.weight) / math.sqrt(self.config.d_model)
        return self.head(x)

    def new_kv_cache(self) -> KVCache:
        """An empty :class:`~sparseffn.models.kv_cache.KVCache` for this model (its memory is
        allocated by the first forward that uses it)."""
        return KVCache(len(self.blocks), self.config.context)

    def new_static_kv_cache(self, batch: int, dtype: torch.dtype | None = None
                            ) -> StaticKVCache:
        """A :class:`~sparseffn.models.kv_cache.StaticKVCache` of ``batch`` sequences on the
        model's device, allocated now: in ``dtype``, by default the one the attention will
        compute in (autocast's where autocast is on for the model's device, else the
        parameters')."""
        if isinstance(batch, bool) or not isinstance(batch, int) or batch <= 0:
            raise ValueError(f"new_static_kv_cache: batch must be a positive integer, got "
                             f"{batch!r}")
        weight = self.embed.weight
        if dtype is None:
            dtype = torch.get_autocast_dtype(weight.device.type) \
                if torch.is_autocast_enabled(weight.device.type) else weight.dtype
        config = self.config
        return StaticKVCache(len(self.blocks), batch, config.n_heads, config.context,
                             config.d_model // config.n_heads, dtype, weight.device)

    def generate(self, prompt: torch.Tensor, max_new_tokens: int, **sampling) -> torch.Tensor:
        """``prompt`` int64 [B, T] and ``max_new_tokens`` sampled tokens after it, int64
        [B, T + max_new_tokens]; ``sampling``: ``temperature`` (0: greedy), ``top_k``,
        ``top_p``, ``generator``, ``use_cache``, ``record_usage``
        (:func:`sparseffn.models.generate.generate`)."""
        from .generate import generate
        return generate(self, prompt, max_new_tokens, **sampling)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross-entropy in nats. targets: int64 [B, T]."""
        logits = self(tokens)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
