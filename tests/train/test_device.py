"""Where a run trains: --device is checked before anything is written; on the CPU nothing
changes; CUDA's RNG states join the checkpoint once CUDA is in use (the CUDA runs themselves
are checked by scripts/gpu_train_check.py on a GPU machine)."""

import pytest
import torch

from sparseffn.cli import main
from sparseffn.train import checkpoint as ckpt
from sparseffn.train.config import ConfigError, DataSpec, ModelSpec, RunConfig, TrainSpec
from sparseffn.train.trainer import Trainer, training_device

CORPUS = b"The quick brown fox jumps over the lazy dog. " * 80


def _run(path):
    return RunConfig(name="tiny", data=DataSpec(corpus="file", path=str(path)),
                     model=ModelSpec(d_model=16, n_layers=1, n_heads=2, context=8,
                                     ffn="sigma_moe"),
                     train=TrainSpec(steps=3, batch_size=2, eval_every=3, eval_windows=4))


@pytest.mark.parametrize("name,message", [("tpu", "cpu, cuda or cuda:N"),
                                          ("cuda:x", "cpu, cuda or cuda:N"),
                                          ("meta", "cpu, cuda or cuda:N")])
def test_a_device_that_is_not_one_is_named(name, message):
    with pytest.raises(ConfigError, match=message):
        training_device(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine "
                                                      "without CUDA")
def test_cuda_without_cuda_is_refused_before_any_file_is_written(tmp_path, capsys):
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(CORPUS)
    with pytest.raises(ConfigError, match="sees no CUDA device"):
        Trainer(_run(corpus), tmp_path / "run", device="cuda").train()
    assert not (tmp_path / "run").exists()
    config = tmp_path / "run.json"
    import json
    config.write_text(json.dumps(_run(corpus).to_dict()))
    assert main(["train", str(config), "--out", str(tmp_path / "cli"), "--device", "cuda"]) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()


def test_on_the_cpu_the_device_is_recorded_and_the_checkpoint_has_no_cuda_state(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_bytes(CORPUS)
    summary = Trainer(_run(corpus), tmp_path / "run", progress=False, device="cpu").train()
    assert summary["device"] == "cpu"
    state = ckpt.load(tmp_path / "run" / "checkpoint.pt")
    assert ("cuda" in state["rng"]) == torch.cuda.is_initialized()


def test_rng_state_without_cuda_entries_restores_and_unknown_devices_are_skipped():
    state = ckpt.rng_state()
    state["cuda"] = [torch.zeros(16, dtype=torch.uint8)] * 64   # more devices than here
    if torch.cuda.is_available():
        pytest.skip("the CUDA restore is checked on GPU machines")
    first = torch.rand(3)
    ckpt.set_rng_state(state)                                   # no CUDA: the entry is ignored
    torch.testing.assert_close(torch.rand(3), first)
