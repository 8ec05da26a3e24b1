"""Training and evaluation of a run: an LM on a corpus or a classifier on a dataset.

Deterministic under a seed: parameters are initialised after ``torch.manual_seed(seed)``, the
batch of step s is a function of ``(seed, s)``, dropout and routing noise draw from the torch
RNG, whose state is checkpointed, and with ``train.deterministic`` (the default) PyTorch and
our kernels pick only run-to-run reproducible algorithms. A run resumed from a checkpoint
therefore continues with exactly the losses the uninterrupted run has (tested to the bit).

Files in the run folder:
- ``config.json``: the run config; ``checkpoint.pt``: the latest checkpoint (atomic), which
  also keeps the model config it was trained with (:mod:`sparseffn.train.model_config`), so
  that a newer sparseffn whose defaults changed resumes the same network;
- ``metrics.jsonl``: one JSON object per line, ``{"kind": "train"|"eval", "step", ...}``;
- ``summary.json``: parameters, costs, final validation metrics, throughput, memory;
- ``.lock``: held while a process trains here (a second one is refused, not interleaved).

Under ``torchrun --nproc-per-node N`` the run is data-parallel over the N processes, and with
``train.expert_parallel`` expert-parallel too (:mod:`sparseffn.train.parallel`); rank 0
writes the files.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import operator
import os
import resource
import shutil
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..analysis.summary import collapse_warning, usage_health
from ..auxiliary import aux_loss, all_reduce_usage, no_usage_statistics, reset_usage
from ..distributed import exchange_drops
from ..optim import adam_optimizers
from ..runtime import (compiled, compiling_checkpointed_sparse_layers, compiling_many,
                       deterministic_algorithms)
from ..data import ArrayData, TextData, bits_per_byte, load_arrays
from ..models.classifier import ClassifierConfig, SparseClassifier
from ..models.lm import LMConfig, TransformerLM
from . import checkpoint as ckpt
from .config import (ConfigError, RunConfig, TrainSpec, _check, run_config_from_dict,
                     total_steps)
from .model_config import checkpoint_model_config, run_model_config, saved_model_config
from .lock import folder_lock
from .loss_scaling import LossScaling
from .parallel import Parallel
from .progress import ProgressBar
from .schedule import lr_factor
from .step_losses import StepLosses, host_values, reads_every_step, synchronize

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
CONFIG = "config.json"
PREVIOUS = "previous"    # where a fresh run moves the files of the run it replaces


def load_data(run: RunConfig, tokenizer_state: dict | None = None) -> TextData | ArrayData:
    d = run.data
    if d.is_text:
        return TextData.load(d.corpus, d.path, d.tokenizer, d.vocab_size, tokenizer_state, d.fetch)
    return load_arrays(d.dataset, d.path, fetch=d.fetch, **d.options)


def build_model(run: RunConfig, data: TextData | ArrayData,
                checkpoint: dict | None = None) -> nn.Module:
    """The model of ``run`` for ``data``, initialised from the torch RNG; given a
    ``checkpoint``'s state, the model config it was trained with
    (:func:`~sparseffn.train.model_config.checkpoint_model_config`)."""
    config = run_model_config(run, data)
    if checkpoint is not None:
        config = checkpoint_model_config(checkpoint.get("model_config"), config)
    return TransformerLM(config) if isinstance(config, LMConfig) else SparseClassifier(config)


def load_trained(path: str | Path, state: dict | None = None
                 ) -> tuple[dict, RunConfig, TextData | ArrayData, nn.Module]:
    """The checkpoint at ``path`` as (its state, its run config, the run's data with the
    checkpoint's tokenizer, the model it was trained with, holding its weights); ``state``:
    the checkpoint already loaded from ``path``, not read again."""
    state = ckpt.load(path) if state is None else state
    run = run_config_from_dict(state["config"])
    data = load_data(run, state.get("tokenizer"))
    model = build_model(run, data, state)
    model.load_state_dict(state["model"])
    return state, run, data, model


def load_network(path: str | Path, state: dict | None = None) -> tuple[dict, torch.nn.Module]:
    """(the checkpoint's state, its network in eval mode on the CPU holding its weights),
    built from the model config the checkpoint keeps; from its run config and corpus, as
    ``sparseffn eval`` does, for a checkpoint without one or with one this version cannot
    build. ``state``: the checkpoint already loaded from ``path``."""
    state = ckpt.load(path) if state is None else state
    saved = state.get("model_config")
    try:
        config = saved_model_config(saved) if saved is not None else None
    except (TypeError, ValueError):      # a field this version renamed or dropped
        config = None
    if config is not None:
        model = (SparseClassifier(config) if isinstance(config, ClassifierConfig)
                 else TransformerLM(config))
        model.load_state_dict(state["model"])
    else:    # an older checkpoint, or a config this version cannot build: as eval does, from
        state, _, _, model = load_trained(path, state)   # its run config and corpus
    return state, model.eval()


def peak_rss_bytes() -> int:
    """This process's peak resident memory (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class Evaluation:
    loss: float          # mean nats per token (LM) or per example
    bpc: float | None    # bits per byte of text (LM)
    accuracy: float | None
    items: int

    def as_dict(self) -> dict:
        out = {"loss": self.loss, "items": self.items}
        if self.bpc is not None:
            out["bpc"] = self.bpc
        if self.accuracy is not None:
            out["accuracy"] = self.accuracy
        return out


@torch.no_grad()
def evaluate(model: nn.Module, data: TextData | ArrayData, run: RunConfig, split: str = "val",
             max_windows: int | None = None, batch_size: int = 64) -> Evaluation:
    """Validation (or test) loss, with bits per byte for text and accuracy for classes, on the
    device the model is on (read on the host once, at the end)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    try:
        with _autocast(run.train, device):
            if isinstance(data, TextData):
                windows = data.eval_windows(split, run.model.context, max_windows)
                sums, count, nbytes = [], 0, 0
                for chunk in windows.split(batch_size):
                    nbytes += data.target_bytes(chunk[:, 1:])    # on the CPU, before the copy
                    chunk = chunk.to(device)
                    logits = model(chunk[:, :-1]).float()
                    targets = chunk[:, 1:]
                    sums.append(nn.functional.cross_entropy(
                        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"))
                    count += targets.numel()
                nats = sum(host_values(sums))   # in float64, in chunk order
                return Evaluation(nats / count, bits_per_byte(nats, nbytes), None, count)
            x, y = data.x[split], data.y[split]
            sums, hits = [], []
            for xs, ys in zip(x.split(256), y.split(256)):
                xs, ys = xs.to(device), ys.to(device)
                logits = model(xs).float()
                sums.append(nn.functional.cross_entropy(logits, ys, reduction="sum"))
                hits.append((logits.argmax(-1) == ys).sum())
            values = host_values(sums + hits)
            nats, correct = sum(values[:len(sums)]), int(sum(values[len(sums):]))
            return Evaluation(nats / len(y), None, correct / len(y), len(y))
    finally:
        model.train(was_training)


def _autocast(train: TrainSpec, device: torch.device):
    """The autocast of ``train.bf16`` / ``train.fp16`` on ``device``, or none."""
    dtype = torch.bfloat16 if train.bf16 else torch.float16 if train.fp16 else None
    return torch.autocast(device.type, dtype=dtype) if dtype else contextlib.nullcontext()


def training_device(name: str) -> torch.device:
    """The device a run trains on: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``; a clear error for
    anything else, or for CUDA on a machine without it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {name!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: this PyTorch sees no CUDA device "
                              f"(torch {torch.__version__}); train on the CPU or install a CUDA "
                              f"build")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: there are {torch.cuda.device_count()} CUDA "
                              f"devices")
    return device


@contextlib.contextmanager
def _config_errors(section: str):
    """A ValueError raised inside becomes a :class:`ConfigError` prefixed with ``section``
    (ConfigErrors pass as they are)."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as error:
        raise ConfigError(f"{section}: {error}") from None


@dataclass
class _Window:
    """The steps since the last training record: the sums of their losses (as read), how
    many were read, the loop's time over them, and the run's skipped steps before them."""
    loss: float = 0.0
    aux: float = 0.0
    steps: int = 0
    time: float = 0.0
    skipped_before: int = 0


class Trainer:
    """Trains ``run`` in ``out_dir``. ``train(resume=True)`` continues from the checkpoint.

    ``read_every_step``: read each step's loss on the host as soon as it is computed (a
    non-finite loss then stops the run before the parameters change), or only where the loop
    logs, evaluates, saves or stops (a step then never waits for a GPU; a non-finite loss is
    found there, named with its step, before anything is written). None: the first on the
    CPU, the second on a GPU (:mod:`sparseffn.train.step_losses`)."""

    def __init__(self, run: RunConfig, out_dir: str | Path, progress: bool = True,
                 label: str | None = None, device: str = "cpu",
                 read_every_step: bool | None = None) -> None:
        self.run, self.out = run, Path(out_dir)
        self.device_name = device
        self.read_every_step = read_every_step
        self.progress, self.label = progress, label or run.name
        self._stop_requested = self._stopped_mid_step = False
        self.parallel = Parallel()

    # -- set-up ------------------------------------------------------------------------------

    @property
    def _tokens_per_row(self) -> int:
        """Tokens in one row of a batch: the context of a language model's window, one
        example of a classification dataset."""
        return self.run.model.context if isinstance(self.data, TextData) else 1

    def _setup(self, state: dict | None) -> None:
        run = self.run
        self.device = self.parallel.device   # under torchrun with cuda: cuda:LOCAL_RANK
        torch.manual_seed(run.seed)
        np.random.seed(run.seed % 2**32)
        tokenizer = state.get("tokenizer") if state else None
        # an unknown corpus, a context longer than the data, ...: a config error
        with _config_errors("data"):
            self.data = load_data(run, tokenizer)
        with _config_errors("model"):
            self.model = build_model(run, self.data, state).to(self.device)
        if run.train.activation_checkpointing:   # (a language model: RunConfig checks)
            self.model.activation_checkpointing = True
        self.steps = total_steps(run, self.data.steps_per_epoch(run.train.batch_size)
                                 if isinstance(self.data, ArrayData) else None)
        parallel = self.parallel
        _check(run.train.batch_size >= parallel.world * run.train.micro_batches,
               f"train.batch_size ({run.train.batch_size}) must be at least the number of "
               f"processes ({parallel.world}) times train.micro_batches "
               f"({run.train.micro_batches}): each process takes a share of every batch, and "
               f"each of its micro-batches at least one row")
        if state is not None:    # the one-process state: load it, then keep this rank's experts
            self.model.load_state_dict(state["model"])
        t = run.train
        parallel.shard(self.model, parallel.fixed_exchange(
            t.exchange_capacity_factor, t.batch_size, t.micro_batches, self._tokens_per_row))
        if parallel.active:      # different dropout and routing noise on every rank
            torch.manual_seed(run.seed + 7919 * (parallel.rank + 1))   # (CUDA's too)
        # clipped together: the tables with sparse gradients too (sparse_grad = true)
        self.trained_params = list(self.model.parameters())
        # the step's forward and loss compiled (evaluation and checkpoints use the model
        # itself); without it, each step looks up model.loss afresh
        self.compiled_loss = None if t.compile_mode is None else compiled(
            self.model.loss, t.compile_mode)
        # with weight decay, weights only: no biases, norm gains or expert/leaf biases
        self.optimizers = adam_optimizers(self.model, t.lr, t.betas, t.weight_decay)
        self.loss_scaling = LossScaling(   # (ranks with their own experts agree on skips)
            self.device, t.fp16, state.get("loss_scaling") if state else None,
            agree=self.parallel.max_ if self.parallel.sharded else None)
        self.step, self.train_time = 0, 0.0
        if state is not None:
            for opt, opt_state in zip(self.optimizers, state["optimizers"]):
                try:
                    parallel.load_optimizer_state(opt, self.model, opt_state)
                except ValueError as error:   # e.g. saved before weight decay had its groups
                    raise ConfigError(
                        f"the checkpoint's optimizer state does not fit this run's optimizer "
                        f"({error}). Checkpoints written with train.weight_decay > 0 before "
                        f"weight decay was limited to weights (sparseffn.param_groups) cannot "
                        f"be resumed; nothing was changed on disk") from error
            self.step, self.train_time = state["step"], state["train_time"]
            ranks = state.get("rng_ranks")
            # each rank's own stream when the number of ranks is the same
            ckpt.set_rng_state(ranks[parallel.rank] if ranks and len(ranks) == parallel.world
                               else state["rng"])

    def _state(self) -> tuple[dict, dict | None]:
        """The checkpoint in the one-process format, and with sharded experts this rank's
        shard of them (then the checkpoint holds everything else; a collective)."""
        data, parallel = self.data, self.parallel
        if parallel.sharded:
            model, optimizers, shard = parallel.split_checkpoint(self.model, self.optimizers)
        else:
            model, shard = self.model.state_dict(), None
            optimizers = [opt.state_dict() for opt in self.optimizers]
        state = {"config": self.run.to_dict(), "model_config": self.model.config.to_dict(),
                 "step": self.step, "train_time": self.train_time,
                 "model": model, "optimizers": optimizers,
                 "schedule": {"name": self.run.train.schedule, "step": self.step,
                              "total_steps": self.steps},
                 "tokenizer": data.tokenizer.state() if isinstance(data, TextData) else None,
                 "rng": ckpt.rng_state()}
        if self.loss_scaling.enabled:
            state["loss_scaling"] = self.loss_scaling.state()
        ranks = parallel.rng_states(state["rng"])
        if ranks is not None:
            state["rng"], state["rng_ranks"] = ranks[0], ranks
        return state, shard

    def save_checkpoint(self) -> Path:
        """Write the checkpoint: every rank takes part, each writes its expert shard (if the
        experts are sharded), then rank 0 the checkpoint that names them."""
        parallel = self.parallel
        state, shard = self._state()
        path = self.out / CHECKPOINT
        if shard is not None:
            names = [ckpt.shard_name(path, self.step, r, parallel.world)
                     for r in range(parallel.world)]
            ckpt.save_atomic({"rank": parallel.rank, "world": parallel.world, "step": self.step,
                              **shard}, self.out / names[parallel.rank])
            parallel.barrier()       # every shard on disk before the checkpoint names them
            state["expert_shards"] = {"world": parallel.world, "files": names}
        if parallel.main:
            ckpt.save_atomic(state, path)
            ckpt.remove_stale_shards(path, state)
        parallel.barrier()           # the checkpoint is there before any rank goes on
        return path

    # -- the loop ----------------------------------------------------------------------------

    def _batch(self, step: int):
        """The step's batch (drawn on the CPU from ``(seed, step)``), on the training device
        (copied from pinned memory to a GPU, so that the copy does not wait)."""
        t = self.run.train
        if isinstance(self.data, TextData):
            batch = self.data.batch(step, t.batch_size, self.run.model.context, self.run.seed)
        else:
            batch = self.data.batch(step, t.batch_size, self.run.seed)
        if self.device.type == "cuda":
            batch = tuple(part.pin_memory() for part in batch)
        return tuple(part.to(self.device, non_blocking=True) for part in batch)

    def _log(self, record: dict) -> None:
        if not self.parallel.main:
            return
        with open(self.out / METRICS, "a") as file:
            file.write(json.dumps(record) + "\n")

    def _trim_metrics(self, step: int) -> None:
        """Drop metric lines past ``step`` (written after the checkpoint a run resumes from),
        so that the file reads as if the run had never stopped."""
        path = self.out / METRICS
        if not path.exists():
            return
        kept = [line for line in path.read_text().splitlines()
                if line.strip() and json.loads(line)["step"] <= step]
        path.write_text("".join(line + "\n" for line in kept))

    def _evaluate(self, split: str = "val", whole: bool = False) -> Evaluation:
        """:func:`evaluate` on ``split`` (its ``eval_windows`` for val, unless ``whole``),
        counting no expert usage: the collapse monitor's window holds training steps only."""
        windows = self.run.train.eval_windows if split == "val" and not whole else None
        with no_usage_statistics(self.model):
            return evaluate(self.model, self.data, self.run, split, windows)

    def train(self, resume: bool = False) -> dict:
        """Run to the last step (or continue from the checkpoint with ``resume``); returns the
        summary. Ctrl-C stops the run at the end of the step in progress and writes a
        checkpoint before KeyboardInterrupt propagates."""
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"--out {self.out} is a file, not a folder")
        state = None
        if resume:
            path = self.out / CHECKPOINT
            if not path.is_file():
                raise ConfigError(f"--resume: no checkpoint in {self.out}; run without --resume "
                                  f"to start")
            state = ckpt.load(path)
            saved = run_config_from_dict(state["config"])
            if saved != self.run:
                raise ConfigError(f"--resume: the checkpoint in {self.out} was written by a "
                                  f"different config; resume with the same config or use a new "
                                  f"--out")
        device = training_device(self.device_name)   # a bad --device touches nothing
        self.parallel = Parallel.from_environment(self.run.train.expert_parallel, device)
        if self.run.train.fp16 and device.type == "cpu" and self.parallel.main:
            print("note: train.fp16 on the CPU checks a run but is slow: PyTorch's CPU float16 "
                  "matrix products take several times float32's (train.bf16 is the fast reduced "
                  "precision there; docs/training.md)", file=sys.stderr)
        # the process's setting comes back after the run, however it ends
        t = self.run.train
        with deterministic_algorithms(t.deterministic, self.parallel.device), \
                (compiling_many() if t.compile else contextlib.nullcontext()), \
                (compiling_checkpointed_sparse_layers()
                 if t.compile and t.activation_checkpointing else contextlib.nullcontext()):
            self._setup(state)   # data and model first: a run that cannot start touches no file
            # rank 0 owns the folder; the other ranks write nothing
            lock = folder_lock(self.out, "training run") if self.parallel.main \
                else contextlib.nullcontext()
            with lock:
                if self.parallel.main:
                    self._prepare_folder(fresh=state is None)
                    if state is not None:
                        self._trim_metrics(self.step)
                with self._interrupts_at_step_boundaries():
                    return self._loop()

    def _prepare_folder(self, fresh: bool) -> None:
        """Create the run folder and write config.json. A fresh run in a folder that holds
        another run's files moves them into ``previous/`` (replacing what an earlier fresh run
        moved there) instead of deleting them."""
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            old = [name for name in (CHECKPOINT, METRICS, SUMMARY, CONFIG)
                   if (self.out / name).exists()]
            old += [file.name for file in ckpt.shard_files(self.out / CHECKPOINT)]
            if fresh and old:
                keep = self.out / PREVIOUS
                if keep.is_dir():
                    shutil.rmtree(keep)
                keep.mkdir()
                for name in old:
                    os.replace(self.out / name, keep / name)
                print(f"{self.out}: the files of the run there before are now in {keep}",
                      file=sys.stderr)
            (self.out / CONFIG).write_text(json.dumps(self.run.to_dict(), indent=2))
        except OSError as error:
            raise ConfigError(f"cannot write the run folder {self.out}: "
                              f"{error.strerror or error}") from None

    @contextlib.contextmanager
    def _interrupts_at_step_boundaries(self):
        """Ctrl-C (SIGINT) stops the run after the step in progress, so that the checkpoint
        holds a whole step: parameters, optimiser state and RNG state all from the same step
        boundary (a step cut short would already have drawn dropout noise or updated some
        parameters). A second Ctrl-C stops at once, without a checkpoint (or, where Python
        drops its KeyboardInterrupt in a finalizer, at the end of the step, with one)."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        def handler(signum, frame):
            if self._stop_requested:
                self._stopped_mid_step = True
                raise KeyboardInterrupt
            self._stop_requested = True
            which = "the next step (the processes agree on it during this one)" \
                if self.parallel.active else "this step"
            print(f"\nstopping after {which} (Ctrl-C again to stop now, without a checkpoint)",
                  file=sys.stderr)
        previous = signal.signal(signal.SIGINT, handler)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _loop(self) -> dict:
        t = self.run.train
        text = isinstance(self.data, TextData)
        per_step = t.batch_size * self._tokens_per_row
        parallel, scaling = self.parallel, self.loss_scaling
        bar = ProgressBar(self.steps, self.step, self.label, "tok" if text else "ex") \
            if self.progress and parallel.main else None
        self.model.train()
        self._losses, self._window = StepLosses(), _Window(skipped_before=scaling.skipped)
        self._read_each_step = reads_every_step(self.device) if self.read_every_step is None \
            else self.read_every_step
        self._clock: float | None = None   # when the steps since the last settle began
        self._step_in_progress: tuple[int, list] = (self.step + 1, [])
        self._last_loss: float | None = None
        collapse_note = None
        reset_usage(self.model)   # the collapse monitor's window starts here
        try:
            while self.step < self.steps:
                if self._clock is None:
                    self._clock = time.perf_counter()
                try:
                    lr = self._step(self.step)
                except Exception as error:
                    self._name_a_non_finite_loss(error)
                    raise
                self.step += 1
                log = self.step % t.log_every == 0 or self.step == self.steps
                evaluating = self.step % t.eval_every == 0 or self.step == self.steps
                saving = bool(t.checkpoint_every) and self.step % t.checkpoint_every == 0
                if log or evaluating or saving:
                    self._settle()
                if log:
                    if parallel.active:    # the collapse monitor reads every rank's usage
                        all_reduce_usage(self.model)
                    window = self._window
                    record = {"kind": "train", "step": self.step,
                              "loss": window.loss / window.steps,
                              "aux_loss": window.aux / window.steps, "lr": lr,
                              "items_per_s": per_step * window.steps / max(window.time, 1e-9),
                              "train_time": self.train_time}
                    if scaling.enabled:  # the scale after the window, its steps skipped
                        record.update(loss_scale=scaling.scale,
                                      skipped_steps=scaling.skipped - window.skipped_before)
                    dropped = exchange_drops(self.model) if parallel.sharded else None
                    if dropped is not None:   # the fixed exchange's, over the window
                        record["exchange_dropped_fraction"] = dropped
                    collapse_note = self._collapse_monitor(record, collapse_note)
                    self._log(record)
                    self._window = _Window(skipped_before=scaling.skipped)
                if bar:
                    shown = {} if self._last_loss is None else {"loss": self._last_loss}
                    bar.update(self.step, per_step, note=collapse_note, **shown, lr=lr)
                if evaluating:
                    result = self._evaluate()
                    self._log({"kind": "eval", "split": "val", "step": self.step,
                               "train_time": self.train_time, **result.as_dict()})
                if saving:
                    self.save_checkpoint()
                # every rank stops at the same step: this one, or the next on several ranks
                if parallel.any_later(self._stop_requested):
                    # The step is whole here even if a second Ctrl-C came during it: its
                    # KeyboardInterrupt was dropped (a signal landing in a finalizer or weakref
                    # callback is printed and ignored), so this boundary writes the checkpoint.
                    self._stopped_mid_step = False
                    raise KeyboardInterrupt
        except KeyboardInterrupt:
            if bar:
                bar.close()
            if self._stopped_mid_step:
                print(f"\nstopped during step {self.step + 1}/{self.steps}; no checkpoint written "
                      f"(the last one in {self.out} stands)", file=sys.stderr)
                raise
            parallel.settle_later()   # a KeyboardInterrupt between steps: nothing in flight
            self._settle()    # (a non-finite loss raises here, and nothing is saved)
            path = self.save_checkpoint()
            if parallel.main:
                print(f"\ninterrupted at step {self.step}/{self.steps}; checkpoint written to {path}; "
                      f"continue with --resume", file=sys.stderr)
            raise
        if bar:
            bar.close()
        parallel.settle_later()
        self.save_checkpoint()
        summary = self.summary(per_step)
        if parallel.main:
            (self.out / SUMMARY).write_text(json.dumps(summary, indent=2))
        return summary

    def _step(self, step: int) -> float:
        """Train on step ``step``'s batch (0-based); returns the learning rate it used. Reads
        nothing on the host unless the loop reads every step's loss."""
        t, parallel, scaling = self.run.train, self.parallel, self.loss_scaling
        lr = t.lr * lr_factor(t.schedule, step, self.steps, t.warmup_steps, t.final_lr_ratio)
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr
        parts = []    # (loss, aux) of each micro-batch, until the step's record takes them
        self._step_in_progress = (step + 1, parts)
        inputs, targets, share = parallel.local(*self._batch(step))
        graphs = t.compile_mode == "reduce-overhead"
        rows = inputs.shape[0]
        for part, part_targets in zip(inputs.tensor_split(t.micro_batches),
                                      targets.tensor_split(t.micro_batches)):
            fraction = part.shape[0] / rows    # of this rank's rows
            if graphs:   # the last part's graph outputs may now be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            with _autocast(t, self.device):
                loss = (self.compiled_loss or self.model.loss)(part, part_targets)
                if graphs:   # the graph's own output: the next replay writes over it,
                    loss = loss.clone()   # and StepLosses keeps the loss until a boundary
                aux = aux_loss(self.model)
                if share * fraction != 1.0:   # the mean over the global batch's rows
                    loss = loss * (share * fraction)
                if fraction != 1.0:           # the aux losses' mean over the micro-batches
                    aux = aux * fraction
            parts.append((loss.detach(), aux.detach()))
            scaling.backward(loss + aux)      # gradients add up over the micro-batches
        losses, auxes = zip(*parts)     # (one part: its own tensors, no addition)
        self._losses.add(step + 1, functools.reduce(operator.add, losses),
                         functools.reduce(operator.add, auxes))
        parts.clear()    # pending in self._losses now
        if self._read_each_step:   # a non-finite loss stops the run before the update
            self._read_losses(updated=False)
        parallel.sync(self.model)
        scaling.unscale(self.optimizers)     # (fp16 only; before clipping)
        if t.clip:
            parallel.clip_grad_norm_(self.trained_params, t.clip, self.model)
        scaling.step(self.optimizers)
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)
        return lr

    def _settle(self) -> None:
        """Where the loop logs, evaluates, saves or stops: read the pending losses (a
        non-finite one raises), the loss scale and the skipped steps, wait for the device,
        and add the time since the clock started to the run's and the window's."""
        self._read_losses(updated=True)
        self.loss_scaling.settle()
        synchronize(self.device)
        if self._clock is not None:
            elapsed = time.perf_counter() - self._clock
            self.train_time += elapsed
            self._window.time += elapsed
            self._clock = None

    def _read_losses(self, updated: bool, over_ranks: bool = True) -> None:
        """Read the pending losses (their mean over the ranks, or this rank's without
        ``over_ranks``) into the window; raise FloatingPointError at the first that is not
        finite (``updated``: the parameters have been updated since it was computed)."""
        window = self._window
        for read in self._losses.read(self.parallel.mean if over_ranks else list):
            if not math.isfinite(read.loss):
                raise FloatingPointError(self._non_finite_message(read.step, read.loss, updated))
            window.loss += read.loss
            window.aux += read.aux
            window.steps += 1
            self._last_loss = read.loss

    def _non_finite_message(self, step: int, loss: float, updated: bool, part: str = "") -> str:
        last = (f"the last checkpoint in {self.out} stands" if (self.out / CHECKPOINT).exists()
                else "no checkpoint was written")
        when = ("found after that step's update (on this device the loop reads the losses "
                "where it logs, evaluates or saves); nothing was written since"
                if updated else "stopped before updating the parameters")
        return (f"loss is {loss} at step {step}{part}; {when} ({last}); lower train.lr or enable "
                f"train.clip" + ("; float16 overflows above 65504, train.bf16 does not"
                                 if self.run.train.fp16 else ""))

    def _name_a_non_finite_loss(self, error: Exception) -> None:
        """A step failed: if a pending loss was not finite, or the loss of a micro-batch the
        failing step had computed, raise that (the failure is likely its consequence: a NaN
        weight reaching a check); otherwise return, and the caller re-raises ``error``. This
        rank's losses only: the other ranks are not here to average with (a NaN in one rank's
        loss is a NaN in the mean)."""
        try:
            self._read_losses(updated=True, over_ranks=False)
            step, parts = self._step_in_progress
            for number, value in enumerate(host_values([loss for loss, _ in parts]), 1):
                if not math.isfinite(value):
                    count = self.run.train.micro_batches
                    part = f" (micro-batch {number} of {count})" if count > 1 else ""
                    raise FloatingPointError(self._non_finite_message(step, value, False, part))
        except FloatingPointError as non_finite:
            raise non_finite from error
        except Exception:   # the device may be unable to read (a CUDA error): error stands
            pass

    def _collapse_monitor(self, record: dict, previous_note: str | None) -> str | None:
        """Add the usage of the steps since the last log to ``record`` (per sparse layer: the
        normalised usage entropy and the fraction of starved experts, as
        :mod:`sparseffn.analysis` defines them), start a new window, and return the warning
        for the progress bar (printed once when it first appears)."""
        health = usage_health(self.model)
        reset_usage(self.model)
        if not health:
            return None
        record["usage_entropy"] = {name: round(e, 4) for name, (e, _) in health.items()}
        record["starved_fraction"] = {name: round(s, 4) for name, (_, s) in health.items()}
        warned = [name for name in health if collapse_warning(*health[name])]
        worst = min(warned or health, key=lambda name: health[name][0])
        warning = collapse_warning(*health[worst])
        note = None if warning is None else f"collapse? {worst}: {warning}"
        if note and previous_note is None and self.parallel.main:
            print(f"\n{self.label} step {self.step}: expert usage looks collapsed in {worst} "
                  f"({warning}); see usage_entropy / starved_fraction in {METRICS}",
                  file=sys.stderr)
        return note

    def summary(self, per_step: int) -> dict:
        final = self._evaluate("val", whole=True)
        cost = self.model.config.cost()
        out = {"name": self.run.name, "steps": self.step, "lr": self.run.train.lr,
               "train_time_s": self.train_time,
               "items_per_s": self.step * per_step / max(self.train_time, 1e-9),
               "peak_rss_mb": peak_rss_bytes() / 2**20, **cost,
               "processes": self.parallel.world, "device": str(self.device),
               "expert_parallel": self.parallel.sharded,
               **({"skipped_steps": self.loss_scaling.skipped}
                  if self.loss_scaling.enabled else {}),
               "val": final.as_dict(), "model": self.model.config.to_dict()}
        if isinstance(self.data, TextData):
            out["unigram_bits"] = self.data.unigram_bits
            out["corpus"] = self.data.name
        else:   # classification datasets have a held-out test split: papers report on it
            out["test"] = evaluate(self.model, self.data, self.run, "test").as_dict()
        return out
