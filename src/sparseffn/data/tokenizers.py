"""Tokenizers for the language model: bytes (the default, vocabulary 256) or a byte-level BPE
trained on the training split.

Both map ``bytes -> int64 numpy array`` and back, and report each token's length in bytes, so
that bits per byte (bits per character for ASCII text) can be computed whatever the tokens are.
"""

from __future__ import annotations

import numpy as np


class ByteTokenizer:
    """Every byte is a token (vocabulary 256), the enwik8 convention."""

    kind = "byte"
    vocab_size = 256

    def encode(self, data: bytes) -> np.ndarray:
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)

    def decode(self, ids) -> bytes:
        return bytes(int(i) for i in ids)

    def token_bytes(self) -> np.ndarray:
        """int64 [vocab_size]: bytes each token stands for."""
        return np.ones(256, dtype=np.int64)

    def state(self) -> dict:
        return {"kind": self.kind}


def _merge(ids: np.ndarray, a: int, b: int, new: int) -> np.ndarray:
    """Replace each non-overlapping occurrence of the pair (a, b), left to right, by ``new``."""
    starts = np.flatnonzero((ids[:-1] == a) & (ids[1:] == b))
    if starts.size == 0:
        return ids
    if a == b and starts.size > 1:
        # in a run like a a a, the pairs at 0 and 1 overlap: keep every other start of a run
        gap = np.diff(starts) != 1
        run_start = np.maximum.accumulate(np.where(np.concatenate(([True], gap)),
                                                   np.arange(starts.size), 0))
        starts = starts[(np.arange(starts.size) - run_start) % 2 == 0]
    out = ids.copy()
    out[starts] = new
    keep = np.ones(ids.size, dtype=bool)
    keep[starts + 1] = False
    return out[keep]


class BPETokenizer:
    """Byte-level byte-pair encoding: starting from the 256 bytes, repeatedly merge the most
    frequent adjacent pair of the training text into a new token (Sennrich et al. 2016), up to
    ``vocab_size`` tokens. Encoding applies the merges in the order they were learned, so
    encoding the training text gives exactly the sequence training ended with. Ties between
    equally frequent pairs go to the smaller pair code: deterministic.

    Training is O(merges · n) in NumPy; at most ``max_train_bytes`` of the text are used.
    """

    kind = "bpe"

    def __init__(self, merges: list[tuple[int, int]]) -> None:
        self.merges = [(int(a), int(b)) for a, b in merges]
        self.vocab_size = 256 + len(self.merges)
        lengths = [1] * 256
        for a, b in self.merges:
            lengths.append(lengths[a] + lengths[b])
        self._lengths = np.array(lengths, dtype=np.int64)

    @classmethod
    def train(cls, data: bytes, vocab_size: int, max_train_bytes: int = 1 << 21) -> "BPETokenizer":
        if not 256 < vocab_size <= 65536:
            raise ValueError(f"BPE vocab_size must be in 257..65536, got {vocab_size}")
        ids = np.frombuffer(data[:max_train_bytes], dtype=np.uint8).astype(np.int64)
        merges: list[tuple[int, int]] = []
        for new in range(256, vocab_size):
            if ids.size < 2:
                break
            codes = ids[:-1] * vocab_size + ids[1:]
            if vocab_size * vocab_size <= 1 << 22:
                counts = np.bincount(codes, minlength=vocab_size * vocab_size)
                best = int(np.argmax(counts))
                if counts[best] < 2:
                    break
            else:
                values, counts = np.unique(codes, return_counts=True)
                top = int(np.argmax(counts))   # first maximum: the smallest code
                if counts[top] < 2:
                    break
                best = int(values[top])
            a, b = divmod(best, vocab_size)
            merges.append((a, b))
            ids = _merge(ids, a, b, new)
        return cls(merges)

    def encode(self, data: bytes) -> np.ndarray:
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
        for offset, (a, b) in enumerate(self.merges):
            ids = _merge(ids, a, b, 256 + offset)
        return ids

    def decode(self, ids) -> bytes:
        table = [bytes([i]) for i in range(256)]
        for a, b in self.merges:
            table.append(table[a] + table[b])
        return b"".join(table[int(i)] for i in ids)

    def token_bytes(self) -> np.ndarray:
        return self._lengths

    def state(self) -> dict:
        return {"kind": self.kind, "merges": self.merges}


def tokenizer_from_state(state: dict):
    if state["kind"] == "byte":
        return ByteTokenizer()
    if state["kind"] == "bpe":
        return BPETokenizer([tuple(m) for m in state["merges"]])
    raise ValueError(f"unknown tokenizer kind {state['kind']!r}")
