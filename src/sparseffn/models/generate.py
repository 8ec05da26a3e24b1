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

:class:`Decoder` draws the same tokens from steps whose shapes never change (a
:class:`~sparseffn.models.kv_cache.StaticKVCache`), so that ``torch.compile`` makes one graph
for every token and, on a GPU, CUDA graphs replay it without the host launching each kernel.
"""

from __future__ import annotations

import contextlib
import math
from typing import Callable

import torch
from torch import nn

from ..auxiliary import no_usage_statistics
from ..runtime import check_compile_mode, compiled, compiling_many


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
            raise ValueError(f"use_cache=True: {_blocked_by(blocker)}; leave use_cache=None "
                             f"to run the window for each token")
        return None
    return model.new_kv_cache()


def _blocked_by(blocker: str) -> str:
    return (f"{blocker} routes each token by the tokens evaluated with it (an evaluation "
            f"capacity), so a KV cache would change the model's outputs")


def check_prompt(prompt: torch.Tensor, vocab: int) -> None:
    """A ValueError unless ``prompt`` is int64 (or int32) token ids [batch, time >= 1] in
    [0, vocab)."""
    if prompt.dim() != 2 or prompt.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"prompt must be int64 token ids [batch, time], got "
                         f"{tuple(prompt.shape)} {prompt.dtype}")
    if prompt.shape[1] == 0:
        raise ValueError("prompt must hold at least one token (the model has no start token)")
    if prompt.numel() and (int(prompt.min()) < 0 or int(prompt.max()) >= vocab):
        raise ValueError(f"prompt holds token ids outside [0, {vocab}): "
                         f"{int(prompt.min())}..{int(prompt.max())}")


def _sample(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int,
            next_logits: Callable[[torch.Tensor, int], torch.Tensor], temperature: float,
            top_k: int | None, top_p: float | None,
            generator: torch.Generator | None, record_usage: bool) -> torch.Tensor:
    """``prompt`` followed by ``max_new_tokens`` tokens, each drawn from
    ``next_logits(tokens so far, step)`` [B, V] with the model in eval mode (restored after),
    inside :func:`~sparseffn.no_usage_statistics` unless ``record_usage``."""
    was_training = model.training
    model.eval()
    counting = contextlib.nullcontext() if record_usage else no_usage_statistics(model)
    try:
        with counting:
            return draw_tokens(prompt, max_new_tokens, next_logits, temperature, top_k, top_p,
                               generator)
    finally:
        model.train(was_training)


def draw_tokens(prompt: torch.Tensor, max_new_tokens: int,
                next_logits: Callable[[torch.Tensor, int], torch.Tensor], temperature: float,
                top_k: int | None, top_p: float | None,
                generator: torch.Generator | None) -> torch.Tensor:
    """``prompt`` [B, T] followed by ``max_new_tokens`` tokens, int64 [B, T +
    max_new_tokens], each drawn from :func:`next_token_distribution` of
    ``next_logits(tokens so far, step)`` [B, V] (the arg-max where ``temperature`` is 0)."""
    tokens = prompt.long()
    for step in range(max_new_tokens):
        logits = next_logits(tokens, step)
        if temperature == 0:     # greedy: the arg-max, without building its one-hot
            following = logits.argmax(-1, keepdim=True)
        else:
            following = torch.multinomial(
                next_token_distribution(logits, temperature, top_k, top_p), 1,
                generator=generator)
        tokens = torch.cat([tokens, following], dim=1)
    return tokens


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, max_new_tokens: int,
             temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
             generator: torch.Generator | None = None,
             use_cache: bool | None = None, record_usage: bool = False) -> torch.Tensor:
    """``prompt`` (int64 [B, T], T >= 1, on the model's device) followed by
    ``max_new_tokens`` tokens drawn one at a time from :func:`next_token_distribution` of the
    model's logits at the last position: int64 [B, T + max_new_tokens].

    The model runs in eval mode (its mode is restored after), on at most its last
    ``model.config.context`` tokens. ``generator`` (on the model's device) makes the draws
    reproducible; without it they come from the global RNG. ``use_cache``: run each new token
    alone against a :class:`~sparseffn.models.kv_cache.KVCache` while the sequence fits the
    context (True; a ValueError where the model's routing forbids it, see
    :func:`cache_blocker`), run the window for every token (False), or the first where the
    model allows it (None, the default).

    The sparse layers record no expert usage while generating
    (:func:`~sparseffn.no_usage_statistics`: a decode step's counting costs about as much as
    its routing), so ``usage_counts`` / ``usage_mass`` stay as they were. ``record_usage=True``
    counts every forward: with the cache each token once, the prompt included; where the
    window runs, every token of the window at every step."""
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    check_prompt(prompt, model.config.vocab_size)
    context = model.config.context
    cache = _kv_cache(model, use_cache)

    def next_logits(tokens: torch.Tensor, step: int) -> torch.Tensor:
        nonlocal cache
        if cache is None:
            logits = model(tokens[:, -context:])[:, -1]
        elif step == 0:          # the prompt fills the cache
            logits = model(tokens[:, -context:], cache=cache)[:, -1]
        else:
            logits = model(tokens[:, -1:], cache=cache)[:, -1]
        if cache is not None and cache.full:   # the next position is past the table
            cache = None
        return logits

    return _sample(model, prompt, max_new_tokens, next_logits, temperature, top_k, top_p,
                   generator, record_usage)


def _fresh(piece: torch.Tensor) -> torch.Tensor:
    """A copy of ``piece`` (a slice of the sequences) with the strides of a new tensor: a
    slice's strides follow the sequences' length (even where a dimension has size 1, for a
    batch of one, which ``contiguous()`` leaves alone), and a compiled step is specialised
    to its inputs' strides."""
    return piece.clone(memory_format=torch.contiguous_format)


class Decoder:
    """Generation from a :class:`~sparseffn.models.lm.TransformerLM` in steps of fixed shapes,
    for ``torch.compile`` and CUDA graphs: ``batch`` sequences at a time, against one
    :class:`~sparseffn.models.kv_cache.StaticKVCache` that every call reuses.

        decoder = Decoder(model, batch=8, compile="reduce-overhead")
        tokens = decoder.generate(prompt, 200, temperature=0.8, top_p=0.95)

    The prompt runs eagerly into the cache; each new token then runs alone (the compiled
    one-token step: :meth:`~sparseffn.models.lm.TransformerLM.forward_at` at a position held
    in a tensor, so one graph serves every position) until the sequence fills the context,
    after which each token runs the last ``context`` tokens (a second compiled step, of
    shape [batch, context]). The tokens drawn are :func:`generate`'s (same ``generator``
    draws), to rounding: the one-token step attends over every cached position under a mask
    instead of over the positions so far.

    ``compile``: ``"none"`` (eager), ``"default"`` or ``"reduce-overhead"`` (CUDA graphs; on
    a CPU the default compile). Compiling happens at the first :meth:`generate`. ``dtype``:
    the cache's (default: autocast's where autocast is on for the model's device when the
    decoder is made, else the parameters'); generate under the same autocast. A model whose
    routing depends on the tokens evaluated together (:func:`cache_blocker`) is refused."""

    def __init__(self, model: nn.Module, batch: int, compile: str = "none",
                 dtype: torch.dtype | None = None) -> None:
        check_compile_mode(compile)
        if not hasattr(model, "new_static_kv_cache"):
            raise ValueError(f"Decoder: {type(model).__name__} has no static KV cache "
                             f"(new_static_kv_cache)")
        blocker = cache_blocker(model)
        if blocker is not None:
            raise ValueError(f"Decoder: {_blocked_by(blocker)}; use generate(), which runs "
                             f"the window for each token")
        self.model, self.compile = model, compile
        self.cache = model.new_static_kv_cache(batch, dtype)
        self._one_token = compiled(self._one_token_logits, compile, fullgraph=True)
        self._window = compiled(self._window_logits, compile, fullgraph=True)

    def _one_token_logits(self, token: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
        return self.model.forward_at(token, position, self.cache)[:, -1]

    def _window_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)[:, -1]

    def _run(self, step: Callable, *args: torch.Tensor) -> torch.Tensor:
        if self.compile == "reduce-overhead":
            # a new replay may write over the last step's outputs, read by now
            torch.compiler.cudagraph_mark_step_begin()
        return step(*args)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None,
                 generator: torch.Generator | None = None,
                 record_usage: bool = False) -> torch.Tensor:
        """``prompt`` (int64 [batch, T], T >= 1) followed by ``max_new_tokens`` drawn tokens,
        int64 [batch, T + max_new_tokens]; the arguments are :func:`generate`'s. Empties the
        cache first (the prompt starts new sequences). The compiled steps are specialised to
        ``record_usage``: the first call with the other value compiles them again."""
        check_sampling(temperature, top_k, top_p, max_new_tokens)
        check_prompt(prompt, self.model.config.vocab_size)
        cache, model = self.cache, self.model
        if prompt.shape[0] != cache.batch:
            raise ValueError(f"Decoder: made for {cache.batch} sequences, the prompt holds "
                             f"{prompt.shape[0]}")
        context = model.config.context
        cache.reset()

        def next_logits(tokens: torch.Tensor, step: int) -> torch.Tensor:
            if step == 0:        # the prompt fills the cache, eagerly (its length varies)
                return model(tokens[:, -context:], cache=cache)[:, -1]
            if cache.full:       # the next position is past the table: the window
                return self._run(self._window, _fresh(tokens[:, -context:]))
            token = _fresh(tokens[:, -1:])
            start = cache.claim(token)
            logits = self._run(self._one_token, token,
                               torch.full((1,), start, dtype=torch.long, device=token.device))
            cache.length = start + 1
            return logits

        # every decoder's steps share two code objects: one graph each per decoder
        with contextlib.nullcontext() if self.compile == "none" else compiling_many():
            return _sample(model, prompt, max_new_tokens, next_logits, temperature, top_k,
                           top_p, generator, record_usage)
