"""Sampling from a TransformerLM: greedy decoding equals the arg-max loop written out, draws
follow the truncated softmax, the window slides past the context, and bad arguments are
named."""

import math

import pytest
import torch

from sparseffn.models.generate import Decoder, generate, next_token_distribution
from sparseffn.models.lm import LMConfig, TransformerLM
from sparseffn.models.presets import ffn_preset


def tiny_lm(ffn="sigma_moe", context=12, seed=0):
    torch.manual_seed(seed)
    layout = ffn_preset(ffn, 16, 64, 2)
    return TransformerLM(LMConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2,
                                  context=context, dropout=0.1, ffn=layout.ffn,
                                  sparse_every=layout.sparse_every,
                                  dense_ffn=layout.dense_ffn))


def greedy_by_hand(model, prompt, new):
    model.eval()
    tokens = prompt
    for _ in range(new):
        logits = model(tokens[:, -model.config.context:])[:, -1]
        tokens = torch.cat([tokens, logits.argmax(-1, keepdim=True)], dim=1)
    return tokens


@pytest.mark.parametrize("ffn", ["dense", "sigma_moe", "switch", "fff", "pkm", "peer"])
def test_greedy_is_the_argmax_loop_and_slides_past_the_context(ffn):
    model = tiny_lm(ffn).train()
    prompt = torch.randint(0, 20, (3, 5))
    out = model.generate(prompt, 20, temperature=0)       # 25 tokens, context 12
    assert model.training                                  # its mode is restored
    assert out.shape == (3, 25) and out.dtype == torch.long
    assert torch.equal(out[:, :5], prompt)
    assert torch.equal(out, greedy_by_hand(model, prompt, 20))
    assert torch.equal(model.generate(prompt, 20, top_k=1), out)   # top-1 is greedy too


def test_a_prompt_longer_than_the_context_is_read_from_its_end():
    model = tiny_lm()
    prompt = torch.randint(0, 20, (2, 30))
    out = generate(model, prompt, 4, temperature=0)
    tail = generate(model, prompt[:, -12:], 4, temperature=0)
    assert torch.equal(out[:, :30], prompt) and torch.equal(out[:, 30:], tail[:, 12:])


def test_draws_are_reproducible_by_generator_and_differ_between_seeds():
    model = tiny_lm()
    prompt = torch.zeros(4, 1, dtype=torch.long)
    def draw(seed):
        return generate(model, prompt, 30, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(draw(1), draw(1))
    assert not torch.equal(draw(1), draw(2))


def test_sampled_tokens_follow_the_truncated_softmax():
    """4,000 draws of one token from fixed logits: the frequencies match the distribution
    (total variation under 0.04; the sampling error is about 0.01), and no token outside
    top-k / the nucleus is ever drawn."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    for kwargs in [{}, {"temperature": 0.5}, {"temperature": 2.0}, {"top_k": 3},
                   {"top_p": 0.8}, {"top_k": 4, "top_p": 0.9, "temperature": 1.5}]:
        probs = next_token_distribution(logits, **{"temperature": 1.0, **kwargs})[0]
        draws = torch.multinomial(probs.expand(4000, -1), 1,
                                  generator=torch.Generator().manual_seed(0))[:, 0]
        freq = torch.bincount(draws, minlength=6).float() / 4000
        assert 0.5 * (freq - probs).abs().sum() < 0.04, kwargs
        assert not freq[probs == 0].any()
    expected = (logits[0] / 0.5).softmax(-1)
    torch.testing.assert_close(next_token_distribution(logits, 0.5)[0], expected)


def test_truncation_keeps_what_the_definitions_say():
    logits = torch.tensor([[3.0, 1.0, 1.0, 0.0, -1.0]])
    p = logits.softmax(-1)[0]
    top2 = next_token_distribution(logits, top_k=2)[0]
    assert (top2 > 0).tolist() == [True, True, True, False, False]   # a tie at k: both kept
    torch.testing.assert_close(top2.sum(), torch.tensor(1.0))
    # the nucleus: tokens in order of probability until their mass reaches top_p
    nucleus = next_token_distribution(logits, top_p=float(p[0]) + 1e-4)[0]
    assert (nucleus > 0).sum() == 2
    assert (next_token_distribution(logits, top_p=float(p[0]) - 1e-4)[0] > 0).sum() == 1
    assert torch.equal(next_token_distribution(logits, top_p=1.0), logits.softmax(-1))
    assert torch.equal(next_token_distribution(logits, temperature=0),
                       torch.tensor([[1.0, 0, 0, 0, 0]]))


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": math.nan}, "temperature"),
    ({"top_k": 0}, "top_k"), ({"top_k": 2.5}, "top_k"),
    ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
])
def test_bad_sampling_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny_lm(), torch.zeros(1, 1, dtype=torch.long), 3, **kwargs)


@pytest.mark.parametrize("prompt, new, message", [
    (torch.zeros(1, 0, dtype=torch.long), 3, "at least one token"),
    (torch.zeros(3, dtype=torch.long), 3, "batch, time"),
    (torch.zeros(1, 2), 3, "int64"),
    (torch.tensor([[1, 20]]), 3, r"outside \[0, 20\)"),
    (torch.tensor([[-1]]), 3, "outside"),
    (torch.zeros(1, 1, dtype=torch.long), -1, "max_new_tokens"),
])
def test_bad_prompts_are_named(prompt, new, message):
    with pytest.raises(ValueError, match=message):
        generate(tiny_lm(), prompt, new)


def test_zero_new_tokens_returns_the_prompt_and_an_empty_batch_stays_empty():
    model = tiny_lm()
    prompt = torch.randint(0, 20, (2, 3))
    assert torch.equal(generate(model, prompt, 0), prompt)
    assert generate(model, torch.zeros(0, 3, dtype=torch.long), 4).shape == (0, 7)


def _positions_counted(model):
    """Per sparse layer, how many token positions its accumulated usage counted (each sends
    a position to ``k`` experts)."""
    return [int(layer.usage_counts.sum().item()) // layer.router.k
            for layer in model.modules() if hasattr(layer, "usage_counts")]


@pytest.mark.parametrize("use_cache, positions", [(True, 5 + 5), (False, 5 + 6 + 7 + 8 + 9 + 10)],
                         ids=["cache", "window"])
def test_generation_counts_usage_only_when_asked(use_cache, positions):
    """By default generating leaves the layers' usage statistics as they were; with
    ``record_usage=True`` each forward counts: with the cache the prompt once and each new
    token once (the last drawn token never runs), without it the whole window at every step.
    The tokens are the same either way."""
    model = tiny_lm()
    prompt = torch.randint(0, 20, (3, 5))
    out = generate(model, prompt, 6, temperature=0, use_cache=use_cache)
    assert _positions_counted(model) == [0, 0]
    counted = generate(model, prompt, 6, temperature=0, use_cache=use_cache, record_usage=True)
    assert torch.equal(counted, out)
    assert _positions_counted(model) == [3 * positions] * 2
    assert all(layer.counts_usage for layer in model.modules() if hasattr(layer, "usage_counts"))


def test_the_decoder_counts_usage_only_when_asked():
    model = tiny_lm()
    prompt = torch.randint(0, 20, (2, 4))
    decoder = Decoder(model, batch=2)
    out = decoder.generate(prompt, 5, temperature=0)
    assert _positions_counted(model) == [0, 0]
    assert torch.equal(decoder.generate(prompt, 5, temperature=0, record_usage=True), out)
    assert _positions_counted(model) == [2 * (4 + 4)] * 2
