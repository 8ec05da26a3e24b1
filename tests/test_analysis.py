"""The expert analyses: every statistic on tiny hand-made routings against counts worked out by
hand, the recorder against the layers' own records, and `sparseffn analyze` end to end."""

import copy
import json
import math

import pytest
import torch

from sparseffn import DenseMLP, FastFeedForward, MoE, MoEConfig, SigmaMoE
from sparseffn.analysis import (RoutingRecorder, active_channels, analyze_model, co_occurrence,
                                collapse_warning, starved_fraction, summarize, token_expert_counts,
                                tree_node_decisions, usage_curve, usage_entropy, usage_health,
                                usage_shares)
from sparseffn.cli import main


def test_usage_shares_entropy_and_starved_experts_by_hand():
    mass = torch.tensor([1.0, 0.0, 3.0, 0.0])
    assert usage_shares(mass).tolist() == [0.75, 0.25, 0.0, 0.0]
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(4)
    assert usage_entropy(mass) == pytest.approx(entropy)          # 0.4056
    assert starved_fraction(mass) == 0.5                          # two of four below 0.0025
    assert starved_fraction(torch.tensor([1.0, 1.0, 1.0, 0.007])) == 0.25   # 0.007/3.007 < 0.01/4
    assert starved_fraction(torch.tensor([1.0, 1.0, 1.0, 0.008])) == 0.0    # 0.008/3.008 > 0.01/4
    assert usage_entropy(torch.ones(8)) == pytest.approx(1.0)
    assert usage_entropy(torch.tensor([0.0, 5.0, 0.0])) == pytest.approx(0.0)
    assert usage_entropy(torch.zeros(4)) == pytest.approx(1.0)    # nothing routed: no collapse
    # the curve: rank / E against share · E, first and last expert included
    assert usage_curve(mass) == [[0.0, 3.0], [0.25, 1.0], [0.5, 0.0], [0.75, 0.0]]
    assert len(usage_curve(torch.rand(1000), points=50)) == 50
    assert collapse_warning(0.9, 0.0) is None
    assert "entropy 0.41" in collapse_warning(usage_entropy(mass), starved_fraction(mass))


def test_co_occurrence_by_hand_and_dropped_slots():
    indices = torch.tensor([[0, 1], [1, 2], [0, 1], [2, 0]])
    expected = [[3, 2, 1],
                [2, 3, 1],
                [1, 1, 2]]
    assert co_occurrence(indices, 3).tolist() == expected
    dispatched = torch.tensor([[True, False], [True, True], [True, True], [True, True]])
    assert co_occurrence(indices, 3, dispatched).tolist() == [[3, 1, 1], [1, 2, 1], [1, 1, 2]]
    assert co_occurrence(torch.empty(0, 2, dtype=torch.long), 3).tolist() == [[0] * 3] * 3


def test_active_channels_and_token_tables_by_hand():
    hidden = torch.tensor([[0.0, 1.0, 2.0], [0.0, 0.0, -3.0], [0.0, 0.0, 0.0]])
    assert active_channels(hidden).tolist() == [2, 1, 0]
    tokens = torch.tensor([5, 5, 7, 2])
    indices = torch.tensor([[1, 0], [1, 2], [0, 1], [2, 1]])
    counts = token_expert_counts(tokens, indices, vocab_size=8, num_experts=3)
    assert counts.shape == (8, 3) and counts.sum() == 4
    assert counts[5].tolist() == [0, 2, 0] and counts[7].tolist() == [1, 0, 0]
    assert counts[2].tolist() == [0, 0, 1]
    dropped = torch.tensor([[True, True], [False, True], [True, True], [True, True]])
    assert token_expert_counts(tokens, indices, 8, 3, dropped)[5].tolist() == [0, 1, 0]


