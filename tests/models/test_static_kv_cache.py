"""The static KV cache and the Decoder: a forward against a cache of fixed shapes gives every
position the whole sequence's logits, for every FFN preset; the Decoder draws the tokens
generate() draws, across the point where the context fills; its steps trace to one graph
each (no graph break, no new graph as the position grows), so torch.compile and CUDA graphs
can run them; misuse is named."""

import pytest
import torch

import sparseffn
from sparseffn.models import PRESETS, Decoder
from sparseffn.models.generate import generate

from .test_generate import greedy_by_hand, tiny_lm
from .test_kv_cache import _NoCache, capacity_lm, in_pieces
from tests.device_spy import made_off_device, off_device


@pytest.mark.parametrize("ffn", list(PRESETS))
def test_pieces_against_the_static_cache_give_the_whole_sequences_logits(ffn):
    model = tiny_lm(ffn).eval()
    tokens = torch.randint(0, 20, (3, 12))
    pieces = in_pieces(model, tokens, [4, 1, 1, 3, 1, 2], model.new_static_kv_cache(3))
    torch.testing.assert_close(pieces, model(tokens), rtol=1e-5, atol=1e-5)


def test_forward_at_writes_its_positions_only_and_advances_nothing():
    model = tiny_lm("dense").eval()
    cache = model.new_static_kv_cache(2)
    tokens = torch.randint(0, 20, (2, 12))
    model(tokens[:, :5], cache=cache)
    before = [k.clone() for k in cache.keys]
    logits = model.forward_at(tokens[:, 5:6], torch.tensor([5]), cache)
    torch.testing.assert_close(logits, model(tokens[:, :6])[:, 5:], rtol=1e-5, atol=1e-5)
    assert cache.length == 5                        # the caller's count, not forward_at's
    for old, new in zip(before, cache.keys):
        assert torch.equal(old[:, :, :5], new[:, :, :5])
        assert not torch.equal(old[:, :, 5], new[:, :, 5])
        assert torch.equal(new[:, :, 6:], torch.zeros_like(new[:, :, 6:]))


def test_the_static_cache_follows_autocast_and_refuses_another_dtype():
    model = tiny_lm("sigma_moe").eval()
    tokens = torch.randint(0, 20, (2, 9))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cache = model.new_static_kv_cache(2)
        whole = model(tokens).float()
        pieces = torch.cat([model(tokens[:, :5], cache=cache)]
                           + [model(tokens[:, i:i + 1], cache=cache) for i in range(5, 9)], 1)
    assert cache.dtype == torch.bfloat16
    torch.testing.assert_close(pieces.float(), whole, rtol=0.05, atol=0.05)
    float_cache = model.new_static_kv_cache(2)
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(ValueError, match="holds torch.float32, the attention computes "
                                            "torch.bfloat16"):
        model(tokens, cache=float_cache)


def test_reset_empties_the_cache_and_leaves_no_nan_behind():
    """The one-token step attends over every position under a mask; a NaN left at a
    position not yet written would reach the output through the masked product, so reset
    zeroes the memory."""
    model = tiny_lm("sigma_moe").eval()
    tokens = torch.randint(0, 20, (2, 6))
    cache = model.new_static_kv_cache(2)
    model(tokens, cache=cache)
    for tensor in cache.keys + cache.values:
        tensor.fill_(float("nan"))
    cache.reset()
    assert cache.length == 0
    pieces = torch.cat([model(tokens[:, :3], cache=cache), model(tokens[:, 3:4], cache=cache)], 1)
    torch.testing.assert_close(pieces, model(tokens[:, :4]), rtol=1e-5, atol=1e-5)


