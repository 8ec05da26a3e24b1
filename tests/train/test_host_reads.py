"""When the training loop reads the device (:mod:`sparseffn.train.step_losses`).

On a GPU the loop keeps each step's loss on the device and reads the losses where it logs,
evaluates, saves or stops, so that no step waits for the device; on the CPU it reads each
loss at once, so that a non-finite loss stops the run before the update. Both are run here on
the CPU (``read_every_step``): they log the same numbers and train the same weights, the
deferred loop reads nothing on the host inside a step, and a non-finite loss is named with
its step either way, with nothing written after it.
"""

import sys

import pytest
import torch

from sparseffn.models.lm import TransformerLM
from sparseffn.train import checkpoint as ckpt
from sparseffn.train import loss_scaling
from sparseffn.train.config import TrainSpec
from sparseffn.train.parallel import Parallel
from sparseffn.train.trainer import Trainer

from .test_train import metrics, same_weights, without_timing

_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


def _run(corpus, ffn="sigma_moe", steps=9, **train):
    """Boundaries that split the log windows: logs every 4 steps, evaluations every 3,
    checkpoints every 5."""
    from .test_train import lm_run
    run = lm_run(corpus, ffn, steps=steps)
    fields = {**run.train.__dict__, "log_every": 4, "eval_every": 3, "checkpoint_every": 5,
              **train}
    return run.replace(train=TrainSpec(**fields))


@pytest.mark.parametrize("ffn, fields", [("dense", {}), ("sigma_moe", {}), ("pkm", {}),
                                         ("switch", {"clip": 0.5}), ("sigma_moe", {"fp16": True})])
def test_reading_at_the_boundaries_logs_and_trains_what_reading_every_step_does(
        corpus, tmp_path, monkeypatch, ffn, fields):
    """Same losses, auxiliary losses, learning rates, loss scales and skipped steps in every
    record, same evaluations, same weights (the fp16 run starts at 2^24, so that steps are
    skipped inside the windows)."""
    monkeypatch.setattr(loss_scaling, "INITIAL_LOSS_SCALE", 2.0 ** 24)
    run = _run(corpus, ffn, **fields)
    summaries = {each: Trainer(run, tmp_path / str(each), progress=False,
                               read_every_step=each).train() for each in (True, False)}
    every, deferred = metrics(tmp_path / "True"), metrics(tmp_path / "False")
    assert without_timing(deferred) == without_timing(every)
    assert [m["step"] for m in every if m["kind"] == "train"] == [4, 8, 9]
    if run.train.fp16:
        assert sum(m["skipped_steps"] for m in every if m["kind"] == "train") > 1
        assert summaries[True]["skipped_steps"] == summaries[False]["skipped_steps"]
    assert same_weights(tmp_path / "True", tmp_path / "False")
    assert summaries[True]["val"] == summaries[False]["val"]
    assert all(m["train_time"] > 0 and m["items_per_s"] > 0 for m in deferred
               if m["kind"] == "train")


class _TrainerReads:
    """Every host read (``.item()``, ``.tolist()``, ``float()``, ``int()``, ``bool()``,
    ``__index__``) whose nearest sparseffn caller is in one of ``packages`` (by default the
    training package's code), as (inside a step, the steps done, where)."""

    def __init__(self, monkeypatch, packages=("train/",)):
        self.found, self.packages = [], packages
        self.trainer, self.in_step = None, False
        for name in _READS:
            monkeypatch.setattr(torch.Tensor, name, self._recording(getattr(torch.Tensor, name)))
        step = Trainer._step

        def recorded_step(trainer, index):
            self.trainer, self.in_step = trainer, True
            try:
                return step(trainer, index)
            finally:
                self.in_step = False
        monkeypatch.setattr(Trainer, "_step", recorded_step)

    def _recording(self, read):
        def recorded(tensor, *args, **kwargs):
            where = _sparseffn_caller()
            if where is not None and where.startswith(self.packages):
                done = self.trainer.step if self.trainer else 0
                self.found.append((self.in_step, done, where))
            return read(tensor, *args, **kwargs)
        return recorded


