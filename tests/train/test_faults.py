"""Bad run configs and faults: every failure is a one-line message with exit code 2 (1 for a
diverging run), and no failure deletes or corrupts the files of a run already in --out."""

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sparseffn.cli import main
from sparseffn.train import checkpoint as ckpt
from sparseffn.train.lock import LOCK
from sparseffn.train.config import (ConfigError, TrainSpec, apply_overrides,
                                    parse_override_value, run_config_from_dict)
from tests.train.conftest import CORPUS
from tests.train.test_train import write_toml

TOML = """
name = "faults"
[data]
corpus = "file"
path = "{corpus}"
[model]
d_model = 16
n_layers = 1
n_heads = 2
context = 8
ffn = "sigma_moe"
d_ff = 64
[train]
steps = 2
batch_size = 2
eval_every = 2
eval_windows = 2
"""


@pytest.fixture
def config(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(CORPUS)
    return write_toml(tmp_path / "run.toml", TOML.format(corpus=corpus))


@pytest.fixture
def finished(config, tmp_path, capsys):
    """A run folder holding a finished run; returns (folder, its files' bytes)."""
    out = tmp_path / "out"
    assert main(["train", config, "--out", str(out), "--no-progress"]) == 0
    capsys.readouterr()
    return out, _files(out)


def _files(folder):
    """The run's files and their bytes (not the lock, which says who is writing there)."""
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != LOCK}


def _one_line_error(capsys, code, expected, text):
    err = capsys.readouterr().err
    assert code == expected, err
    assert "Traceback" not in err and text in err, err


@pytest.mark.parametrize("override", ["model.context=-3", "model.ffn=nonsense",
                                      "train.clip=-1.0", "data.corpus=no_such_corpus",
                                      "model.context=100000"])
def test_a_run_that_cannot_start_keeps_the_previous_runs_files(config, finished, capsys,
                                                                override):
    out, before = finished
    code = main(["train", config, "--out", str(out), "--set", override, "--no-progress"])
    _one_line_error(capsys, code, 2, "sparseffn:")
    assert _files(out) == before
    assert main(["train", config, "--out", str(out), "--resume", "--no-progress"]) == 0


def test_a_fresh_run_moves_the_previous_run_aside(config, finished, capsys):
    out, before = finished
    assert main(["train", config, "--out", str(out), "--set", "train.steps=3",
                 "--no-progress"]) == 0
    assert "previous" in capsys.readouterr().err
    kept = {p.name: p.read_bytes() for p in (out / "previous").iterdir()}
    assert kept == before
    assert ckpt.load(out / "checkpoint.pt")["step"] == 3


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04truncated", b"name = 'toml'\n",
                                     os.urandom(300), "tensor", "dict"])
