"""``train.micro_batches``: each step's batch runs as several micro-batches, forward and
backward in turn, their gradients summed before the one update. Each micro-batch's loss is
weighted by its share of the rows, so the step follows the whole batch's mean loss: the same
run as one batch, up to rounding, where a layer's output for a token does not depend on the
other tokens of its batch."""

import pytest
import torch

from sparseffn.models.lm import TransformerLM
from sparseffn.train import checkpoint as ckpt
from sparseffn.train.config import ConfigError, ModelSpec, TrainSpec
from sparseffn.train.trainer import Trainer

from .test_fp16 import train_losses
from .test_train import lm_run, metrics, straight_and_resumed


def _run(corpus, ffn="dense", micro_batches=1, dropout=0.0, steps=6, **train):
    run = lm_run(corpus, ffn, steps=steps, micro_batches=micro_batches, **train)
    return run.replace(model=ModelSpec(**{**run.model.__dict__, "dropout": dropout}))


def _weights(folder):
    return ckpt.load(folder / "checkpoint.pt")["model"]


@pytest.mark.parametrize("ffn", ["dense", "sigma_moe", "pkm", "fff"])
@pytest.mark.parametrize("micro_batches", [2, 3])
def test_micro_batches_train_the_run_of_one_batch(corpus, tmp_path, monkeypatch, ffn,
                                                  micro_batches):
    """Batch 4 as 2 + 2 or 2 + 1 + 1 rows. The dense LM's curve and weights equal one batch's
    to rounding. In the sparse LMs each token's output is its own, but the aux losses are
    means over a batch's tokens (σ-MoE's entropy regulariser, PKM's and FFF's terms), so the
    micro-batches' mean differs from the batch's a little; the first step's loss, computed
    before any update, is the batch's."""
    one = Trainer(_run(corpus, ffn), tmp_path / "one", progress=False).train()
    rows, loss = [], TransformerLM.loss

    def recorded(model, inputs, targets):
        rows.append(inputs.shape[0])
        return loss(model, inputs, targets)
    monkeypatch.setattr(TransformerLM, "loss", recorded)
    parts = Trainer(_run(corpus, ffn, micro_batches), tmp_path / "parts", progress=False).train()
    assert rows == 6 * ([2, 2] if micro_batches == 2 else [2, 1, 1])
    a, b = train_losses(tmp_path / "one"), train_losses(tmp_path / "parts")
    assert b[0] == pytest.approx(a[0], rel=1e-6)
    if ffn == "dense":
        assert b == pytest.approx(a, rel=1e-5)
        x, y = _weights(tmp_path / "one"), _weights(tmp_path / "parts")
        for key in x:
            torch.testing.assert_close(y[key], x[key], rtol=1e-4, atol=1e-5, msg=key)
    else:
        assert b == pytest.approx(a, rel=2e-3)
    assert parts["val"]["loss"] == pytest.approx(one["val"]["loss"], rel=2e-3)


def test_aux_losses_are_the_mean_over_the_micro_batches(corpus, tmp_path):
    """With the aux weight's gradient the only difference, the logged aux loss of the first
    step is the rows-weighted mean of the micro-batches' (measured here by hand)."""
    from sparseffn import aux_loss
    from sparseffn.train.trainer import build_model
    run = _run(corpus, "sigma_moe", 3, steps=1)
    trainer = Trainer(run, tmp_path, progress=False)
    trainer.train()
    logged = [m for m in metrics(tmp_path) if m["kind"] == "train"][0]["aux_loss"]
    torch.manual_seed(run.seed)
    model = build_model(run, trainer.data).train()
    inputs, targets = trainer.data.batch(0, 4, run.model.context, run.seed)
    torch.manual_seed(run.seed)       # (no dropout: the draws do not matter)
    by_hand = 0.0
    for part, part_targets in zip(inputs.tensor_split(3), targets.tensor_split(3)):
        model.loss(part, part_targets)
        by_hand += float(aux_loss(model).detach()) * part.shape[0] / 4
    assert logged == pytest.approx(by_hand, rel=1e-6)


def test_a_micro_batched_run_resumes_to_the_bit(corpus, tmp_path):
    run = _run(corpus, "sigma_moe", 2, dropout=0.1, steps=8)
    assert straight_and_resumed(run, tmp_path, 4)
    assert train_losses(tmp_path / "resumed") == train_losses(tmp_path / "straight")


def test_micro_batches_in_fp16_scale_every_part_and_follow_fp32(corpus, tmp_path):
    Trainer(_run(corpus, "sigma_moe", 2), tmp_path / "fp32", progress=False).train()
    summary = Trainer(_run(corpus, "sigma_moe", 2, fp16=True), tmp_path / "fp16",
                      progress=False).train()
    assert summary["skipped_steps"] == 0
    assert train_losses(tmp_path / "fp16") == pytest.approx(train_losses(tmp_path / "fp32"),
                                                            rel=1e-3)


@pytest.mark.parametrize("fields, message", [
    ({"micro_batches": 0}, "train.micro_batches must be positive"),
    ({"micro_batches": 2.0}, "train.micro_batches must be an integer"),
    ({"micro_batches": 5, "batch_size": 4}, r"train.micro_batches \(5\) must be at most "
                                            r"train.batch_size \(4\)"),
])
def test_micro_batches_config_errors(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainSpec(**fields)
