"""Tokenizers for the language model: bytes (the default, vocabulary 256) or a byte-level BPE
trained on the training split.

Both map ``bytes -> int64 numpy array`` and back, and report each token's length in bytes, so
that bits per byte (bits per character for ASCII text) can be computed whatever the tokens are.
"""

from __future__ import annotations

import numpy as np

from . import fast_bpe
from .fast_bpe import NEWLINE


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


#: Engines of :class:`BPETokenizer`; all give the same tokens.
BPE_BACKENDS = ("auto", "tokenizers", "numpy")


def _check_backend(backend: str) -> None:
    if backend not in BPE_BACKENDS:
        raise ValueError(f"BPE backend must be one of {BPE_BACKENDS}, got {backend!r}")
    if backend == "tokenizers" and not fast_bpe.available():
        raise ImportError('BPE backend "tokenizers" needs the tokenizers package: '
                          "pip install tokenizers (or use backend='numpy')")


class BPETokenizer:
    """Byte-level byte-pair encoding: starting from the 256 bytes, repeatedly merge the most
    frequent adjacent pair of the training text into a new token (Sennrich et al. 2016,
    arXiv:1508.07909), up to ``vocab_size`` tokens. Encoding applies the merges in the order
    they were learned, so encoding the training text gives exactly the sequence training
    ended with. Ties between equally frequent pairs go to the smaller pair of ids:
    deterministic. No merge crosses the start of a line (a token may begin with ``\n`` but
    holds no other newline), so a text is its lines tokenized one by one.

    backend: ``"tokenizers"`` trains and encodes with Hugging Face's Rust ``tokenizers``
    (:mod:`sparseffn.data.fast_bpe`: the same merges and ids, 3-17× faster), ``"numpy"``
    with the NumPy code here (no dependency: O(merges · n)), ``"auto"`` (default) the first
    where it is installed. The state (the merges) is the same whichever built it.
    At most ``max_train_bytes`` of the text are used to train.
    """

    kind = "bpe"

    def __init__(self, merges: list[tuple[int, int]], backend: str = "auto") -> None:
        _check_backend(backend)
        self.merges = [(int(a), int(b)) for a, b in merges]
        self.vocab_size = 256 + len(self.merges)
        lengths = [1] * 256
        for a, b in self.merges:
            lengths.append(lengths[a] + lengths[b])
        self._lengths = np.array(lengths, dtype=np.int64)
        self._fast = fast_bpe.FastEncoder.build(self.merges) if backend != "numpy" else None
        if backend == "tokenizers" and self._fast is None:
            raise ValueError("these merges have no tokenizers equivalent (two merges make the "
                             "same token, or one crosses a line start); use backend='numpy'")

    @property
    def backend(self) -> str:
        """The engine that encodes: ``"tokenizers"`` or ``"numpy"``."""
        return "numpy" if self._fast is None else "tokenizers"

    @classmethod
    def train(cls, data: bytes, vocab_size: int, max_train_bytes: int = 1 << 21,
              backend: str = "auto") -> "BPETokenizer":
        if not 256 < vocab_size <= 65536:
            raise ValueError(f"BPE vocab_size must be in 257..65536, got {vocab_size}")
        _check_backend(backend)
        data = data[:max_train_bytes]
        merges = None
        if backend != "numpy" and fast_bpe.available():
            merges = fast_bpe.train_merges(data, vocab_size)
        if merges is None:
            merges = _train_merges(data, vocab_size)
        return cls(merges, backend)

    def encode(self, data: bytes) -> np.ndarray:
        if self._fast is not None:
            return self._fast.encode(data)
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


def _train_merges(data: bytes, vocab_size: int) -> list[tuple[int, int]]:
    """:meth:`BPETokenizer.train` in NumPy: O(merges · n)."""
    ids = np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    first_byte = np.zeros(vocab_size, dtype=np.int64)
    first_byte[:256] = np.arange(256)
    merges: list[tuple[int, int]] = []
    for new in range(256, vocab_size):
        if ids.size < 2:
            break
        codes = ids[:-1] * vocab_size + ids[1:]
        codes = codes[first_byte[ids[1:]] != NEWLINE]      # no pair across a line start
        if codes.size == 0:
            break
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
        first_byte[new] = first_byte[a]
        ids = _merge(ids, a, b, new)
    return merges


def tokenizer_from_state(state: dict):
    if state["kind"] == "byte":
        return ByteTokenizer()
    if state["kind"] == "bpe":
        return BPETokenizer([tuple(m) for m in state["merges"]])
    raise ValueError(f"unknown tokenizer kind {state['kind']!r}")
