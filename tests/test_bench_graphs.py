"""Timing from CUDA graphs (``bench routers --graphs``): the device's time per call without the
host's launch cost. The capture itself needs a GPU (``scripts/gpu_session.sh tests`` runs these
there); on the CPU the option's errors and the table's labelling are checked."""

import json

import pytest
import torch

from sparseffn import cli
from sparseffn.bench import measure
from sparseffn.bench.tree_routers import METHODS, bench_tree_routers, format_table

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA graphs need a CUDA device")


def test_graphs_need_a_cuda_device(tmp_path, capsys):
    path = tmp_path / "routers.json"
    assert cli.main(["bench", "routers", "--graphs", "--depths", "1", "--batch", "4",
                     "--dim", "8", "--json", str(path)]) == 2
    assert "--graphs" in capsys.readouterr().err
    assert not path.exists()
    with pytest.raises(ValueError, match="CUDA device"):
        bench_tree_routers([1], batch=4, dim=8, device="cpu", graphs=True)


def test_table_says_when_its_times_come_from_cuda_graphs():
    records = [{"method": m, "depth": 1, "pass": "forward", "ms": 1.0, "device": "cuda:0",
                "timing": "cuda_graph"} for m in METHODS]
    assert "replayed from CUDA graphs" in format_table(records)
    for r in records:
        r["timing"] = "eager"
    assert "CUDA graphs" not in format_table(records)


@needs_cuda
def test_a_replay_runs_every_captured_call_and_nothing_at_capture():
    counter = torch.zeros((), device="cuda")
    replay = measure.capture_calls(lambda: counter.add_(1), calls=5)
    torch.cuda.synchronize()
    assert counter.item() == 3          # the three warm-up calls; the capture ran nothing
    replay()
    replay()
    torch.cuda.synchronize()
    assert counter.item() == 3 + 2 * 5


@needs_cuda
def test_a_call_that_reads_the_host_is_reported_and_left_out():
    x = torch.ones(4, device="cuda")
    fns = {"device": lambda: x * 2, "host": lambda: x.sum().item()}
    times, failures = measure.graph_call_times(fns, rounds=2, calls={"device": 3, "host": 3},
                                               device="cuda")
    assert set(times) == {"device"} and len(times["device"]) == 2
    assert all(ms > 0 for ms in times["device"])
    assert set(failures) == {"host"} and failures["host"]


@needs_cuda
def test_bench_routers_with_graphs_times_every_method(tmp_path):
    path = tmp_path / "routers.json"
    assert cli.main(["bench", "routers", "--device", "cuda", "--graphs", "--depths", "1-2",
                     "--batch", "64", "--dim", "32", "--repeats", "2",
                     "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert {r["method"] for r in records} == set(METHODS)
    assert all(r["timing"] == "cuda_graph" and 1 <= r["calls"] and r["ms"] > 0
               for r in records)
