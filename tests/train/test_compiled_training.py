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


def test_a_compiled_run_trains_as_the_eager_one(corpus, tmp_path):
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


def test_a_compiled_run_with_dropout_resumes_to_the_bit(corpus, tmp_path):
    run = lm_run(corpus, "sigma_moe", steps=6, compile=True)     # dropout 0.1
    assert straight_and_resumed(run, tmp_path, 4)
    assert _losses(tmp_path / "resumed") == _losses(tmp_path / "straight")   # exact floats


def test_compile_with_expert_parallel_is_a_config_error():
    with pytest.raises(ConfigError, match="train.compile is not supported with "
                                          "train.expert_parallel"):
        TrainSpec(compile=True, expert_parallel=True)
