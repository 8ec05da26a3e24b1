"""``train.fp16``: float16 autocast with dynamic loss scaling. Every preset trains as in
float32; a step whose scaled gradients overflow changes no parameter and halves the scale; the
scaler's state is checkpointed, so a resumed run continues to the bit; bad combinations are
config errors."""

import math
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparseffn.train import checkpoint as ckpt
from sparseffn.train import loss_scaling
from sparseffn.train.config import ConfigError, TrainSpec
from sparseffn.train.loss_scaling import LossScaling
from sparseffn.train.parallel import Parallel
from sparseffn.train.trainer import Trainer, build_model

from .test_train import classifier_run, interrupt_at, lm_run, metrics, with_sparse_tables

PRESETS = ["dense", "sigma_moe", "softmax_moe", "sbase", "switch", "glam", "fff", "fff_sparse",
           "pkm", "peer"]


def train_losses(folder):
    return [m["loss"] for m in metrics(folder) if m["kind"] == "train"]


@pytest.mark.parametrize("ffn", PRESETS)
def test_an_fp16_run_follows_the_fp32_run(corpus, tmp_path, ffn):
    """Same batches, initialisation and dropout: float16's rounding moves the losses of six
    steps by about 1e-4 of their value (measured: at most 7e-5), and no step overflows at
    the initial scale."""
    Trainer(lm_run(corpus, ffn), tmp_path / "fp32", progress=False).train()
    summary = Trainer(lm_run(corpus, ffn, fp16=True), tmp_path / "fp16", progress=False).train()
    assert train_losses(tmp_path / "fp16") == pytest.approx(train_losses(tmp_path / "fp32"),
                                                            rel=1e-3)
    assert train_losses(tmp_path / "fp16") != train_losses(tmp_path / "fp32")   # it ran in fp16
    assert summary["skipped_steps"] == 0 and math.isfinite(summary["val"]["loss"])
    records = [m for m in metrics(tmp_path / "fp16") if m["kind"] == "train"]
    assert all(m["loss_scale"] == loss_scaling.INITIAL_LOSS_SCALE and m["skipped_steps"] == 0
               for m in records)
    assert "loss_scale" not in metrics(tmp_path / "fp32")[0]


