"""``train.compile``: the training step's forward and loss under torch.compile."""

import dataclasses

import pytest
import torch
from torch._dynamo.utils import counters

from sparseffn.train import checkpoint as ckpt
from sparseffn.train.config import ConfigError, TrainSpec
from sparseffn.train.trainer import Trainer

from tests.train.test_train import lm_run, metrics, straight_and_resumed


def _losses(folder):
    return [(m["kind"], m["step"], m["loss"]) for m in metrics(folder)]


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _without_dropout(run):
    # compiled dropout draws its masks with Inductor's own generator, not eager's
    return run.replace(model=dataclasses.replace(run.model, dropout=0.0))


def test_a_compiled_run_trains_as_the_eager_one_and_reduce_overhead_as_it_on_the_cpu(
        corpus, tmp_path):
    """Compiled, the run is the eager run up to rounding; ``"reduce-overhead"`` on a CPU,
    where Inductor makes no CUDA graphs, is the same compiled step, to the bit. (One test:
    the compiled run is the reference of both, and Inductor takes a minute per compile.)"""
    eager = _without_dropout(lm_run(corpus, "sigma_moe", steps=6))
    compiled = _without_dropout(lm_run(corpus, "sigma_moe", steps=6, compile=True))
    Trainer(eager, tmp_path / "eager", progress=False).train()
    counters.clear()
    Trainer(compiled, tmp_path / "compiled", progress=False).train()
    assert counters["stats"]["unique_graphs"] >= 1           # it did compile
    # the same run up to rounding (Inductor fuses and reorders float sums)
    for (kind, step, a), (kind_c, step_c, b) in zip(_losses(tmp_path / "eager"),
                                                    _losses(tmp_path / "compiled"), strict=True):
        assert (kind, step) == (kind_c, step_c) and b == pytest.approx(a, rel=1e-4)
    # checkpoints hold the model's own parameter names, not the compiled wrapper's
    assert (ckpt.load(tmp_path / "compiled" / "checkpoint.pt")["model"].keys()
            == ckpt.load(tmp_path / "eager" / "checkpoint.pt")["model"].keys())

    torch._dynamo.reset()
    graphed = compiled.replace(train=dataclasses.replace(compiled.train,
                                                         compile="reduce-overhead"))
    Trainer(graphed, tmp_path / "graphs", progress=False).train()
    assert _losses(tmp_path / "graphs") == _losses(tmp_path / "compiled")


def test_a_compiled_run_with_dropout_resumes_to_the_bit(corpus, tmp_path):
    run = lm_run(corpus, "sigma_moe", steps=6, compile=True)     # dropout 0.1
    assert straight_and_resumed(run, tmp_path, 4)
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")   # exact floats


def test_compile_takes_true_false_or_reduce_overhead():
    assert TrainSpec(compile=True).compile_mode == "default"
    assert TrainSpec(compile="reduce-overhead").compile_mode == "reduce-overhead"
    assert TrainSpec().compile_mode is None
    for bad in ["max-autotune", "true", 1, None]:
        with pytest.raises(ConfigError, match='train.compile must be true, false or '
                                              '"reduce-overhead"'):
            TrainSpec(compile=bad)
    with pytest.raises(ConfigError, match="not supported with train.expert_parallel.*"
                                          "use train.compile = true"):
        TrainSpec(compile="reduce-overhead", expert_parallel=True)


class _GraphOutputs:
    """torch.compile as CUDA graphs treat their outputs, on the CPU: the function runs
    eagerly, and each new graph step (cudagraph_mark_step_begin) writes NaN over every output
    of the steps before, as a replay writes over the memory a graph's outputs live in."""

    def __init__(self):
        self.outputs, self.steps, self.modes = [], 0, []

    def compile(self, fn, mode=None, **options):
        self.modes.append(mode)
        def replayed(*args):
            out = fn(*args)
            self.outputs.append(out)
            return out
        return replayed

    def mark_step_begin(self):
        self.steps += 1
        with torch.no_grad():
            for out in self.outputs:
                out.fill_(float("nan"))
        self.outputs.clear()


@pytest.mark.parametrize("micro_batches", [1, 2])
def test_under_cuda_graphs_the_step_keeps_no_output_a_replay_overwrites(
        corpus, tmp_path, monkeypatch, micro_batches):
    """With the losses read at the boundaries only (as on a GPU), the loss of every step
    waits in StepLosses while later steps replay the graph: it must be a copy, or the run
    logs (here: stops on) the next replays' values. One graph step per micro-batch."""
    graphs = _GraphOutputs()
    monkeypatch.setattr(torch, "compile", graphs.compile)
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", graphs.mark_step_begin)
    run = lm_run(corpus, "sigma_moe", steps=6, micro_batches=micro_batches)
    run = run.replace(train=dataclasses.replace(run.train, log_every=3))  # 3 steps pending
    Trainer(run, tmp_path / "eager", progress=False, read_every_step=False).train()
    graphed = run.replace(train=dataclasses.replace(run.train, compile="reduce-overhead"))
    Trainer(graphed, tmp_path / "graphs", progress=False, read_every_step=False).train()
    assert graphs.modes == ["reduce-overhead"] and graphs.steps == 6 * micro_batches
    assert _losses(tmp_path / "graphs") == _losses(tmp_path / "eager")
