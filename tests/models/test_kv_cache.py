"""The KV cache: a sequence run in pieces against the cache gives every position the logits a
forward of the whole sequence gives it, for every FFN preset; generation with it draws the
tokens the window draws, across the point where the context fills; a router with an
evaluation capacity (whose outputs a cache would change) runs the window; misuse is named."""

import pytest
import torch

from sparseffn.models import PRESETS
from sparseffn.models.generate import cache_blocker, generate
from sparseffn.models.kv_cache import KVCache, causal_mask
from sparseffn.models.lm import LMConfig, TransformerLM
from sparseffn.routers import SwitchRouterConfig
from sparseffn.layers import MoEConfig

from .test_generate import greedy_by_hand, tiny_lm


def in_pieces(model, tokens, sizes, cache=None):
    """The logits of ``tokens`` [B, T] run as pieces of ``sizes`` against one cache (by
    default a new KV cache)."""
    cache = model.new_kv_cache() if cache is None else cache
    start, logits = 0, []
    for size in sizes:
        logits.append(model(tokens[:, start:start + size], cache=cache))
        start += size
        assert cache.length == start
    return torch.cat(logits, 1)


@pytest.mark.parametrize("ffn", list(PRESETS))
def test_pieces_against_the_cache_give_the_whole_sequences_logits(ffn):
    model = tiny_lm(ffn).eval()
    tokens = torch.randint(0, 20, (3, 12))
    whole = model(tokens)
    # a prompt, single tokens (no mask), a piece of three after cached positions (the mask)
    pieces = in_pieces(model, tokens, [4, 1, 1, 3, 1, 2])
    torch.testing.assert_close(pieces, whole, rtol=1e-5, atol=1e-5)


def test_the_cache_follows_the_autocast_dtype():
    model = tiny_lm("sigma_moe").eval()
    tokens = torch.randint(0, 20, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        whole = model(tokens).float()
        cache = model.new_kv_cache()
        pieces = torch.cat([model(tokens[:, :5], cache=cache)]
                           + [model(tokens[:, i:i + 1], cache=cache) for i in range(5, 9)], 1)
    assert cache.layers[0].keys.dtype == torch.bfloat16
    torch.testing.assert_close(pieces.float(), whole, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("ffn", list(PRESETS))
def test_cached_generation_draws_the_windows_tokens_past_the_context(ffn):
    """Prompt 5, 20 new tokens, context 12: the cache fills after 7 tokens, the window slides
    for the other 13."""
    model = tiny_lm(ffn)
    prompt = torch.randint(0, 20, (3, 5))
    cached = generate(model, prompt, 20, temperature=0, use_cache=True)
    assert torch.equal(cached, generate(model, prompt, 20, temperature=0, use_cache=False))
    assert torch.equal(cached, greedy_by_hand(model, prompt, 20))
    def draws(use_cache):
        return generate(model, prompt, 20, temperature=1.3, top_p=0.95, use_cache=use_cache,
                        generator=torch.Generator().manual_seed(3))
    assert torch.equal(draws(True), draws(False))


def test_each_token_after_the_prompt_runs_alone_while_the_context_has_room():
    model = tiny_lm("dense")
    widths = []
    model.register_forward_pre_hook(lambda _, args, kwargs: widths.append(
        (args[0].shape[1], kwargs.get("cache") is not None)), with_kwargs=True)
    generate(model, torch.randint(0, 20, (2, 5)), 10, temperature=0)
    # the prompt, then 7 tokens alone (positions 5-11, filling the context of 12), after
    # which the 12-token window runs
    assert widths == [(5, True)] + [(1, True)] * 7 + [(12, False)] * 2
    widths.clear()
    generate(model, torch.randint(0, 20, (2, 5)), 3, temperature=0, use_cache=False)
    assert widths == [(5, False), (6, False), (7, False)]


def capacity_lm(eval_capacity_factor):
    torch.manual_seed(0)
    ffn = MoEConfig(d_model=16, num_experts=4, expert_size=16, k=1,
                    router=SwitchRouterConfig(capacity_factor=1.0,
                                              eval_capacity_factor=eval_capacity_factor))
    return TransformerLM(LMConfig(vocab_size=20, d_model=16, n_layers=2, n_heads=2,
                                  context=12, dropout=0.0, ffn=ffn))


def test_a_router_with_an_evaluation_capacity_runs_the_window():
    """Under an evaluation capacity a token's output depends on the tokens run with it: the
    cache would change the logits, so generation runs the window (and refuses use_cache)."""
    model = capacity_lm(0.5).eval()
    tokens = torch.randint(0, 20, (2, 12))
    assert not torch.allclose(in_pieces(model, tokens, [6] + [1] * 6), model(tokens))
    assert cache_blocker(model) == "blocks.0.ffn.router"
    prompt = torch.randint(0, 20, (2, 4))
    assert torch.equal(generate(model, prompt, 10, temperature=0),
                       greedy_by_hand(model, prompt, 10))
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.router routes each token by the "
                                         r"tokens evaluated with it"):
        generate(model, prompt, 10, use_cache=True)
    assert cache_blocker(capacity_lm(None)) is None      # dropless in evaluation: cached


def test_misuse_is_named():
    model = tiny_lm("dense").eval()
    tokens = torch.randint(0, 20, (2, 8))
    cache = model.new_kv_cache()
    model(tokens, cache=cache)
    with pytest.raises(ValueError, match="8 cached and 5 new tokens exceed context=12"):
        model(tokens[:, :5], cache=cache)
    assert cache.length == 8                       # the refused call added nothing
    with pytest.raises(ValueError, match="holds 2 sequences in torch.float32, got 3"):
        model(torch.randint(0, 20, (3, 1)), cache=cache)
    with pytest.raises(ValueError, match="KVCache of 3 layers for a model of 2 blocks"):
        model(tokens, cache=KVCache(3, 12))
    with pytest.raises(ValueError, match="use_cache must be True, False or None"):
        generate(model, tokens, 2, use_cache="yes")
    with pytest.raises(ValueError, match="has no KV cache"):
        generate(_NoCache(model), tokens, 2, use_cache=True)
    assert generate(_NoCache(model), tokens, 2, temperature=0).shape == (2, 10)


class _NoCache(torch.nn.Module):
    """A language model without new_kv_cache (generate runs its window)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, tokens):
        return self.model(tokens)


def test_an_empty_batch_and_a_full_prompt():
    model = tiny_lm("sigma_moe")
    assert generate(model, torch.zeros(0, 3, dtype=torch.long), 4,
                    use_cache=True).shape == (0, 7)
    prompt = torch.randint(0, 20, (2, 12))              # fills the context at once
    assert torch.equal(generate(model, prompt, 3, temperature=0, use_cache=True),
                       greedy_by_hand(model, prompt, 3))


def test_causal_mask_lets_query_i_see_the_past_and_itself():
    mask = causal_mask(3, 2, torch.device("cpu"))
    assert mask.tolist() == [[True, True, True, False, False],
                             [True, True, True, True, False],
                             [True, True, True, True, True]]
    assert causal_mask(1, 7, torch.device("cpu")) is None
