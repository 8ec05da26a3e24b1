"""``train.activation_checkpointing``: each Transformer block keeps only its input in the
forward and recomputes its activations in the backward (non-reentrant
``torch.utils.checkpoint``, RNG state preserved). The run is the same to the bit: losses, aux
losses, usage statistics and weights, dropout and routing noise included; compiled, the
blocks trace in one graph and train as the eager run without checkpointing."""

import functools

import pytest
import torch
import torch._inductor.config
from torch._dynamo.utils import counters

from sparseffn.models import lm
from sparseffn.runtime import _SKIP_REPLAY, checkpointed_sparse_layers_trace_in_one_graph
from sparseffn.train.config import ConfigError
from sparseffn.train.trainer import Trainer

from .test_train import classifier_run, lm_run, metrics, same_weights, without_timing


@pytest.mark.parametrize("ffn", ["sigma_moe", "switch", "pkm", "peer", "fff"])
def test_recomputed_blocks_train_the_same_run_to_the_bit(corpus, tmp_path, monkeypatch, ffn):
    """Dropout 0.1 (and Switch's routing noise where it has some): the recomputation draws
    the same masks. The logged usage entropy shows each token's routing counted once."""
    calls = []
    checkpoint = lm.checkpoint

    def counted(function, *args, **kwargs):
        calls.append(1)
        return checkpoint(function, *args, **kwargs)
    monkeypatch.setattr(lm, "checkpoint", counted)
    Trainer(lm_run(corpus, ffn), tmp_path / "kept", progress=False).train()
    assert calls == []
    Trainer(lm_run(corpus, ffn, activation_checkpointing=True), tmp_path / "recomputed",
            progress=False).train()
    assert len(calls) == 6 * 2          # each training step's two blocks; none in evaluation
    assert without_timing(metrics(tmp_path / "recomputed")) == \
        without_timing(metrics(tmp_path / "kept"))
    assert same_weights(tmp_path / "recomputed", tmp_path / "kept")
    if ffn != "fff":
        assert any("usage_entropy" in m for m in metrics(tmp_path / "kept"))


def test_compiled_recomputed_blocks_trace_in_one_graph_and_train_as_eagerly(corpus, tmp_path,
                                                                          monkeypatch):
    """The trainer lets Dynamo skip replaying the sparse layers' side effects in the
    recomputation (as they skip it eagerly), so nothing breaks the graph; without that each
    sparse layer would run eagerly (as it does before PyTorch 2.10, which cannot trace it, with
    the same results). Dropout 0.1: the recomputation uses the forward's masks, so the run is
    the eager run without checkpointing.

    Compiled with ``aot_eager_decomp_partition``: Dynamo, AOTAutograd's decompositions and the
    partitioner that recomputes the checkpointed blocks, as Inductor's, without Inductor's code
    generation (with Inductor this test took 45 s with empty caches on 2 cores; 9 s so). Its
    decompositions draw dropout masks with their own random ops unless ``fallback_random``
    (Inductor's setting, which they follow) keeps eager's. Inductor compiles a checkpointed
    sparse layer in ``test_expert_parallel`` and the LM in ``test_compiled_training``."""
    Trainer(lm_run(corpus, "sigma_moe", steps=4), tmp_path / "eager", progress=False).train()
    counters.clear()
    monkeypatch.setattr(torch, "compile", functools.partial(
        torch.compile, backend="aot_eager_decomp_partition"))
    with torch._inductor.config.patch(fallback_random=True):   # (dropout: eager's random ops)
        Trainer(lm_run(corpus, "sigma_moe", steps=4, compile=True,
                       activation_checkpointing=True),
                tmp_path / "recomputed", progress=False).train()
    assert counters["stats"]["unique_graphs"] >= 1           # it did compile
    breaks = sum(counters["graph_break"].values())
    assert breaks == 0 if checkpointed_sparse_layers_trace_in_one_graph() else breaks > 0
    a, b = metrics(tmp_path / "eager"), metrics(tmp_path / "recomputed")
    assert [m["kind"] for m in b] == [m["kind"] for m in a]
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-5)
    assert not getattr(torch._dynamo.config, _SKIP_REPLAY, False)   # restored


def test_activation_checkpointing_is_for_language_models(tmp_path):
    layer = {"type": "fff", "depth": 2, "leaf_width": 8, "d_out": 3}
    with pytest.raises(ConfigError, match="activation_checkpointing is for language models"):
        Trainer(classifier_run(layer, steps=2, activation_checkpointing=True), tmp_path,
                progress=False).train()
    assert not tmp_path.joinpath("checkpoint.pt").exists()
