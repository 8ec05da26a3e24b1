"""``sparseffn.skipping_padding``: inside it a routed layer computes only the tokens its mask
keeps, exactly as if the batch held those tokens alone (outputs, aux losses, usage, every
gradient), and the others get zeros; activation checkpointing recomputes the same rows."""

import copy
from contextlib import nullcontext

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import sparseffn
from sparseffn.routing import RoutedFFN
from tests.layers.test_conformance import EXAMPLES, D, _build, _dense_grads

ROUTED = [name for name, config in EXAMPLES.items()
          if isinstance(_build(config), RoutedFFN)]
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]])   # padding either side


def _run(layer, x, mask=None, checkpointed=None):
    """(output, objective) of one seeded training forward, inside the block when ``mask``."""
    torch.manual_seed(3)                 # the same noise, dropout and sampling in every run
    block = sparseffn.skipping_padding(layer, mask) if mask is not None else nullcontext()
    with block:
        y = layer(x) if checkpointed is None else checkpoint(layer, x,
                                                             use_reentrant=checkpointed)
    return y, y.square().sum() + sparseffn.aux_loss(layer)


def _grads(layer, x):
    return [x.grad] + _dense_grads(list(layer.parameters()))


@pytest.mark.parametrize("name", ROUTED)
def test_a_masked_batch_is_computed_as_its_kept_tokens_alone(name):
    keep = MASK.bool()
    masked = _build(EXAMPLES[name]).train()
    x = torch.randn(3, 5, D, requires_grad=True)
    y, objective = _run(masked, x, MASK)
    objective.backward()

    alone = _build(EXAMPLES[name]).train()
    x_kept = x.detach()[keep].requires_grad_()
    y_kept, objective_kept = _run(alone, x_kept)
    objective_kept.backward()

    torch.testing.assert_close(y[keep], y_kept)
    assert torch.equal(y[~keep], torch.zeros_like(y[~keep]))
    assert masked.aux_losses.keys() == alone.aux_losses.keys()
    for loss in masked.aux_losses:
        torch.testing.assert_close(masked.aux_losses[loss], alone.aux_losses[loss])
    torch.testing.assert_close(masked.usage_counts, alone.usage_counts)
    torch.testing.assert_close(masked.usage_mass, alone.usage_mass)
    torch.testing.assert_close(x.grad[keep], x_kept.grad)
    assert torch.equal(x.grad[~keep], torch.zeros_like(x.grad[~keep]))
    for got, want in zip(_dense_grads(list(masked.parameters())),
                         _dense_grads(list(alone.parameters()))):
        torch.testing.assert_close(got, want)
    assert masked._transient.token_mask is None          # the block restored the layer


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("name", ["layer:sigma_moe", "router:switch", "layer:peer"])
def test_checkpointing_recomputes_the_kept_rows_with_the_backward_outside_the_block(name,
                                                                                    reentrant):
    runs = {}
    for checkpointed in (None, reentrant):
        layer = _build(EXAMPLES[name]).train()
        x = torch.randn(3, 5, D, generator=torch.Generator().manual_seed(0)).requires_grad_()
        y, objective = _run(layer, x, MASK, checkpointed)
        objective.backward()          # after the block: the recomputation runs outside it
        runs[checkpointed] = (y.detach(), _grads(layer, x))
    torch.testing.assert_close(runs[reentrant][0], runs[None][0])
    for got, want in zip(runs[reentrant][1], runs[None][1]):
        torch.testing.assert_close(got, want)


def test_a_forward_outside_the_block_computes_every_token_again_and_copies_carry_no_mask():
    layer = _build(EXAMPLES["layer:sigma_moe"]).eval()
    x = torch.randn(3, 5, D)
    with sparseffn.skipping_padding(layer, MASK):
        inside = layer(x)
        copied = copy.deepcopy(layer)
    assert torch.equal(inside[~MASK.bool()], torch.zeros(int((MASK == 0).sum()), D))
    want = layer(x)
    assert (want[~MASK.bool()] != 0).any()
    torch.testing.assert_close(copied(x), want)
    # a checkpointed forward outside the block recomputes every row, not the block's
    layer.train()
    xg = x.clone().requires_grad_()
    torch.manual_seed(3)
    checkpoint(layer, xg, use_reentrant=False).sum().backward()
    assert (xg.grad[~MASK.bool()] != 0).any()


def test_a_flattened_input_takes_the_mask_of_its_unflattened_shape():
    layer = _build(EXAMPLES["router:switch"]).train()
    x = torch.randn(3, 5, D)
    want, _ = _run(layer, x, MASK)
    got, _ = _run(layer, x.reshape(15, D), MASK)       # as OPT flattens its MLP's input
    torch.testing.assert_close(got, want.reshape(15, D))


def test_a_mask_of_the_wrong_shape_is_named():
    layer = _build(EXAMPLES["layer:sigma_moe"])
    with sparseffn.skipping_padding(layer, MASK), \
            pytest.raises(ValueError, match=r"mask has shape \(3, 5\).*input is \(3, 1, 12\)"):
        layer(torch.randn(3, 1, D))       # a decoding step of Hugging Face's generate()
    with pytest.raises(TypeError, match="attention_mask must be a tensor, got list"):
        with sparseffn.skipping_padding(layer, MASK.tolist()):
            pass


def test_an_all_padding_batch_gives_zeros_and_empty_statistics():
    layer = _build(EXAMPLES["router:switch"]).train()
    x = torch.randn(2, 3, D, requires_grad=True)
    with sparseffn.skipping_padding(layer, torch.zeros(2, 3)):
        y = layer(x)
    (y.sum() + sparseffn.aux_loss(layer)).backward()
    assert torch.equal(y, torch.zeros_like(y)) and torch.equal(x.grad, torch.zeros_like(x))
    assert layer.usage_counts.sum() == 0


def test_inside_a_compiled_model_it_computes_what_eager_computes():
    layer = _build(EXAMPLES["layer:sigma_moe"]).train()
    compiled = torch.compile(layer, backend="eager")
    x = torch.randn(3, 5, D)
    with sparseffn.skipping_padding(layer, MASK):
        torch.testing.assert_close(compiled(x), layer(x))
    torch.testing.assert_close(compiled(x), layer(x))    # and every token again after
