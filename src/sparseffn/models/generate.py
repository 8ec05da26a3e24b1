"""Sampling text from a :class:`~sparseffn.models.lm.TransformerLM`: greedy, with temperature,
top-k and nucleus (top-p) truncation.

The model first runs over the prompt (its last ``context`` tokens); each drawn token then
runs alone, attending to the keys and values the earlier positions left in a
:class:`~sparseffn.models.kv_cache.KVCache`, until the sequence fills the context. From
there each token runs the model over the last ``context`` tokens (the window slides, and the
learned positions move with it, so nothing cached can be reused). Without a cache
(``use_cache=False``) every token runs the window.

Both give each token the logits a forward of the whole window gives it, to rounding, as long
as every FFN computes a token's output from that token alone in evaluation mode. Every layer
does, except a router with an evaluation capacity (Switch's or GShard's
``eval_capacity_factor``: first come, first served among the tokens evaluated together);
such a model runs the window.
"""

from __future__ import annotations

import math

import torch
from torch import nn


def next_token_distribution(logits: torch.Tensor, temperature: float = 1.0,
                            top_k: int | None = None, top_p: float | None = None
                            ) -> torch.Tensor:
    """The distribution [B, V] (float32) a token is drawn from, given the model's next-token
    ``logits`` [B, V]: softmax(logits / temperature), keeping only the ``top_k`` most likely
    tokens and then the smallest set of most likely tokens whose probability reaches
    ``top_p`` (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration",
    arXiv:1904.09751), renormalised. Ties at the top-k boundary are all kept. ``temperature``
    0 is greedy: all the mass on the arg-max (the first, on a tie)."""
    logits = logits.float()
    if temperature == 0:
        return nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = logits.softmax(-1)
    if top_p is not None and top_p < 1.0:
        sorted_probs, order = probs.sort(-1, descending=True)
        # a token stays if the tokens more likely than it hold less than top_p
        before = sorted_probs.cumsum(-1) - sorted_probs
        keep = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, before < top_p)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def check_sampling(temperature: float, top_k: int | None, top_p: float | None,
                   max_new_tokens: int) -> None:
    """A ValueError naming the argument out of range."""
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature)
            and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got "
                         f"{temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and top_k >= 1):
        raise ValueError(f"top_k must be a positive integer (or None: every token), got "
                         f"{top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must lie in (0, 1] (or None: no nucleus), got {top_p!r}")
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 0):
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")


def cache_blocker(model: nn.Module) -> str | None:
    """The name of the first module of ``model`` that routes a token by the other tokens
    evaluated with it (:attr:`~sparseffn.routers.base.Router.routes_tokens_alone_in_eval`),
    so that a KV cache would change the model's outputs; None if there is none."""
    from ..routers.base import Router
    for name, module in model.named_modules():
        if isinstance(module, Router) and not module.routes_tokens_alone_in_eval:
            return name or type(module).__name__
    return None


def _kv_cache(model: nn.Module, use_cache: bool | None):
    """The model's new KV cache where ``use_cache`` (None: where it can) asks for one; a
    ValueError naming the reason where ``use_cache=True`` cannot have one."""
    if use_cache is False:
        return None
    if use_cache not in (None, True):
        raise ValueError(f"use_cache must be True, False or None (where the model allows), "
                         f"got {use_cache!r}")
    if not hasattr(model, "new_kv_cache"):
        if use_cache:
            raise ValueError(f"use_cache=True: {type(model).__name__} has no KV cache "
                             f"(new_kv_cache)")
        return None
    blocker = cache_blocker(model)
    if blocker is not None:
        if use_cache:
            raise ValueError(f"use_cache=True: {blocker} routes each token by the tokens "
                             f"evaluated with it (an evaluation capacity), so a KV cache would "
                             f"change the model's outputs; leave use_cache=None to run the "
                             f"window for each token")
        return None
    return model.new_kv_cache()


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None,
             use_cache: bool | None = None) -> torch.Tensor:
    """``prompt`` (int64 [B, T], T >= 1, on the model's device) followed by
    ``max_new_tokens`` tokens drawn one at a time from :func:`next_token_distribution` of the
    model's logits at the last position: int64 [B, T + max_new_tokens].

    The model runs in eval mode (its mode is restored after), on at most its last
    ``model.config.context`` tokens. ``generator`` (on the model's device) makes the draws
    reproducible; without it they come from the global RNG. ``use_cache``: run each new token
    alone against a :class:`~sparseffn.models.kv_cache.KVCache` while the sequence fits the
    context (True; a ValueError where the model's routing forbids it, see
    :func:`cache_blocker`), run the window for every token (False), or the first where the
    model allows it (None, the default)."""
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    vocab, context = model.config.vocab_size, model.config.context
    if prompt.dim() != 2 or prompt.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"prompt must be int64 token ids [batch, time], got "
                         f"{tuple(prompt.shape)} {prompt.dtype}")
    if prompt.shape[1] == 0:
        raise ValueError("prompt must hold at least one token (the model has no start token)")
    if prompt.numel() and (int(prompt.min()) < 0 or int(prompt.max()) >= vocab):
        raise ValueError(f"prompt holds token ids outside [0, {vocab}): "
                         f"{int(prompt.min())}..{int(prompt.max())}")
    cache = _kv_cache(model, use_cache)
    was_training = model.training
    model.eval()
    tokens = prompt.long()
    try:
        for step in range(max_new_tokens):
            if cache is None:
                logits = model(tokens[:, -context:])[:, -1]
            elif step == 0:          # the prompt fills the cache
                logits = model(tokens[:, -context:], cache=cache)[:, -1]
            else:
                logits = model(tokens[:, -1:], cache=cache)[:, -1]
            if cache is not None and cache.full:   # the next position is past the table
                cache = None
            if temperature == 0:     # greedy: the arg-max, without building its one-hot
                following = logits.argmax(-1, keepdim=True)
            else:
                following = torch.multinomial(
                    next_token_distribution(logits, temperature, top_k, top_p), 1,
                    generator=generator)
            tokens = torch.cat([tokens, following], dim=1)
    finally:
        model.train(was_training)
    return tokens