def test_tree_node_decisions_by_hand():
    # heap order, left (2n + 1) where z > 0; four tokens through a depth-2 tree
    z = torch.tensor([[+1.0, +1.0, 0.0],     # root left, node 1 left   -> leaf 0
                      [+1.0, -1.0, 0.0],     # root left, node 1 right  -> leaf 1
                      [-1.0, 0.0, +2.0],     # root right, node 2 left  -> leaf 2
                      [-1.0, 0.0, +2.0]])    # root right, node 2 left  -> leaf 2
    tree = tree_node_decisions(z)
    assert tree["reached"].tolist() == [4, 2, 2]
    assert tree["left"].tolist() == [0.5, 0.5, 1.0]
    assert tree["split_entropy"].tolist() == pytest.approx([1.0, 1.0, 0.0])
    h = lambda p: -(p * math.log2(p) + (1 - p) * math.log2(1 - p))          # noqa: E731
    s = lambda v: 1 / (1 + math.exp(-v))                                     # noqa: E731
    assert tree["decision_entropy"].tolist() == pytest.approx([h(s(1)), h(s(1)), h(s(2))])
    assert tree["leaves"].tolist() == [1, 1, 2, 0]
    # a node nobody reaches has no split (NaN), not an even one
    unreached = tree_node_decisions(torch.tensor([[1.0, 1.0, 1.0]]))
    assert unreached["reached"].tolist() == [1, 1, 0] and math.isnan(unreached["left"][2])
    with pytest.raises(ValueError, match="no complete tree"):
        tree_node_decisions(torch.zeros(2, 4))


def test_recorder_keeps_what_the_layers_routed():
    torch.manual_seed(0)
    model = torch.nn.Sequential(SigmaMoE(d_model=16, num_experts=6, expert_size=8, k=2),
                                DenseMLP(d_model=16, d_ff=24))
    x = [torch.randn(3, 5, 16), torch.randn(7, 16)]
    with RoutingRecorder(model) as recorder:
        for xs in x:
            model(xs)
        counts_of_last = model[0].routing_stats["counts"].clone()
    moe, dense = recorder.records["0"], recorder.records["1"]
    assert moe.kind == "routed" and moe.tokens == 22 and moe.indices.shape == (22, 2)
    last = torch.bincount(moe.indices[15:].reshape(-1), minlength=6).float()
    assert torch.equal(last, counts_of_last)
    # the same routing as the router computes, in forward order
    assert torch.equal(moe.indices[:15], model[0].router(x[0].reshape(-1, 16)).indices)
    assert torch.allclose(moe.mass.float(), model[0].usage_mass)   # the layer's own sums
    hidden = torch.relu(model[1].up(model[0](x[1])))
    assert dense.kind == "dense" and dense.d_ff == 24 and dense.tokens == 22
    assert torch.equal(dense.active[15:], (hidden != 0).sum(-1))
    # after the block: nothing observes, and a deep copy records nothing
    assert model[0]._transient.observer is None and not model[1].down._forward_pre_hooks
    with RoutingRecorder(model):
        clone = copy.deepcopy(model)
        assert clone[0]._transient.observer is None
        with pytest.raises(RuntimeError, match="already being recorded"):
            RoutingRecorder(model).__enter__()


def test_tree_layers_record_node_logits_and_summaries_agree_with_descent():
    torch.manual_seed(1)
    fff = FastFeedForward(d_model=12, depth=3, leaf_width=4).eval()
    x = torch.randn(40, 12)
    with RoutingRecorder(fff) as recorder:
        fff(x)
    record = recorder.records["<root>"]
    assert torch.allclose(record.node_logits, fff.router.node_logits(x))
    leaves = tree_node_decisions(record.node_logits)["leaves"]
    assert torch.equal(leaves, torch.bincount(fff.router.hard_leaves(x), minlength=8))
    summary = summarize(recorder.records)["<root>"]
    assert summary["tree"]["leaves"] == leaves.tolist() and summary["num_experts"] == 8