def _sparseffn_caller() -> str | None:
    """``module path:function`` of the nearest sparseffn frame on the stack (past
    ``step_losses.host_values``, which reads for its caller)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/sparseffn/" in name and frame.f_code.co_name != "host_values":
            return f"{name.split('/sparseffn/')[-1]}:{frame.f_code.co_name}"
        frame = frame.f_back
    return None


@pytest.mark.parametrize("fields", [{}, {"fp16": True, "clip": 1.0}])
def test_the_deferred_loop_reads_nothing_inside_a_step(corpus, tmp_path, monkeypatch, fields):
    """The loop's own host reads happen at the boundaries only: a step (forward, backward,
    loss scaling, clipping, the update) reads nothing. Reading every step, it reads once per
    step (the recorder sees that read, so it would see one in the deferred loop)."""
    reads = _TrainerReads(monkeypatch)
    run = _run(corpus, **fields)
    Trainer(run, tmp_path / "deferred", progress=False, read_every_step=False).train()
    assert [r for r in reads.found if r[0]] == []
    boundaries = {3, 4, 5, 6, 8, 9}   # evaluations, logs, checkpoints, the last step
    assert {done for _, done, _ in reads.found} <= boundaries
    assert {done for _, done, where in reads.found
            if where == "train/step_losses.py:read"} == boundaries
    reads.found.clear()
    Trainer(run, tmp_path / "every", progress=False, read_every_step=True).train()
    inside = [(done, where) for in_step, done, where in reads.found if in_step]
    assert inside == [(step, "train/step_losses.py:read") for step in range(9)]


def _loss_turns_nan_at(monkeypatch, call: int, then_fails: bool = False) -> list:
    """The LM's training loss is NaN at its ``call``-th computation (1-based), so that the
    update of that step turns the weights NaN; with ``then_fails`` the next computation
    raises a ValueError (as a check that refuses NaN would). Returns the list that grows by
    one item per computation."""
    original, calls = TransformerLM.loss, []

    def loss(self, *args, **kwargs):
        calls.append(1)
        if then_fails and len(calls) == call + 1:
            raise ValueError("a check refused the NaN weights")
        value = original(self, *args, **kwargs)
        return value * float("nan") if len(calls) == call else value
    monkeypatch.setattr(TransformerLM, "loss", loss)
    return calls


def test_reading_every_step_a_non_finite_loss_stops_the_run_before_the_update(
        corpus, tmp_path, monkeypatch):
    _loss_turns_nan_at(monkeypatch, 7)
    trainer = Trainer(_run(corpus, "sigma_moe"), tmp_path, progress=False)
    with pytest.raises(FloatingPointError,
                       match=r"loss is nan at step 7; stopped before updating the parameters "
                             r"\(the last checkpoint in .* stands\)"):
        trainer.train()
    saved = ckpt.load(tmp_path / "checkpoint.pt")
    assert saved["step"] == 5
    weights = trainer.model.state_dict()
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert [m["step"] for m in metrics(tmp_path)][-1] == 6


@pytest.mark.parametrize("then_fails", [False, True])
def test_read_at_the_boundaries_a_non_finite_loss_is_named_and_nothing_is_written_after_it(
        corpus, tmp_path, monkeypatch, then_fails):
    """Step 7's loss is NaN and its update turns the weights NaN. The run goes on to the next
    boundary (the log at step 8), which names step 7 and writes nothing. If a step fails
    before that boundary (a check refusing NaN weights), the error raised is still the NaN
    loss of step 7, caused by that failure. That failure happens on one rank only, so its
    losses are read without averaging them with the other ranks' (a collective there would
    wait for ranks that are not coming)."""
    calls = _loss_turns_nan_at(monkeypatch, 7, then_fails)
    mean = Parallel.mean

    def mean_not_after_a_failure(parallel, values):
        assert not (then_fails and len(calls) > 7), "a collective after a rank's step failed"
        return mean(parallel, values)
    monkeypatch.setattr(Parallel, "mean", mean_not_after_a_failure)
    with pytest.raises(FloatingPointError,
                       match=r"loss is nan at step 7; found after that step's update .*nothing "
                             r"was written since \(the last checkpoint in .* stands\)") as raised:
        Trainer(_run(corpus, "sigma_moe"), tmp_path, progress=False,
                read_every_step=False).train()
    if then_fails:
        assert isinstance(raised.value.__cause__, ValueError)
        assert "refused the NaN weights" in str(raised.value.__cause__)
    else:
        assert raised.value.__cause__ is None
    assert ckpt.load(tmp_path / "checkpoint.pt")["step"] == 5
    assert [m["step"] for m in metrics(tmp_path)][-1] == 6


@pytest.mark.parametrize("read_every_step", [True, False], ids=["every_step", "boundaries"])
def test_a_step_failing_after_a_non_finite_micro_batch_names_that_micro_batch(
        corpus, tmp_path, monkeypatch, read_every_step):
    """Step 7 in two micro-batches: the first one's loss is NaN and the second fails (a check
    refusing what the NaN caused). Either way of reading, the error raised is the NaN loss,
    named with its step and micro-batch and caused by that failure, before any update."""
    _loss_turns_nan_at(monkeypatch, 13, then_fails=True)     # step 7's two micro-batches
    run = _run(corpus, "sigma_moe", micro_batches=2)
    trainer = Trainer(run, tmp_path, progress=False, read_every_step=read_every_step)
    with pytest.raises(FloatingPointError,
                       match=r"loss is nan at step 7 \(micro-batch 1 of 2\); stopped before "
                             r"updating the parameters \(the last checkpoint in .* stands\)"
                       ) as raised:
        trainer.train()
    assert isinstance(raised.value.__cause__, ValueError)
    assert "refused the NaN weights" in str(raised.value.__cause__)
    assert ckpt.load(tmp_path / "checkpoint.pt")["step"] == 5
    assert all(torch.isfinite(w).all() for w in trainer.model.state_dict().values())


@pytest.mark.parametrize("how", ["first Ctrl-C", "KeyboardInterrupt"])
def test_a_non_finite_loss_before_a_stop_is_named_and_no_checkpoint_is_written(
        corpus, tmp_path, monkeypatch, how):
    """A stop writes a checkpoint: at the end of the step after the first Ctrl-C, or where a
    KeyboardInterrupt arrives between steps. A pending NaN loss is found first, and nothing
    is written (no boundary came before: the first log, evaluation and checkpoint are at
    step 9)."""
    _loss_turns_nan_at(monkeypatch, 2)
    run = _run(corpus, "dense", log_every=9, eval_every=9, checkpoint_every=9)
    trainer = Trainer(run, tmp_path, progress=False, read_every_step=False)
    original = trainer._batch

    def batch(step):
        if step == 3:
            if how == "KeyboardInterrupt":
                raise KeyboardInterrupt
            trainer._stop_requested = True
        return original(step)
    trainer._batch = batch
    with pytest.raises(FloatingPointError, match="loss is nan at step 2; found after .*no "
                                                 "checkpoint was written"):
        trainer.train()
    assert not (tmp_path / "checkpoint.pt").exists()
    assert trainer.step == 4 if how == "first Ctrl-C" else trainer.step == 3


def test_fp16_names_float16s_range_with_a_non_finite_loss(corpus, tmp_path, monkeypatch):
    _loss_turns_nan_at(monkeypatch, 1)
    with pytest.raises(FloatingPointError, match="float16 overflows above 65504"):
        Trainer(_run(corpus, "dense", fp16=True), tmp_path, progress=False).train()
