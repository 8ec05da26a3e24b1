"""A checkpoint keeps the model config it was trained with: after the library's defaults
change, resuming, evaluating and exporting it use the network it trained, and say what the
current version would build instead."""

import dataclasses
import json

import pytest
import torch

from sparseffn.models import PRESETS
from sparseffn.train import checkpoint as ckpt
from sparseffn.train.config import classifier_config, lm_config
from sparseffn.train.model_config import changed_fields, checkpoint_model_config, model_changes
from sparseffn.train.trainer import Trainer, load_trained
from tests.train.test_train import classifier_run, interrupt_at, lm_run, metrics

# fff_sparse as it was before its router renormalised its leaf weights and regularised them
OLD_DEFAULTS = {"router": {"renormalize": False, "entropy_weight": 0.0}}


def with_options(run, **options):
    return dataclasses.replace(run, model=dataclasses.replace(run.model, ffn_options=options))


def as_if_written_before_the_change(path, run):
    """The checkpoint of a run trained with the old defaults, as that version saved it: the
    run config without the options (they were its defaults then)."""
    state = ckpt.load(path)
    state["config"] = run.to_dict()
    ckpt.save_atomic(state, path)
    return state


def curve(folder):
    return [(m["kind"], m["step"], m["loss"]) for m in metrics(folder)]


def test_resume_continues_the_network_the_checkpoint_trained_after_the_defaults_changed(
        corpus, tmp_path, capsys):
    run = lm_run(corpus, "fff_sparse", steps=8)
    old = with_options(run, **OLD_DEFAULTS)
    Trainer(old, tmp_path / "straight", progress=False).train()
    stopped = Trainer(old, tmp_path / "resumed", progress=False)
    interrupt_at(stopped, 5)
    with pytest.raises(KeyboardInterrupt):
        stopped.train()
    state = as_if_written_before_the_change(tmp_path / "resumed" / "checkpoint.pt", run)
    assert state["model_config"] == stopped.model.config.to_dict()
    capsys.readouterr()
    resumed = Trainer(run, tmp_path / "resumed", progress=False)
    resumed.train(resume=True)
    err = capsys.readouterr().err
    assert "ffn.router.renormalize: False in the checkpoint, True now" in err
    assert "ffn.router.entropy_weight: 0.0 in the checkpoint, 0.01 now" in err
    assert resumed.model.config == stopped.model.config
    assert curve(tmp_path / "resumed") == curve(tmp_path / "straight")    # exact floats
    final = ckpt.load(tmp_path / "resumed" / "checkpoint.pt")
    assert final["model_config"] == state["model_config"], "kept by every later checkpoint"
    summary = json.loads((tmp_path / "resumed" / "summary.json").read_text())
    assert summary["model"]["ffn"]["router"]["renormalize"] is False

    _, _, _, model = load_trained(tmp_path / "resumed" / "checkpoint.pt")   # eval, analyze
    assert model.config == stopped.model.config
    assert "renormalize: False in the checkpoint" in capsys.readouterr().err


def test_under_torchrun_only_rank_0_prints_the_note(monkeypatch, capsys):
    run = lm_run("corpus.txt", "fff_sparse")
    current = lm_config(run, vocab_size=256)
    trained = lm_config(with_options(run, **OLD_DEFAULTS), vocab_size=256).to_dict()
    for rank, printed in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        assert checkpoint_model_config(trained, current).to_dict() == trained
        assert ("renormalize: False in the checkpoint" in capsys.readouterr().err) == printed


def test_the_same_defaults_build_the_same_network_without_a_note(corpus, tmp_path, capsys):
    run = lm_run(corpus, "fff_sparse", steps=2)
    trainer = Trainer(run, tmp_path, progress=False)
    trainer.train()
    capsys.readouterr()
    _, _, _, model = load_trained(tmp_path / "checkpoint.pt")
    assert model.config == trainer.model.config and "note:" not in capsys.readouterr().err


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_every_presets_model_config_comes_back_from_a_checkpoint_as_it_went_in(
        preset, tmp_path, capsys):
    """Through torch.save and a weights-only load: equal, so no note at an unchanged version;
    through a summary's JSON: no changed field."""
    run = lm_run("corpus.txt", preset)
    config = lm_config(run, vocab_size=256)
    torch.save({"model_config": config.to_dict()}, tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)["model_config"]
    assert checkpoint_model_config(saved, config) == config
    assert capsys.readouterr().err == ""
    assert model_changes(run, json.loads(json.dumps(config.to_dict()))) == []


def test_model_changes_rebuilds_a_classifier_for_the_sizes_it_was_trained_on():
    run = classifier_run({"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3})
    trained = classifier_config(run, in_features=6, num_classes=3).to_dict()
    assert model_changes(run, trained) == []
    trained["layer"]["leaf_width"] = 4
    assert model_changes(run, trained) == [("layer.leaf_width", 4, 8)]


@pytest.mark.parametrize("saved", [None, "unbuildable"])
def test_a_checkpoint_without_a_buildable_model_config_builds_what_its_run_config_builds(
        corpus, tmp_path, capsys, saved):
    """Checkpoints written before model configs were kept (none), or holding one that this
    version cannot build (a field it no longer has): the run config's model, as before."""
    run = lm_run(corpus, "sigma_moe", steps=4)
    trainer = Trainer(run, tmp_path, progress=False)
    interrupt_at(trainer, 2)
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    path = tmp_path / "checkpoint.pt"
    state = ckpt.load(path)
    if saved is None:
        del state["model_config"]
    else:
        state["model_config"]["ffn"]["gone_field"] = 1
    ckpt.save_atomic(state, path)
    capsys.readouterr()
    resumed = Trainer(run, tmp_path, progress=False)
    resumed.train(resume=True)
    err = capsys.readouterr().err
    assert resumed.model.config == trainer.model.config and resumed.step == 4
    if saved is None:
        assert "note:" not in err
    else:
        assert "cannot build" in err and "gone_field" in err


def test_changed_fields_names_each_difference_by_its_dotted_path():
    old = {"d_model": 8, "ffn": {"k": 2, "router": {"renormalize": False}}, "gone": 1}
    new = {"d_model": 8, "ffn": {"k": 3, "router": {"renormalize": True, "added": 0.5}}}
    assert changed_fields(old, new) == [("ffn.k", 2, 3), ("ffn.router.renormalize", False, True),
                                        ("ffn.router.added", None, 0.5), ("gone", 1, None)]
    assert changed_fields(new, new) == []