def test_analyze_model_leaves_mode_and_usage_as_they_were():
    torch.manual_seed(2)
    model = torch.nn.Sequential(SigmaMoE(d_model=16, num_experts=4, expert_size=8, k=2)).train()
    model(torch.randn(9, 16))
    before = model[0].usage_counts.clone(), model[0].usage_mass.clone()
    tokens = torch.randint(0, 5, (20,))
    layers = analyze_model(model, [torch.randn(20, 16)], tokens, vocab_size=5)
    assert model.training and torch.equal(model[0].usage_counts, before[0]) and \
        torch.equal(model[0].usage_mass, before[1])
    layer = layers["0"]
    assert layer["tokens"] == 20 and len(layer["co_occurrence"]) == 4
    assert sum(map(sum, layer["token_experts"])) == 20
    assert sum(c for expert in layer["top_tokens"] for _, c, _ in expert) <= 20
    assert json.loads(json.dumps(layers)) == layers      # JSON as it is


def test_expert_choice_is_analysed_by_the_experts_choices():
    """Expert choice (a slot per expert, a dispatched mask): the co-occurrences are the chosen
    pairs, and a token no expert chose counts for no expert."""
    torch.manual_seed(3)
    layer = MoE(MoEConfig(d_model=16, num_experts=4, expert_size=8, k=1,
                          router="expert_choice"))
    x, tokens = torch.randn(20, 16), torch.randint(0, 5, (20,))
    summary = analyze_model(torch.nn.Sequential(layer), [x], tokens, vocab_size=5)["0"]
    chosen = layer.train().router(x).dispatched
    assert torch.equal(torch.tensor(summary["co_occurrence"]), chosen.long().T @ chosen.long())
    assert sum(map(sum, summary["token_experts"])) == int(chosen.any(-1).sum()) < 20


def test_usage_health_flags_a_collapsed_layer():
    layer = SigmaMoE(d_model=8, num_experts=8, expert_size=4, k=1)
    model = torch.nn.Sequential(layer)
    assert usage_health(model) == {}                       # nothing routed yet
    layer.usage_mass.copy_(torch.tensor([100.0, 0.5, 0, 0, 0, 0, 0, 0.1]))
    entropy, starved = usage_health(model)["0"]
    assert entropy < 0.1 and starved == 0.75
    assert collapse_warning(entropy, starved).endswith("75% of experts starved")


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_bytes(b"The quick brown fox jumps over the lazy dog; pack my box. " * 80)
    return str(path)


@pytest.mark.parametrize("ffn, figures", [
    ("switch", {"usage.png", "token_experts.png"}),
    ("sigma_moe", {"usage.png", "co_occurrence.png", "token_experts.png"}),
    ("fff", {"usage.png", "tree.png", "token_experts.png"}),
    ("dense", {"active_channels.png"})])
def test_analyze_command_writes_the_report_and_training_logs_usage(corpus, tmp_path, capsys,
                                                                   ffn, figures):
    pytest.importorskip("matplotlib")
    config = tmp_path / "run.toml"
    config.write_text(f"""
name = "tiny"
[data]
corpus = "file"
path = "{corpus}"
[model]
d_model = 32
n_layers = 2
n_heads = 2
context = 16
ffn = "{ffn}"
[train]
steps = 6
batch_size = 4
eval_every = 3
log_every = 2
""")
    run = tmp_path / "run"
    assert main(["train", str(config), "--out", str(run), "--no-progress"]) == 0
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if m["kind"] == "train"]
    if ffn == "dense":
        assert all("usage_entropy" not in m for m in train)
    else:   # the collapse monitor: one number per sparse layer and log window
        assert all(set(m["usage_entropy"]) == {"blocks.0.ffn", "blocks.1.ffn"} for m in train)
        assert all(0 <= v <= 1 for m in train for v in m["starved_fraction"].values())
    capsys.readouterr()
    assert main(["analyze", str(run / "checkpoint.pt"), "--windows", "8"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("blocks.") == 2 and "report:" in printed
    out = run / "analysis"
    assert figures <= {p.name for p in out.glob("*.png")}
    result = json.loads((out / "analysis.json").read_text())
    assert result["step"] == 6 and set(result["layers"]) == {"blocks.0.ffn", "blocks.1.ffn"}
    report = (out / "analysis.md").read_text()
    assert "| blocks.1.ffn |" in report and "8 windows of 16" in report
    if ffn == "switch":
        assert "Tokens per expert in `blocks.0.ffn`" in report