def test_static_cache_misuse_is_named():
    model = tiny_lm("dense").eval()
    tokens = torch.randint(0, 20, (2, 8))
    cache = model.new_static_kv_cache(2)
    model(tokens, cache=cache)
    with pytest.raises(ValueError, match="8 cached and 5 new tokens exceed the model's context "
                                         "of 12"):
        model(tokens[:, :5], cache=cache)
    assert cache.length == 8                       # the refused call added nothing
    with pytest.raises(ValueError, match="holds 2 sequences, got 3"):
        model(torch.randint(0, 20, (3, 1)), cache=cache)
    other = tiny_lm("dense").eval()
    other.blocks.append(other.blocks[0])
    with pytest.raises(ValueError, match="a StaticKVCache of 3 layers for a model of 2 blocks"):
        model(tokens, cache=other.new_static_kv_cache(2))
    for batch in (0, 1.5, True):
        with pytest.raises(ValueError, match="batch must be a positive integer"):
            model.new_static_kv_cache(batch)


@pytest.mark.parametrize("ffn", list(PRESETS))
def test_the_decoder_draws_generates_tokens_past_the_context(ffn):
    """Prompt 5, 20 new tokens, context 12: the one-token step runs 7 times, the window 13;
    a second call on the same decoder (the cache reset) draws the same again."""
    model = tiny_lm(ffn)
    prompt = torch.randint(0, 20, (3, 5))
    decoder = Decoder(model, 3)
    greedy = decoder.generate(prompt, 20, temperature=0)
    assert torch.equal(greedy, greedy_by_hand(model, prompt, 20))
    assert torch.equal(decoder.generate(prompt, 20, temperature=0), greedy)

    def draws(sample):
        return sample(prompt, 20, temperature=1.3, top_p=0.95,
                      generator=torch.Generator().manual_seed(3))
    assert torch.equal(draws(decoder.generate),
                       draws(lambda *a, **k: generate(model, *a, use_cache=False, **k)))


def counting_compile(monkeypatch):
    """torch.compile through a backend that counts the graphs it is given and runs them
    as traced (Dynamo alone: a graph break or a guard on the position shows, fast)."""
    graphs = []
    real_compile = torch.compile

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def compile(fn, mode=None, **kwargs):
        assert kwargs.get("fullgraph") and kwargs.get("dynamic") is False
        return real_compile(fn, backend=backend, **kwargs)
    monkeypatch.setattr(torch, "compile", compile)
    torch._dynamo.reset()
    return graphs


@pytest.mark.parametrize("ffn", list(PRESETS))
def test_the_decoders_steps_are_one_graph_each_at_every_position(ffn, monkeypatch):
    """Every layer's evaluation path traces without a graph break (fullgraph), and the
    one-token step is one graph for positions 5..11, the window one more: nothing in either
    depends on the position or the sequence's length on the host."""
    graphs = counting_compile(monkeypatch)
    model = tiny_lm(ffn)
    prompt = torch.randint(0, 20, (2, 5))
    decoder = Decoder(model, 2, compile="default")
    tokens = decoder.generate(prompt, 20, temperature=0)
    assert len(graphs) == 2
    assert torch.equal(tokens, greedy_by_hand(model, prompt, 20))
    decoder.generate(torch.randint(0, 20, (2, 3)), 15, temperature=0)
    assert len(graphs) == 2


def test_a_batch_of_one_is_one_graph_too(monkeypatch):
    """A slice [1, 1] of the sequences is contiguous whatever its strides, and its first
    stride is the sequence's length: the step is given a fresh copy, or each position would
    be a new graph."""
    graphs = counting_compile(monkeypatch)
    model = tiny_lm("sigma_moe")
    Decoder(model, 1, compile="default").generate(torch.randint(0, 20, (1, 2)), 16,
                                                  temperature=0)
    assert len(graphs) == 2


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_the_inductor_compiled_decoder_draws_the_eager_tokens(mode):
    """The compiled steps (on the CPU, "reduce-overhead" compiles as "default": no CUDA
    graphs) write the cache in place and draw what the eager decoder draws."""
    torch._dynamo.reset()
    model = tiny_lm("sigma_moe")
    prompt = torch.randint(0, 20, (2, 5))
    compiled = Decoder(model, 2, compile=mode)
    assert torch.equal(compiled.generate(prompt, 12, temperature=0),
                       Decoder(model, 2).generate(prompt, 12, temperature=0))
    assert compiled.cache.length == 12                   # the context: the window ran too


