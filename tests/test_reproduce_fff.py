"""`sparseffn reproduce fff-activations` (Chaunin & Mikhailovskiy's Table 1): the statistics
and claim checks on hand-made accuracies, the MoE row as the softmax router over the same
leaves, and the quick form end to end on clusters and on a tiny Fashion-MNIST written here."""

import json
import math

import numpy as np
import pytest
import torch

from sparseffn import build_layer
from sparseffn.cli import main
from sparseffn.data import MissingDataset
from sparseffn.data import arrays
from sparseffn.reproduce import EXPERIMENTS, run
from sparseffn.reproduce.fff_activations import (
    CLAIMS, ROWS, accuracies, average_gain, beats_at_every_depth, best_at_every_depth,
    gains_on_average, larger_gain, layer, no_gain_with_depth, variant_name, within_spread)
from sparseffn.registry import config_from_dict
from tests.data.test_data import write_idx


def _table(means: dict[str, tuple[float, float]], std: float = 0.01):
    """Accuracies at depths 2 and 3 from ``row -> (acc at d2, acc at d3)``."""
    return {row: {2: (a, std), 3: (b, std)} for row, (a, b) in means.items()}


def test_mean_and_std_over_seeds_by_hand():
    seeds = [{variant_name(r, d): 0.5 for r in ROWS for d in (2, 3)} for _ in range(3)]
    for seed, value in zip(seeds, (0.80, 0.84, 0.88)):
        seed["linear-d2"] = value
    acc = accuracies(seeds, (2, 3))
    mean, std = acc["linear"][2]
    assert mean == pytest.approx(0.84) and std == pytest.approx(0.04)   # sample std of ±0.04
    assert acc["relu"][3] == (0.5, 0.0)
    single = accuracies(seeds[:1], (2, 3))
    assert single["linear"][2] == (0.80, 0.0)                            # one seed: no spread


def test_average_gain_is_the_papers_mean_relative_change():
    acc = _table({"softplus": (0.40, 0.50), "linear": (0.44, 0.50), "relu": (0.40, 0.45)})
    assert average_gain(acc, "linear") == pytest.approx((0.10 + 0.0) / 2)
    assert average_gain(acc, "relu") == pytest.approx((0.0 - 0.10) / 2)


def test_claim_checks_by_hand():
    acc = _table({"softplus": (0.40, 0.50), "logsigmoid": (0.41, 0.495), "linear": (0.44, 0.51),
                  "relu": (0.45, 0.49), "gelu": (0.39, 0.38), "moe": (0.46, 0.52)})
    assert beats_at_every_depth("linear", "softplus")(acc)[0]
    assert not beats_at_every_depth("relu", "softplus")(acc)[0]          # 0.49 < 0.50 at d3
    assert gains_on_average("relu")(acc)[0]                              # +12.5% and -2%
    assert not gains_on_average("gelu")(acc)[0]
    held, words = larger_gain("linear", "relu")(acc)                   # +6.0% vs +5.25%
    assert held and not larger_gain("relu", "linear")(acc)[0] and "+6.0%" in words
    held, words = best_at_every_depth("moe")(acc)
    assert held and "best other relu 0.450" in words and "best other linear 0.510" in words
    assert not best_at_every_depth("linear")(acc)[0]
    held, words = within_spread("softplus", "logsigmoid")(acc)       # gap 0.0075 <= 0.02
    assert held and "0.0075" in words
    assert not within_spread("softplus", "linear")(acc)[0]               # gap 0.025 > 0.02
    assert not no_gain_with_depth(("linear", "relu"))(acc)[0]            # linear rises
    assert no_gain_with_depth(("gelu",))(acc)[0]                           # 0.39 -> 0.38
    for claim in CLAIMS:                                                 # names real rows
        held, words = claim.check(acc)
        assert isinstance(held, bool) and words


def test_the_moe_row_is_the_softmax_router_over_the_same_leaves():
    torch.manual_seed(0)
    moe = build_layer(config_from_dict({"d_model": 12, **layer("moe", 3, 5)}))
    fff = build_layer(config_from_dict({"d_model": 12, **layer("softplus", 3, 5)}))
    assert moe.config.router.activation == "linear" and fff.config.router.activation == "softplus"
    x = torch.randn(7, 12)
    logits = torch.nn.functional.linear(x, moe.router.weight, moe.router.bias)     # W x + b
    torch.testing.assert_close(moe.router.leaf_probs(x), torch.softmax(logits, -1))
    # the same leaves; the MoE's router has 2^d rows where the tree has 2^d - 1 nodes
    leaves = sum(p.numel() for n, p in fff.named_parameters() if not n.startswith("router."))
    assert leaves == sum(p.numel() for n, p in moe.named_parameters()
                         if not n.startswith("router."))
    router = {name: sum(p.numel() for p in m.router.parameters()) for name, m in
              (("fff", fff), ("moe", moe))}
    assert router["moe"] - router["fff"] == 12 + 1


