"""``sparseffn bench tokenizers``: the BPE tokenizer's two engines, NumPy and Hugging Face
``tokenizers``, training and encoding the same text, and whether they agree (they must: the
same merges and the same ids; see :mod:`sparseffn.data.fast_bpe`)."""

from __future__ import annotations

import time

import numpy as np

from ..data import BPETokenizer, fast_bpe
from ..data.corpora import corpus_bytes
from .measure import InterruptibleLoop, write_json


def _seconds(fn):
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run(megabytes: float = 2.0, vocab_sizes: tuple[int, ...] = (1024, 4096),
        corpus: str = "stdlib", json_path: str | None = None) -> list[dict]:
    """Train on the first ``megabytes`` of ``corpus`` (the standard library's sources by
    default: nothing to download) at each vocabulary size with each engine, encode the same
    text, and print seconds, tokens per byte and the speed-up. Ctrl-C (or ``timeout -s INT``)
    after the first vocabulary size keeps the sizes measured and names the others."""
    data = corpus_bytes(corpus, None, fetch=False)[:int(megabytes * (1 << 20))]
    engines = ["numpy"] + (["tokenizers"] if fast_bpe.available() else [])
    records = []
    print(f"BPE on {len(data) / (1 << 20):.2f} MB of {corpus!r}"
          + ("" if len(engines) > 1 else " (tokenizers not installed: NumPy only)"))
    print(f"{'vocab':>6} {'engine':<11} {'train s':>8} {'encode s':>9} {'tokens/byte':>12} "
          f"{'speed-up train':>15} {'speed-up encode':>16} {'same merges, ids':>17}")
    with InterruptibleLoop(vocab_sizes) as loop:
        for vocab in loop:
            records += _bench_vocab(vocab, data, engines)
    if loop.left:
        print(f"bench tokenizers: interrupted: not timed: vocabulary sizes "
              f"{', '.join(map(str, loop.left))}", flush=True)
    if json_path:
        write_json(records, json_path)
    return records


def _bench_vocab(vocab: int, data: bytes, engines: list[str]) -> list[dict]:
    """One vocabulary size's records (one per engine), their rows printed."""
    result = {}
    for engine in engines:
        train_s, tok = _seconds(lambda: BPETokenizer.train(data, vocab, len(data), engine))
        encode_s, ids = _seconds(lambda: tok.encode(data))
        result[engine] = (train_s, encode_s, tok, ids)
    base_train, base_encode, base_tok, base_ids = result["numpy"]
    records = []
    for engine, (train_s, encode_s, tok, ids) in result.items():
        same = tok.merges == base_tok.merges and np.array_equal(ids, base_ids)
        record = {"vocab_size": vocab, "engine": engine, "bytes": len(data),
                  "train_s": train_s, "encode_s": encode_s,
                  "tokens_per_byte": len(ids) / max(len(data), 1),
                  "train_speedup": base_train / train_s, "encode_speedup": base_encode / encode_s,
                  "agrees_with_numpy": same}
        records.append(record)
        print(f"{vocab:>6} {engine:<11} {train_s:>8.2f} {encode_s:>9.2f} "
              f"{record['tokens_per_byte']:>12.3f} {record['train_speedup']:>14.1f}× "
              f"{record['encode_speedup']:>15.1f}× {str(same):>17}", flush=True)
    return records