@pytest.mark.parametrize("ffn", list(PRESETS))
def test_the_training_and_decoding_steps_make_every_tensor_on_the_inputs_device(ffn):
    """What CUDA graphs need of the steps they capture, checked without a GPU: no tensor made
    without a device (tests/device_spy.py) in a training step (loss, aux losses, backward) or
    in a decode step, nor among the statistics and aux losses the layers keep."""
    model = tiny_lm(ffn)
    tokens = torch.randint(0, 20, (2, 8))
    cache, position = model.new_static_kv_cache(2), torch.full((1,), 5)
    with made_off_device() as made:
        (model.loss(tokens[:, :-1], tokens[:, 1:]) + sparseffn.aux_loss(model)).backward()
        kept = _kept_by_layers(model)
        with torch.no_grad():
            model.eval()(tokens[:, :5], cache=cache)
            model.forward_at(tokens[:, 5:6], position, cache)
    assert made == [] and off_device(kept | _kept_by_layers(model)) == {}


def _kept_by_layers(model):
    return {f"{name}/{key}": value for name, stats in sparseffn.routing_stats(model).items()
            for key, value in stats.items()} | sparseffn.aux_loss_terms(model)


def test_decoder_misuse_is_named():
    model = tiny_lm("dense")
    with pytest.raises(ValueError, match="compile must be one of none, default, "
                                         "reduce-overhead"):
        Decoder(model, 2, compile="max")
    with pytest.raises(ValueError, match="has no static KV cache"):
        Decoder(_NoCache(model), 2)
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.router routes each token by the "
                                         r"tokens evaluated with it"):
        Decoder(capacity_lm(0.5), 2)
    decoder = Decoder(model, 2)
    with pytest.raises(ValueError, match="made for 2 sequences, the prompt holds 3"):
        decoder.generate(torch.randint(0, 20, (3, 4)), 5)
    with pytest.raises(ValueError, match="prompt must hold at least one token"):
        decoder.generate(torch.zeros(2, 0, dtype=torch.long), 5)
    with pytest.raises(ValueError, match="top_p must lie in"):
        decoder.generate(torch.randint(0, 20, (2, 4)), 5, top_p=0.0)
    prompt = torch.randint(0, 20, (2, 14))          # longer than the context: its last 12
    assert torch.equal(decoder.generate(prompt, 3, temperature=0),
                       greedy_by_hand(model, prompt, 3))


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("ffn", list(PRESETS))
def test_on_cuda_the_one_token_step_reads_nothing_on_the_host(ffn):
    """What CUDA graphs need of the step: no synchronisation, in bf16 as decoding runs."""
    model = tiny_lm(ffn).cuda().eval()
    tokens = torch.randint(0, 20, (2, 6), device="cuda")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        cache = model.new_static_kv_cache(2)
        model(tokens[:, :5], cache=cache)
        position = torch.full((1,), 5, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            model.forward_at(tokens[:, 5:], position, cache)
        finally:
            torch.cuda.set_sync_debug_mode("default")


@needs_cuda
@pytest.mark.parametrize("ffn", ["sigma_moe", "switch", "glam", "fff_sparse", "pkm", "peer"])
def test_on_cuda_the_decoder_replays_cuda_graphs_and_draws_the_eager_tokens(ffn):
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = tiny_lm(ffn).cuda()
    prompt = torch.randint(0, 20, (2, 5), device="cuda")
    graphed = Decoder(model, 2, compile="reduce-overhead")
    for _ in range(2):         # the second call replays what the first recorded
        tokens = graphed.generate(prompt, 20, temperature=0)
    assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
    assert torch.equal(tokens, Decoder(model, 2).generate(prompt, 20, temperature=0))
