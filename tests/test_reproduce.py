"""`sparseffn reproduce moefication` end to end in its quick form, on a tiny random BERT and
a review file written here (the real model and reviews are fetched by pip; not in CI)."""

import bz2
import csv
import io
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from sparseffn.cli import main                                   # noqa: E402
from sparseffn.data.errors import MissingDataset                  # noqa: E402
from sparseffn.data.packaged import rotten_tomatoes               # noqa: E402
from sparseffn.reproduce.moefication import logistic_probe       # noqa: E402

GOOD = ["great", "moving", "fun", "brilliant", "loved"]
BAD = ["boring", "awful", "dull", "mess", "hated"]
FILLER = ["the", "film", "plot", "actors", "story", "scene", "a", "was", "and", "it"]


def _reviews(n=400, seed=0):
    rng = random.Random(seed)
    rows = [{"category": "plot", "text": "a plot summary", "movie_name": "m0"}]
    for i in range(n):
        fresh = i % 2 == 0
        words = rng.choices(FILLER, k=4) + rng.choices(GOOD if fresh else BAD, k=4)
        rng.shuffle(words)
        rows.append({"category": "fresh" if fresh else "rotten", "text": " ".join(words),
                     "movie_name": f"m{i}"})
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=["category", "text", "movie_name"])
    writer.writeheader()
    writer.writerows(rows)
    return out.getvalue()


def _tiny_bert(folder):
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + GOOD + BAD + FILLER
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = transformers.BertTokenizerFast(vocab={w: i for i, w in enumerate(vocab)})
    assert tokenizer("great")["input_ids"][1] == vocab.index("great")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=len(vocab), hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, initializer_range=0.3))
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_reviews_load_from_csv_and_bz2_without_the_plot_summaries(tmp_path):
    text = _reviews(10)
    (tmp_path / "r.csv").write_text(text)
    (tmp_path / "r.csv.bz2").write_bytes(bz2.compress(text.encode()))
    for name in ("r.csv", "r.csv.bz2"):
        texts, labels = rotten_tomatoes(str(tmp_path / name))
        assert len(texts) == 10 and labels == [1, 0] * 5
        assert "a plot summary" not in texts
    with pytest.raises(MissingDataset, match="does not exist"):
        rotten_tomatoes(str(tmp_path / "absent.csv"))


def test_logistic_probe_separates_separable_data_and_not_noise():
    torch.manual_seed(0)
    x = torch.randn(400, 5)
    y = (x[:, 0] > 0).long()
    assert logistic_probe(x[:300], y[:300], x[300:], y[300:]) > 0.95
    noise = torch.randint(0, 2, (400,))
    assert logistic_probe(x[:300], noise[:300], x[300:], noise[300:]) < 0.7


def test_reproduce_moefication_quick_writes_its_report(tmp_path, capsys):
    _tiny_bert(tmp_path)
    (tmp_path / "reviews.csv").write_text(_reviews())
    out = tmp_path / "results"
    assert main(["reproduce", "moefication", "--quick", "--model", str(tmp_path),
                 "--data", str(tmp_path / "reviews.csv"), "--out", str(out)]) == 0
    results = json.loads((out / "moefication.json").read_text())
    report = (out / "moefication.md").read_text()
    assert "| dense | 100.0% |" in report and "not judged (quick form)" in report
    rows = results["rows"]
    assert [r["stage"].split(" ")[0] for r in rows] == ["-", "converted", "+", "converted",
                                                        "control:", "+"]
    assert [r["k"] for r in rows] == [None, 16, 16, 8, 8, 8]
    for r in rows[1:]:
        assert -1 <= r["cosine"] <= 1 + 1e-6 and 0 <= r["probe_accuracy"] <= 1
        assert r["ffn_flops"] < 1
    assert rows[1]["ffn_flops"] > rows[3]["ffn_flops"]      # 16 experts cost more than 8
    assert rows[0]["probe_accuracy"] > 0.65       # the sentiment words are learnable
    assert all(c["held"] is None for c in results["claims"])
    assert "moefication.md" in capsys.readouterr().out


def test_reproduce_names_a_missing_model_folder(tmp_path, capsys):
    (tmp_path / "reviews.csv").write_text(_reviews(20))
    code = main(["reproduce", "moefication", "--quick", "--model", str(tmp_path / "none"),
                 "--data", str(tmp_path / "reviews.csv"), "--out", str(tmp_path / "r")])
    assert code == 2 and "none" in capsys.readouterr().err
