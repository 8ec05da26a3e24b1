"""``sparseffn sample``: text from a trained language model's checkpoint.

The checkpoint holds everything needed: the model config it was trained with, its weights
and its tokenizer (a BPE tokenizer's merges), so the corpus is not read again. A checkpoint
written before model configs were kept, or holding one this version cannot build, is rebuilt
from its run config and corpus, as ``sparseffn eval`` does."""

from __future__ import annotations

from pathlib import Path

import torch

from ..data.tokenizers import tokenizer_from_state
from ..models.generate import Decoder, generate
from ..models.lm import LMConfig, TransformerLM
from . import checkpoint as ckpt
from .config import ConfigError


def load_language_model(path: str | Path) -> tuple[dict, TransformerLM, object]:
    """(the checkpoint's state, its TransformerLM in eval mode on the CPU, its tokenizer).
    A ConfigError for a classifier's checkpoint."""
    state = ckpt.load(path)
    saved = state.get("model_config")
    if (saved is not None and saved.get("kind") != "lm") or state.get("tokenizer") is None:
        raise ConfigError(f"{path} holds a classifier's checkpoint; sample needs a language "
                          f"model's (model.kind = 'lm')")
    from .trainer import load_network
    state, model = load_network(path, state)
    assert isinstance(model.config, LMConfig)
    return state, model, tokenizer_from_state(state["tokenizer"])


def sample_texts(path: str | Path, prompt: str = "\n", tokens: int = 200, samples: int = 1,
                 temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, seed: int = 0,
                 device: str = "cpu", use_cache: bool | None = None,
                 compile: str = "none") -> list[str]:
    """``samples`` texts, each ``prompt`` followed by ``tokens`` tokens drawn from the model
    at ``path`` (:func:`sparseffn.models.generate.generate`, with its ``use_cache``); the
    same ``seed`` gives the same texts on the same device. Bytes that do not decode as UTF-8
    (a token may end inside a character) show as U+FFFD. ``compile`` other than ``"none"``
    draws them with a :class:`~sparseffn.models.generate.Decoder` compiled so (the same
    texts, to rounding), which needs the KV cache (``use_cache`` not False)."""
    from .trainer import training_device
    if compile != "none" and use_cache is False:
        raise ValueError("compiling the decoding steps needs the KV cache (the window alone "
                         "is not compiled); leave the cache on or compile none")
    target = training_device(device)
    _, model, tokenizer = load_language_model(path)
    ids = torch.as_tensor(tokenizer.encode(prompt.encode("utf-8")), dtype=torch.long)
    if ids.numel() == 0:
        raise ValueError("the prompt is empty: the model needs at least one token to start "
                         "from (the default is a newline)")
    generator = torch.Generator(device=target).manual_seed(seed)
    model, prompts = model.to(target), ids.to(target).expand(samples, -1)
    if compile == "none":
        out = generate(model, prompts, tokens, temperature, top_k, top_p, generator, use_cache)
    else:
        out = Decoder(model, samples, compile).generate(prompts, tokens, temperature, top_k,
                                                        top_p, generator)
    return [tokenizer.decode(row.tolist()).decode("utf-8", errors="replace") for row in out]