def test_sparse_gradients_and_a_classifier_train_in_fp16(corpus, tmp_path):
    """SparseAdam's sparse gradients are unscaled too (PKM with ``sparse_grad``), and the
    classifier's loop is the LM's."""
    run = with_sparse_tables(lm_run(corpus, "pkm", fp16=True))
    trainer = Trainer(run, tmp_path / "pkm", progress=False)
    summary = trainer.train()
    assert [type(opt).__name__ for opt in trainer.optimizers] == ["Adam", "SparseAdam"]
    assert summary["skipped_steps"] == 0
    assert any(float(s["step"]) == 6 for s in trainer.optimizers[1].state.values())
    plain = lm_run(corpus, "pkm").replace(model=run.model)
    Trainer(plain, tmp_path / "fp32", progress=False).train()
    assert train_losses(tmp_path / "pkm") == pytest.approx(train_losses(tmp_path / "fp32"),
                                                           rel=1e-3)
    layer = {"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3, "dropout": 0.2}
    summary = Trainer(classifier_run(layer, steps=10, fp16=True), tmp_path / "classifier",
                      progress=False).train()
    assert summary["skipped_steps"] == 0 and 0.0 <= summary["test"]["accuracy"] <= 1.0


def test_a_step_whose_scaled_gradients_overflow_changes_nothing_and_halves_the_scale(
        corpus, tmp_path, monkeypatch):
    monkeypatch.setattr(loss_scaling, "INITIAL_LOSS_SCALE", 2.0 ** 60)
    run = lm_run(corpus, "sigma_moe", steps=4, fp16=True)
    trainer = Trainer(run, tmp_path, progress=False)
    summary = trainer.train()
    assert summary["skipped_steps"] == 4
    records = [m for m in metrics(tmp_path) if m["kind"] == "train"]
    assert [m["loss_scale"] for m in records] == [2.0 ** 59, 2.0 ** 58, 2.0 ** 57, 2.0 ** 56]
    assert [m["skipped_steps"] for m in records] == [1, 1, 1, 1]
    torch.manual_seed(run.seed)                      # the initial model, as the run built it
    initial = build_model(run, trainer.data).state_dict()
    assert all(torch.equal(initial[name], value)
               for name, value in trainer.model.state_dict().items())
    adam = trainer.optimizers[0].state.values()      # no moment moved, no step counted
    assert all(float(s["step"]) == 0 and not s["exp_avg"].any() for s in adam)


def test_after_overflows_the_scale_falls_until_steps_are_taken(corpus, tmp_path, monkeypatch):
    """From 2^24 the first steps overflow in float16 (six at this size); once the halved
    scale fits, the run trains."""
    monkeypatch.setattr(loss_scaling, "INITIAL_LOSS_SCALE", 2.0 ** 24)
    summary = Trainer(lm_run(corpus, "sigma_moe", steps=10, fp16=True), tmp_path,
                      progress=False).train()
    skipped = [m["skipped_steps"] for m in metrics(tmp_path) if m["kind"] == "train"]
    first_taken = skipped.index(0)
    assert 0 < first_taken < 10 and not any(skipped[first_taken:])
    assert summary["skipped_steps"] == first_taken


def test_resume_restores_the_loss_scale_and_continues_to_the_bit(corpus, tmp_path,
                                                                  monkeypatch):
    """Interrupted while the scale is still falling: a resumed run that started again from
    the initial scale would skip steps the straight run takes."""
    monkeypatch.setattr(loss_scaling, "INITIAL_LOSS_SCALE", 2.0 ** 24)
    run = lm_run(corpus, "sigma_moe", steps=9, fp16=True)
    straight = Trainer(run, tmp_path / "straight", progress=False).train()
    stopped = Trainer(run, tmp_path / "resumed", progress=False)
    interrupt_at(stopped, 5)
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    state = ckpt.load(tmp_path / "resumed" / "checkpoint.pt")["loss_scaling"]
    assert state["scaler"]["scale"] == 2.0 ** 19 and state["skipped"] == 5
    resumed = Trainer(run, tmp_path / "resumed", progress=False).train(resume=True)
    assert metrics(tmp_path / "resumed") == [
        {**m, "train_time": r["train_time"], "items_per_s": r["items_per_s"]}
        if m["kind"] == "train" else {**m, "train_time": r["train_time"]}
        for m, r in zip(metrics(tmp_path / "straight"), metrics(tmp_path / "resumed"))]
    assert resumed["skipped_steps"] == straight["skipped_steps"] == 6
    a = ckpt.load(tmp_path / "straight" / "checkpoint.pt")
    b = ckpt.load(tmp_path / "resumed" / "checkpoint.pt")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert a["loss_scaling"] == b["loss_scaling"]


def test_a_run_without_fp16_keeps_no_loss_scale_and_fp16_on_the_cpu_says_it_is_slow(
        corpus, tmp_path, capsys):
    Trainer(lm_run(corpus, "dense", steps=2), tmp_path / "fp32", progress=False).train()
    assert "loss_scaling" not in ckpt.load(tmp_path / "fp32" / "checkpoint.pt")
    assert "fp16" not in capsys.readouterr().err
    Trainer(lm_run(corpus, "dense", steps=2, fp16=True), tmp_path / "fp16",
            progress=False).train()
    assert "train.fp16 on the CPU checks a run but is slow" in capsys.readouterr().err


@pytest.mark.parametrize("fields, message", [
    ({"fp16": True, "bf16": True}, "pick one autocast dtype"),
    ({"fp16": 1}, "true or false"),
])
def test_fp16_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainSpec(**fields)


def _overflow_on_rank_0(rank, world, init_file, out_dir):
    """Each rank scales, unscales and steps its own parameter (as a rank does with its own
    experts); only rank 0's gradient overflows. With and without agreeing over the ranks."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    parallel = Parallel(rank, world, expert_parallel=True)
    for agree in (True, False):
        param = torch.nn.Parameter(torch.ones(3))
        optimizer = torch.optim.Adam([param], lr=0.1)
        scaling = LossScaling(torch.device("cpu"), agree=parallel.max_ if agree else None)
        scaling.backward((param * (math.inf if rank == 0 else 1.0)).sum())
        scaling.unscale([optimizer])
        scaling.step([optimizer])
        scaling.settle()
        torch.save({"param": param.detach(), "scale": scaling.scale,
                    "skipped": scaling.skipped}, f"{out_dir}/rank{rank}-{agree}.pt")
    dist.barrier()
    os._exit(0)      # see tests/layers/test_distributed_usage.py


def test_with_sharded_experts_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """Ranks that agree skip together and halve the same scale; alone, the rank whose
    gradients were finite would update and keep its scale (the replicas would split)."""
    mp.spawn(_overflow_on_rank_0, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    got = {(rank, agree): torch.load(tmp_path / f"rank{rank}-{agree}.pt")
           for rank in range(2) for agree in (True, False)}
    start = loss_scaling.INITIAL_LOSS_SCALE
    for rank in range(2):
        assert torch.equal(got[rank, True]["param"], torch.ones(3))
        assert (got[rank, True]["scale"], got[rank, True]["skipped"]) == (start / 2, 1)
    assert torch.equal(got[0, False]["param"], torch.ones(3))       # the control
    assert not torch.equal(got[1, False]["param"], torch.ones(3))
    assert (got[1, False]["scale"], got[1, False]["skipped"]) == (start, 0)
