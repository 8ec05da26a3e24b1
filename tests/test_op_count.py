"""The operator counts of ``sparseffn bench compile`` (bench/op_count.py)."""

import json

import pytest
import torch

from sparseffn import MoEConfig, SigmaRouterConfig, build_layer, cli
from sparseffn.bench.measure import forward_backward_fn
from sparseffn.bench.op_count import OpCounter, count_ops


def test_a_matmul_step_counts_its_forward_and_backward_products_and_not_its_views():
    a = torch.randn(3, 5, requires_grad=True)
    b = torch.randn(5, 7, requires_grad=True)

    def step():
        a.grad = b.grad = None
        (a @ b).sum().backward()
    counts = count_ops(step)
    assert counts.by_name["aten.mm"] == 3          # the product and its two gradients
    assert counts.computing["aten.mm"] == 3
    assert counts.by_name["aten.t"] >= 2 and "aten.t" not in counts.computing
    assert counts.total > counts.compute == sum(counts.computing.values())


def test_counting_leaves_the_result_unchanged_and_counts_nothing_outside():
    x = torch.randn(4, 4)
    with OpCounter() as counter:
        y = torch.relu(x).view(16).sum()
    torch.exp(x)                                    # after the block: not counted
    assert y == torch.relu(x).sum()
    assert dict(counter.counts.by_name) == {"aten.relu": 1, "aten.view": 1, "aten.sum": 1}
    assert counter.counts.compute == 2


def test_a_sparseffn_operator_counts_as_one_op():
    torch.manual_seed(0)
    layer = build_layer(MoEConfig(d_model=16, num_experts=4, expert_size=8, k=2,
                                  router=SigmaRouterConfig())).train()
    counts = count_ops(forward_backward_fn(layer, torch.randn(9, 16)))
    # two products forward, two input-side products and two weight gradients backward
    assert counts.by_name["sparseffn.cvmm_rows"] == 4
    assert counts.by_name["sparseffn.expert_weight_grad"] == 2


def test_bench_compile_reports_the_ops_of_an_eager_step(tmp_path, capsys):
    path = tmp_path / "compile.json"
    assert cli.main(["bench", "compile", "--layers", "dense", "sigma_moe", "--tokens", "32",
                     "--d-model", "32", "--repeats", "1", "--json", str(path)]) == 0
    dense, sigma = json.loads(path.read_text())
    assert (dense["layer"], sigma["layer"]) == ("dense", "sigma_moe")
    for record in (dense, sigma):
        assert record["eager_ops"] > record["eager_compute_ops"] > 0
    assert sigma["eager_compute_ops"] > dense["eager_compute_ops"]
    assert "ops compute" in capsys.readouterr().out


def test_bench_compile_rejects_an_unknown_layer(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["bench", "compile", "--layers", "dense", "nope"])
    assert exit_.value.code == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
