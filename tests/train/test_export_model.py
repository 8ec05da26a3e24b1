"""``load_safetensors_model``: the network an exported ``.safetensors`` file holds, built from
the model config in its metadata, with the file's weights, without the run's data."""

import dataclasses

import pytest
import torch

from sparseffn.models.classifier import SparseClassifier
from sparseffn.models.lm import TransformerLM
from sparseffn.train import checkpoint as ckpt
from sparseffn.train.trainer import Trainer, load_trained
from tests.train.test_model_config import OLD_DEFAULTS, with_options
from tests.train.test_train import classifier_run, lm_run

pytest.importorskip("safetensors")
from sparseffn.train.export import export_safetensors, load_safetensors_model  # noqa: E402


def _exported(run, folder, edit=None):
    """Train ``run`` in ``folder``, let ``edit`` change the checkpoint's state, export it."""
    Trainer(run, folder, progress=False).train()
    path = folder / "checkpoint.pt"
    if edit is not None:
        state = ckpt.load(path)
        edit(state)
        ckpt.save_atomic(state, path)
    return export_safetensors(path)


def _same_network(loaded, trained, inputs):
    assert type(loaded) is type(trained) and loaded.config == trained.config
    assert not loaded.training
    assert loaded.state_dict().keys() == trained.state_dict().keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in trained.state_dict().items())
    with torch.no_grad():
        assert torch.equal(loaded(inputs), trained.eval()(inputs))


def test_an_lm_comes_back_as_it_was_trained(corpus, tmp_path):
    path = _exported(lm_run(corpus, "sigma_moe", steps=2), tmp_path)
    _, _, _, trained = load_trained(tmp_path / "checkpoint.pt")
    loaded = load_safetensors_model(path)
    assert isinstance(loaded, TransformerLM)
    _same_network(loaded, trained, torch.randint(0, 256, (2, 16)))


def test_a_classifier_comes_back_as_it_was_trained(tmp_path):
    run = classifier_run({"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3}, steps=3)
    path = _exported(run, tmp_path)
    _, _, _, trained = load_trained(tmp_path / "checkpoint.pt")
    loaded = load_safetensors_model(path)
    assert isinstance(loaded, SparseClassifier)
    _same_network(loaded, trained, torch.randn(5, 6))


def test_the_network_is_the_trained_one_after_the_defaults_changed(corpus, tmp_path, capsys):
    """A model config unlike what the run config builds now (here: fff_sparse with the leaf
    weights it had before they were renormalised): the file's network, not today's."""
    run = with_options(lm_run(corpus, "fff_sparse", steps=2), **OLD_DEFAULTS)
    path = _exported(run, tmp_path, lambda state: state.update(
        config=dataclasses.replace(run, model=dataclasses.replace(
            run.model, ffn_options={})).to_dict()))
    loaded = load_safetensors_model(path)
    assert loaded.config.ffn.router.renormalize is False
    assert loaded.config.ffn.router.entropy_weight == 0.0
    assert capsys.readouterr().err == ""     # nothing to say: the file names its network


def test_a_file_without_a_model_config_builds_an_lm_from_its_run_config(corpus, tmp_path):
    """Exported from a checkpoint written before checkpoints kept their model config: the LM
    its run config builds, for the vocabulary of the file's token embedding."""
    path = _exported(lm_run(corpus, "pkm", steps=2), tmp_path,
                     lambda state: state.pop("model_config"))
    _, _, _, trained = load_trained(tmp_path / "checkpoint.pt")
    _same_network(load_safetensors_model(path), trained, torch.randint(0, 256, (2, 16)))


def test_what_cannot_be_built_is_a_checkpoint_error_naming_why(corpus, tmp_path):
    run = classifier_run({"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3}, steps=2)
    path = _exported(run, tmp_path / "classifier", lambda state: state.pop("model_config"))
    with pytest.raises(ckpt.CheckpointError, match="classifier's network needs its data's sizes"):
        load_safetensors_model(path)

    def other_width(state):     # weights that do not fit the network the config builds
        state["model_config"]["ffn"]["d_model"] = state["model_config"]["d_model"] = 64
    path = _exported(lm_run(corpus, "dense", steps=2), tmp_path / "lm", other_width)
    with pytest.raises(ckpt.CheckpointError, match="size mismatch for embed.weight"):
        load_safetensors_model(path)
    with pytest.raises(FileNotFoundError):
        load_safetensors_model(tmp_path / "missing.safetensors")


def test_the_network_lands_on_the_device_asked_for(corpus, tmp_path):
    path = _exported(lm_run(corpus, "dense", steps=1), tmp_path)
    model = load_safetensors_model(path, device="meta")
    assert all(p.device.type == "meta" for p in model.parameters())
