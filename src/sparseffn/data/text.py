"""Language-modelling data: a corpus split 90/5/5 into train / validation / test by position
(the enwik8 convention), tokenized, sampled as random windows for training and read as
fixed non-overlapping windows for evaluation.

Every batch is a function of ``(seed, step)`` alone, so a resumed run draws exactly the
batches the uninterrupted run would have drawn, without any sampler state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .corpora import corpus_bytes
from .tokenizers import BPETokenizer, ByteTokenizer, tokenizer_from_state

SPLITS = ("train", "val", "test")
SPLIT_FRACTIONS = (0.90, 0.05, 0.05)


def split_bytes(data: bytes) -> dict[str, bytes]:
    """Contiguous, disjoint 90/5/5 slices of ``data``."""
    n = len(data)
    first, second = int(n * SPLIT_FRACTIONS[0]), int(n * (SPLIT_FRACTIONS[0] + SPLIT_FRACTIONS[1]))
    return {"train": data[:first], "val": data[first:second], "test": data[second:]}


def unigram_entropy_bits(data: bytes) -> float:
    """Entropy of the byte distribution of ``data`` in bits per byte: what a model that knows
    only byte frequencies achieves (a language model must go well below it)."""
    counts = np.bincount(np.frombuffer(data, dtype=np.uint8), minlength=256).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


@dataclass
class TextData:
    """A tokenized corpus. ``tokens[split]``: int64 [n]; ``bytes_per_split[split]``: its size in
    bytes; ``unigram_bits``: the training split's byte entropy (bits per byte)."""

    name: str
    tokenizer: object
    tokens: dict[str, torch.Tensor]
    bytes_per_split: dict[str, int]
    unigram_bits: float
    _token_bytes: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._token_bytes = torch.from_numpy(self.tokenizer.token_bytes())

    @classmethod
    def load(cls, corpus: str = "pydoc", path: str | None = None, tokenizer: str = "byte",
             vocab_size: int = 512, tokenizer_state: dict | None = None,
             fetch: bool = True) -> "TextData":
        """Read ``corpus`` (see :mod:`sparseffn.data.corpora`), split it and tokenize each split.
        ``tokenizer``: ``"byte"`` or ``"bpe"`` (trained on the training split with
        ``vocab_size`` tokens, unless ``tokenizer_state`` from a checkpoint is given)."""
        parts = split_bytes(corpus_bytes(corpus, path, fetch=fetch))
        if tokenizer_state is not None:
            tok = tokenizer_from_state(tokenizer_state)
        elif tokenizer == "byte":
            tok = ByteTokenizer()
        elif tokenizer == "bpe":
            tok = BPETokenizer.train(parts["train"], vocab_size)
        else:
            raise ValueError(f"data.tokenizer must be 'byte' or 'bpe', got {tokenizer!r}")
        tokens = {s: torch.from_numpy(tok.encode(parts[s])) for s in SPLITS}
        return cls(corpus, tok, tokens, {s: len(parts[s]) for s in SPLITS},
                   unigram_entropy_bits(parts["train"]))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    def check_context(self, context: int) -> None:
        for split in SPLITS:
            if self.tokens[split].numel() < context + 2:
                raise ValueError(f"the {split} split of corpus {self.name!r} has "
                                 f"{self.tokens[split].numel()} tokens, fewer than context + 2 = "
                                 f"{context + 2}; use a shorter context or a larger corpus")

    def batch(self, step: int, batch_size: int, context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Training inputs and next-token targets, int64 [batch_size, context] each, from
        windows at random offsets drawn from ``(seed, step)``."""
        train = self.tokens["train"]
        rng = np.random.default_rng([seed, step])
        starts = torch.from_numpy(rng.integers(0, train.numel() - context - 1, size=batch_size))
        windows = train[starts[:, None] + torch.arange(context + 1)]
        return windows[:, :-1], windows[:, 1:]

    def eval_windows(self, split: str, context: int, max_windows: int | None = None) -> torch.Tensor:
        """int64 [W, context + 1]: non-overlapping windows covering ``split`` (the last partial
        one dropped), or ``max_windows`` of them spread evenly over it. Fixed: every evaluation
        reads the same tokens."""
        data = self.tokens[split]
        count = (data.numel() - 1) // context
        index = torch.arange(count)
        if max_windows is not None and count > max_windows:
            index = torch.linspace(0, count - 1, max_windows).round().long()
        starts = index * context
        return data[starts[:, None] + torch.arange(context + 1)]

    def target_bytes(self, targets: torch.Tensor) -> int:
        """Bytes the ``targets`` tokens stand for (their count, for bytes)."""
        return int(self._token_bytes[targets].sum())

    def tokens_per_byte(self, split: str = "val") -> float:
        return self.tokens[split].numel() / max(1, self.bytes_per_split[split])


def bits_per_byte(total_nats: float, total_bytes: int) -> float:
    return total_nats / max(1, total_bytes) / math.log(2)