def _tiny_fashion_mnist(folder):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(400, 28, 28), dtype=np.uint8)
    labels = (np.arange(400) % 10).astype(np.uint8)
    write_idx(folder / "train-images-idx3-ubyte.gz", images[:300])
    write_idx(folder / "train-labels-idx1-ubyte.gz", labels[:300])
    write_idx(folder / "t10k-images-idx3-ubyte.gz", images[300:])
    write_idx(folder / "t10k-labels-idx1-ubyte.gz", labels[300:])


def test_without_fashion_mnist_the_full_form_stops_first_and_the_quick_form_says_so(
        tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setattr(arrays, "FASHION_MNIST_DIR", str(empty))
    with pytest.raises(MissingDataset, match="apt-get install -y dataset-fashion-mnist"):
        run("fff-activations", out=str(tmp_path / "full"))
    assert not (tmp_path / "full").exists()                   # nothing trained or written
    with pytest.raises(MissingDataset, match="not found in"):
        run("fff-activations", out=str(tmp_path / "full"), data=str(empty))
    with pytest.raises(ValueError, match="CUDA device"):     # none here, or not that one
        run("fff-activations", quick=True, out=str(tmp_path / "q"), device="cuda" if not torch.cuda.is_available() else "cuda:99")


@pytest.mark.slow
def test_quick_form_end_to_end_without_and_with_fashion_mnist(tmp_path, monkeypatch, capsys):
    """Without Fashion-MNIST the quick form runs the clusters and says why; given a (tiny)
    Fashion-MNIST folder, it runs both, reusing the clusters runs that finished."""
    assert "fff-activations" in EXPERIMENTS
    monkeypatch.setattr(arrays, "FASHION_MNIST_DIR", str(tmp_path / "nowhere"))
    out = tmp_path / "out"
    result = run("fff-activations", quick=True, out=str(out))
    assert list(result["datasets"]) == ["clusters"]
    assert "apt-get install -y dataset-fashion-mnist" in result["skipped"]
    report = (out / "fff-activations.md").read_text()
    assert "Fashion-MNIST left out of this quick run" in report and "## Fashion-MNIST" not in report

    data = tmp_path / "fmnist"
    data.mkdir()
    _tiny_fashion_mnist(data)
    capsys.readouterr()
    assert main(["reproduce", "fff-activations", "--quick", "--data", str(data),
                 "--out", str(out)]) == 0
    printed = capsys.readouterr()
    assert "written:" in printed.out and "linear-d2: already trained, reusing" in printed.err
    report = (out / "fff-activations.md").read_text()
    result = json.loads((out / "fff-activations.json").read_text())
    assert set(result["datasets"]) == {"fashion_mnist", "clusters"} and result["skipped"] is None
    assert result["seeds"] == [0, 1]
    for dataset, numbers in result["datasets"].items():
        assert set(numbers["accuracy"]) == set(ROWS)
        per_seed = numbers["per_seed"]
        # the table's mean is the mean of the seeds' test accuracies
        mean, _ = numbers["accuracy"]["linear"]["2"]
        assert mean == pytest.approx((per_seed["0"]["linear-d2"] + per_seed["1"]["linear-d2"]) / 2)
        assert len(numbers["claims"]) == len(CLAIMS)
        test_size = 100 if dataset == "fashion_mnist" else 40
        assert all(math.isclose(a * test_size, round(a * test_size))  # counts of test examples
                   for a in per_seed["0"].values())
    assert "## Fashion-MNIST" in report and "## clusters of Gaussians" in report
    assert report.count("  - Fashion-MNIST: **") == len(CLAIMS)
    assert "Quick form" in report and "| moe |" in report
    runs = out / "runs" / "fff-activations-quick"
    assert (runs / "clusters" / "seed0" / "linear-d3" / "analysis").is_dir()   # first seed only
    assert not (runs / "clusters" / "seed1" / "linear-d3" / "analysis").exists()