def test_eval_and_resume_of_a_file_that_is_no_checkpoint(config, finished, tmp_path, capsys,
                                                         content):
    out, _ = finished
    bad = tmp_path / "bad.pt"
    if content == "tensor":
        torch.save(torch.zeros(3), bad)
    elif content == "dict":
        torch.save({"weights": torch.zeros(3)}, bad)
    else:
        bad.write_bytes(content)
    _one_line_error(capsys, main(["eval", str(bad)]), 2, "checkpoint")
    truncated = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(truncated[: len(truncated) // 2])
    code = main(["train", config, "--out", str(out), "--resume", "--no-progress"])
    _one_line_error(capsys, code, 2, "not a readable checkpoint")


def test_out_that_is_a_file_or_read_only(config, tmp_path, capsys):
    as_file = tmp_path / "file"
    as_file.write_text("mine")
    _one_line_error(capsys, main(["train", config, "--out", str(as_file), "--no-progress"]),
                    2, "is a file")
    assert as_file.read_text() == "mine"
    # a folder that cannot be created (its parent is a file): the same message as read-only
    _one_line_error(capsys, main(["train", config, "--out", str(as_file / "run"),
                                  "--no-progress"]), 2, "cannot write the run folder")
    assert as_file.read_text() == "mine"


def test_a_diverging_run_stops_before_the_update_and_names_the_step(config, tmp_path, capsys):
    out = tmp_path / "nan"
    code = main(["train", config, "--out", str(out), "--set", "train.lr=1e30",
                 "--set", "train.clip=0", "--set", "train.steps=40", "--no-progress"])
    err = capsys.readouterr().err
    if code == 0:
        pytest.skip("this seed did not diverge")   # pragma: no cover
    assert code == 1 and "at step" in err and "Traceback" not in err


@pytest.mark.parametrize("key, value, message", [
    ("bf16", "False", "true or false"), ("bf16", 1, "true or false"),
    ("batch_size", 2.5, "integer"), ("batch_size", True, "integer"),
    ("clip", -1.0, "clip"), ("clip", "x", "finite number"),
    ("warmup_steps", -5, "warmup_steps"), ("lr", float("inf"), "finite"),
    ("lr", float("nan"), "finite"), ("final_lr_ratio", 1.5, "final_lr_ratio"),
    ("betas", [0.9, 1.5], "betas"), ("eval_windows", 0, "eval_windows"),
    ("checkpoint_every", -1, "checkpoint_every"), ("weight_decay", -0.1, "weight_decay"),
])
def test_train_fields_are_typed_and_ranged(key, value, message):
    with pytest.raises(ConfigError, match=message):
        TrainSpec(**{key: value})


def test_none_turns_optional_fields_off():
    run = run_config_from_dict(apply_overrides({}, ["train.clip=none", "train.eval_windows=None",
                                                   "train.bf16=False", "train.lr=2e-3"]))
    assert run.train.clip is None and run.train.eval_windows is None
    assert run.train.bf16 is False and run.train.lr == 2e-3


@settings(max_examples=60, deadline=None)
@given(st.one_of(st.booleans(), st.integers(-10**6, 10**6),
                 st.floats(allow_nan=False, allow_infinity=False, width=32),
                 st.text(alphabet="abcxyz_", min_size=1, max_size=8)))
def test_set_values_parse_as_what_they_print(value):
    if isinstance(value, bool):
        texts = [str(value), str(value).lower(), str(value).upper()]
    elif isinstance(value, str):
        texts = [value] if value.lower() not in ("true", "false", "none", "null", "inf",
                                                   "nan") else []
    else:
        texts = [repr(value)]
    for text in texts:
        parsed = parse_override_value(text)
        assert parsed == value and type(parsed) is type(value)


@settings(max_examples=80, deadline=None)
@given(field=st.sampled_from(["steps", "batch_size", "lr", "clip", "warmup_steps",
                              "final_lr_ratio", "weight_decay", "eval_every", "bf16",
                              "fp16"]),
       value=st.one_of(st.none(), st.booleans(), st.integers(-5, 5),
                       st.floats(-3, 3), st.sampled_from([float("nan"), float("inf")]),
                       st.text(max_size=3)))
def test_any_train_value_is_accepted_valid_or_rejected_by_name(field, value):
    try:
        spec = TrainSpec(**{field: value})
    except ConfigError as error:
        assert f"train.{field}" in str(error) or field in str(error)
        return
    stored = getattr(spec, field)
    assert stored is None or isinstance(stored, (bool, int, float))
    if isinstance(stored, float):
        assert stored == stored and abs(stored) != float("inf")


def test_a_process_killed_while_saving_leaves_a_loadable_checkpoint(tmp_path):
    """kill -9 during the write of a large checkpoint: the file is the previous whole one."""
    import signal
    import subprocess
    import sys
    import time
    path = tmp_path / "checkpoint.pt"
    ckpt.save_atomic({"step": 1, "config": {}, "model": {"w": torch.zeros(4)}}, path)
    writer = subprocess.Popen([sys.executable, "-c", (
        "import torch, sys\n"
        "from sparseffn.train import checkpoint as c\n"
        "state = {'step': 2, 'config': {}, 'model': {'w': torch.randn(64, 2**20)}}\n"
        "print('go', flush=True)\n"
        "while True: c.save_atomic(state, sys.argv[1])\n"), str(path)],
        stdout=subprocess.PIPE)
    assert writer.stdout.readline().strip() == b"go"
    time.sleep(0.3)                       # inside a 256 MiB write
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    writer.stdout.close()
    state = ckpt.load(path)
    assert state["step"] in (1, 2)


def test_a_second_process_on_a_run_folder_is_refused_until_the_first_exits(config, finished,
                                                                             tmp_path, capsys):
    """Two processes writing one folder would interleave checkpoints and metrics: the second
    gets a one-line error naming the first's pid, the files stay as they were, and the lock
    dies with its holder (kill -9 leaves no stale lock)."""
    import signal
    import subprocess
    import sys
    from sparseffn.train.compare import compare
    out, before = finished
    holder = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, sys, time\n"
        "from sparseffn.train.lock import folder_lock\n"
        "with folder_lock(pathlib.Path(sys.argv[1]), 'training run'):\n"
        "    print('holding', flush=True)\n"
        "    time.sleep(120)\n"), str(out)], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == b"holding"
        code = main(["train", config, "--out", str(out), "--no-progress"])
        _one_line_error(capsys, code, 2, f"is in use by process {holder.pid}")
        assert _files(out) == before
        with pytest.raises(ConfigError, match=f"cannot start this compare: .* process "
                                              f"{holder.pid}"):
            compare({"name": "c", "data": {"corpus": "pydoc"}, "model": {"d_model": 16},
                     "compare": {"variants": ["dense"]}}, out)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        holder.stdout.close()
    assert main(["train", config, "--out", str(out), "--no-progress"]) == 0
