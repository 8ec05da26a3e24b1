"""``sparseffn sample``: text from a checkpoint, without the corpus; greedy text is the
model's arg-max continuation; seeds reproduce; BPE checkpoints decode; classifiers, bad
arguments and missing files are refused with a message."""

import json
import shutil

import pytest
import torch

from sparseffn.cli import main
from sparseffn.data.tokenizers import tokenizer_from_state
from sparseffn.train import checkpoint as ckpt
from sparseffn.train.config import DataSpec
from sparseffn.train.sample import load_language_model, sample_texts
from sparseffn.train.trainer import Trainer

from ..models.test_generate import greedy_by_hand
from .test_train import classifier_run, lm_run


@pytest.fixture
def trained(corpus, tmp_path):
    """A tiny σ-MoE LM's checkpoint, trained on a copy of the corpus that is gone after."""
    copy = tmp_path / "copy.txt"
    shutil.copy(corpus, copy)
    Trainer(lm_run(str(copy), "sigma_moe", steps=3), tmp_path / "lm", progress=False).train()
    copy.unlink()
    return tmp_path / "lm" / "checkpoint.pt"


def run_cli(capsys, *argv):
    code = main(["sample", *map(str, argv)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_greedy_text_is_the_models_argmax_continuation(trained, capsys):
    code, out, _ = run_cli(capsys, trained, "--prompt", "the ", "--tokens", 20,
                           "--temperature", 0, "--json")
    assert code == 0
    text = json.loads(out)["samples"][0]
    state, model, tokenizer = load_language_model(trained)
    tokens = greedy_by_hand(model, torch.tensor([list(b"the ")]), 20)
    assert text == bytes(tokens[0].tolist()).decode("utf-8", errors="replace")
    assert text.startswith("the ") and state["step"] == 3


def test_the_kv_cache_can_be_turned_off_for_the_same_text(trained, capsys):
    def texts(*extra):
        code, out, _ = run_cli(capsys, trained, "--tokens", 30, "--samples", 2, "--seed", 4,
                               "--json", *extra)
        assert code == 0
        return json.loads(out)["samples"]
    assert texts("--no-kv-cache") == texts()
    assert texts("--no-kv-cache", "--temperature", 0) == texts("--temperature", 0)


def test_compiled_decoding_draws_the_same_text(trained, capsys, monkeypatch):
    from sparseffn.train import sample
    made = []

    class Recording(sample.Decoder):
        def __init__(self, model, batch, compile="none", dtype=None):
            made.append((batch, compile))
            super().__init__(model, batch, compile, dtype)
    monkeypatch.setattr(sample, "Decoder", Recording)

    def texts(*extra):
        code, out, err = run_cli(capsys, trained, "--tokens", 20, "--samples", 2, "--seed", 4,
                                 "--json", *extra)
        assert code == 0, err
        return json.loads(out)["samples"]
    assert texts("--compile", "default") == texts()
    assert texts("--compile", "default", "--temperature", 0) == texts("--temperature", 0)
    assert made == [(2, "default")] * 2             # only the compiled runs, with the mode
    code, _, err = run_cli(capsys, trained, "--compile", "default", "--no-kv-cache")
    assert code == 2 and "compiling the decoding steps needs the KV cache" in err


def test_seeds_reproduce_and_samples_differ(trained, capsys):
    def texts(*extra):
        code, out, _ = run_cli(capsys, trained, "--tokens", 40, "--samples", 3, "--json", *extra)
        assert code == 0
        return json.loads(out)["samples"]
    first = texts("--seed", 5)
    assert first == texts("--seed", 5) and len(first) == 3
    assert len(set(first)) == 3 and first != texts("--seed", 6)
    assert all(text.startswith("\n") for text in first)        # the default prompt
    assert texts("--seed", 5, "--top-k", 1) == [texts("--temperature", 0)[0]] * 3
    code, out, _ = run_cli(capsys, trained, "--tokens", 10, "--samples", 2)
    assert code == 0 and out.count("--- sample ") == 2


def test_a_bpe_checkpoint_encodes_the_prompt_and_decodes_its_tokens(corpus, tmp_path):
    run = lm_run(corpus, "dense", steps=2)
    run = run.replace(data=DataSpec(corpus="file", path=corpus, tokenizer="bpe",
                                    vocab_size=300))
    Trainer(run, tmp_path, progress=False).train()
    path = tmp_path / "checkpoint.pt"
    tokenizer = tokenizer_from_state(ckpt.load(path)["tokenizer"])
    assert tokenizer.kind == "bpe" and len(tokenizer.encode(b"the the the")) < 11
    texts = sample_texts(path, "the the", tokens=15, samples=2, seed=1)
    assert all(text.startswith("the the") for text in texts)


def test_a_checkpoint_without_its_model_config_is_built_from_its_run(trained, corpus,
                                                                       tmp_path):
    """Checkpoints from before model configs were kept, or holding one this version cannot
    build: the run config and corpus build the model."""
    state = ckpt.load(trained)
    greedy = sample_texts(trained, "a", tokens=12, temperature=0)
    del state["model_config"]
    state["config"]["data"]["path"] = corpus
    ckpt.save_atomic(state, tmp_path / "old.pt")
    assert sample_texts(tmp_path / "old.pt", "a", tokens=12, temperature=0) == greedy
    state["model_config"] = {**ckpt.load(trained)["model_config"], "renamed_field": 1}
    ckpt.save_atomic(state, tmp_path / "newer.pt")       # a field this version does not know
    assert sample_texts(tmp_path / "newer.pt", "a", tokens=12, temperature=0) == greedy


@pytest.mark.parametrize("argv, message", [
    (["--top-k", 0], "top_k must be a positive integer"),
    (["--top-p", 1.5], "top_p must lie in (0, 1]"),
    (["--temperature", -1], "temperature must be a finite number >= 0"),
    (["--prompt", ""], "the prompt is empty"),
    (["--tokens", 0], "--tokens must be positive"),
    (["--samples", 0], "--samples must be positive"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N"),
])
def test_bad_arguments_are_named(trained, capsys, argv, message):
    code, out, err = run_cli(capsys, trained, *argv)
    assert code == 2 and message in err and "Traceback" not in err and out == ""


def test_a_classifier_or_a_missing_checkpoint_is_refused(tmp_path, capsys):
    layer = {"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3}
    Trainer(classifier_run(layer, steps=2), tmp_path, progress=False).train()
    code, _, err = run_cli(capsys, tmp_path / "checkpoint.pt")
    assert code == 2 and "classifier" in err and "language model" in err
    code, _, err = run_cli(capsys, tmp_path / "none.pt")
    assert code == 2 and "no checkpoint at" in err
