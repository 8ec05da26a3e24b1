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


@pytest.mark.unpoisoned   # counts every operator, the fills of fresh memory would be too
def test_moved_bytes_are_what_computing_operators_read_and_write():
    x = torch.randn(4, 8)                             # 128 bytes
    with OpCounter() as counter:
        y = torch.relu(x)                              # reads 128, writes 128
        y.view(32)                                     # a view: nothing moved
        torch.empty(1000)                              # an allocation: nothing moved
        out = torch.empty(4, 8, dtype=torch.float64)
        torch.add(x, y, out=out)                       # reads 2 × 128, writes 256 (not read)
        y.add_(x[:1].expand(4, 8))                     # reads 128 + the 32 behind the broadcast
    assert counter.counts.moved_bytes == 256 + 512 + (128 + 32 + 128)


def test_the_single_input_cast_moves_fewer_bytes_than_two_casts(monkeypatch):
    """Under bf16 autocast a σ-MoE with an autocast router casts x once and widens the summed
    input gradient in one operator: less traffic than casting for each reader."""
    layer = build_layer(MoEConfig(d_model=64, num_experts=4, expert_size=16, k=2,
                                  router=SigmaRouterConfig(precision="autocast"))).train()
    x = torch.randn(256, 64)
    once = count_ops(forward_backward_fn(layer, x, autocast_dtype=torch.bfloat16))
    monkeypatch.setattr(type(layer), "_cast_once", lambda self, x: (x, x))
    twice = count_ops(forward_backward_fn(layer, x, autocast_dtype=torch.bfloat16))
    x_f32 = 256 * 64 * 4
    # no second cast (read 4, write 2 bytes an element) and, backward, no second widening
    # (read 2, write 4) and no float32 sum (read 8, write 4)
    assert twice.moved_bytes - once.moved_bytes >= 2 * x_f32
    assert twice.compute > once.compute
