"""TransformerLM.forward_with_past, the functional forward with a KV cache (the program the ONNX
decoder exports): a sequence run in pieces, the caller storing each piece's keys and values,
gives every position the logits of a forward of the whole sequence, for every FFN preset; the
past is only read; slots an earlier sequence left are masked out, overwritten ones too; the
new tokens may come in any order of positions; misuse is named."""

import pytest
import torch

from sparseffn.models import PRESETS

from .test_generate import tiny_lm


def empty_past(model, batch, fill=0.0):
    """One [batch, heads, context, d_head] tensor of ``fill`` per block, keys and values."""
    config = model.config
    shape = (batch, config.n_heads, config.context, config.d_model // config.n_heads)
    return ([torch.full(shape, fill) for _ in model.blocks],
            [torch.full(shape, fill) for _ in model.blocks])


def in_pieces(model, tokens, sizes, keys, values):
    """The logits of ``tokens`` run as pieces of ``sizes``, each piece's keys and values stored
    into ``keys`` / ``values`` at its positions as a caller would."""
    start, logits = 0, []
    for size in sizes:
        positions = torch.arange(start, start + size)
        before = [k.clone() for k in keys]
        piece, new_keys, new_values = model.forward_with_past(
            tokens[:, start:start + size], positions, keys, values)
        assert all(torch.equal(k, b) for k, b in zip(keys, before))     # only read
        assert new_keys[0].shape == (tokens.shape[0], model.config.n_heads, size,
                                     model.config.d_model // model.config.n_heads)
        for past, new in zip(keys + values, new_keys + new_values):
            past[:, :, start:start + size] = new
        logits.append(piece)
        start += size
    return torch.cat(logits, 1)


@pytest.mark.parametrize("ffn", list(PRESETS))
def test_pieces_give_the_whole_sequences_logits_and_the_caches_keys(ffn):
    model = tiny_lm(ffn).eval()
    tokens = torch.randint(0, 20, (3, 12))
    with torch.no_grad():
        whole = model(tokens)
        cache = model.new_kv_cache()
        model(tokens, cache=cache)
        # slots an earlier sequence left (finite, not zeros) are never seen
        keys, values = empty_past(model, 3, fill=7.0)
        pieces = in_pieces(model, tokens, [4, 1, 1, 3, 1, 2], keys, values)
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)
    for layer, k, v in zip(cache.layers, keys, values):
        torch.testing.assert_close(k, layer.keys, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(v, layer.values, rtol=1e-5, atol=1e-6)


def test_overwritten_slots_are_masked_and_positions_may_come_in_any_order():
    model = tiny_lm("sigma_moe").eval()
    first, second = torch.randint(0, 20, (2, 2, 12))
    with torch.no_grad():
        keys, values = empty_past(model, 2)
        in_pieces(model, first, [12], keys, values)         # a full cache of another sequence
        # the window of the second, written over it: the first's keys sit in every slot
        window, _, _ = model.forward_with_past(second, torch.arange(12), keys, values)
        torch.testing.assert_close(window, model(second), rtol=1e-5, atol=1e-5)
        # a prefix, then the rest given in a shuffled order of positions
        keys, values = empty_past(model, 2)
        in_pieces(model, second, [5], keys, values)
        order = torch.tensor([9, 5, 11, 7, 6, 10, 8])
        shuffled, _, _ = model.forward_with_past(second[:, order], order, keys, values)
    torch.testing.assert_close(shuffled, model(second)[:, order], rtol=1e-5, atol=1e-5)


def test_under_autocast_the_past_is_in_autocasts_dtype():
    model = tiny_lm("sigma_moe").eval()
    tokens = torch.randint(0, 20, (2, 9))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        whole = model(tokens).float()
        keys, values = empty_past(model, 2)
        keys = [k.bfloat16() for k in keys]
        values = [v.bfloat16() for v in values]
        pieces = in_pieces(model, tokens, [5, 1, 3], keys, values).float()
    torch.testing.assert_close(pieces, whole, rtol=0.05, atol=0.05)


def test_an_empty_batch_and_misuse():
    model = tiny_lm("sigma_moe").eval()
    keys, values = empty_past(model, 0)
    logits, new_keys, _ = model.forward_with_past(torch.zeros(0, 3, dtype=torch.long),
                                                  torch.arange(3), keys, values)
    assert logits.shape == (0, 3, 20) and new_keys[0].shape == (0, 2, 3, 8)
    tokens = torch.randint(0, 20, (2, 3))
    keys, values = empty_past(model, 2)
    with pytest.raises(ValueError, match="1 past keys and 2 past values for a model of 2 "
                                         "blocks"):
        model.forward_with_past(tokens, torch.arange(3), keys[:1], values)
    with pytest.raises(ValueError, match="the past keys are torch.float16, the attention "
                                         "computes torch.float32"):
        model.forward_with_past(tokens, torch.arange(3), [k.half() for k in keys], values)
