"""The decoding program with a KV cache in ONNX (``sparseffn.decoder_to_onnx``) and generation
from it in ONNX Runtime (``sparseffn.OnnxDecoder``): the prompt and each token after it give
the logits of PyTorch's forward of the whole sequence, greedy and sampled generation draw
``generate()``'s tokens past the point where the context fills, the program only reads its
past, float16 works, and misuse is named."""

import pytest
import torch

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

import sparseffn                                              # noqa: E402
from tests.models.test_generate import tiny_lm                # noqa: E402
from tests.models.test_kv_cache import capacity_lm            # noqa: E402
from tests.onnx_release import NEEDS_2_8                      # noqa: E402


def exported(model, folder) -> str:
    path = f"{folder}/decoder.onnx"
    sparseffn.decoder_to_onnx(model).save(path)
    return path


def teacher_forced(decoder, tokens, pieces):
    decoder.reset(tokens.shape[0])
    logits, start = [], 0
    for size in pieces:
        logits.append(decoder.step(tokens[:, start:start + size]))
        start += size
        assert decoder.length == start
    return torch.cat(logits, 1)


def check_decoding(model, path):
    decoder = sparseffn.OnnxDecoder(path)
    assert (decoder.num_layers, decoder.heads, decoder.context, decoder.head_dim,
            decoder.vocab_size) == (2, 2, 12, 8, 20)
    tokens = torch.randint(0, 20, (3, 12))
    with torch.no_grad():
        whole = model(tokens)
    # a prompt, single tokens, a piece of three after cached positions; batches of 3 and 1
    torch.testing.assert_close(teacher_forced(decoder, tokens, [4, 1, 1, 3, 1, 2]), whole,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(teacher_forced(decoder, tokens[:1], [1, 1, 10]), whole[:1],
                               rtol=1e-5, atol=1e-5)
    # 5 + 20 tokens at context 12: the cache, then the window (the draws are generate()'s)
    prompt = torch.randint(0, 20, (2, 5))
    assert torch.equal(decoder.generate(prompt, 20, temperature=0),
                       model.generate(prompt, 20, temperature=0))
    drawn = [generate(prompt, 20, temperature=0.9, top_p=0.9,
                      generator=torch.Generator().manual_seed(1))
             for generate in (decoder.generate, model.generate)]
    assert torch.equal(*drawn)


@NEEDS_2_8
def test_a_sigma_moe_lm_decodes_in_onnx_runtime_reading_its_past(tmp_path):
    """A tiny σ-MoE LM (context 12, vocabulary 20, 2 blocks of 2 heads of 8). In its program
    the past keys and values meet only the attention's products (a Transpose of the keys,
    which ONNX Runtime folds into its MatMul) and Shape: nothing writes or concatenates the
    cache."""
    model = tiny_lm("sigma_moe").eval()
    path = exported(model, tmp_path)
    check_decoding(model, path)
    graph = onnx.load(path).graph
    inputs = [value.name for value in graph.input]
    assert inputs == ["tokens", "positions", "past_keys.0", "past_keys.1", "past_values.0",
                      "past_values.1"]
    assert [value.name for value in graph.output] == [
        "logits", "new_keys.0", "new_keys.1", "new_values.0", "new_values.1"]
    readers = {node.op_type for node in graph.node for name in node.input
               if name.startswith("past_")}
    assert readers <= {"MatMul", "Transpose", "Shape"}, readers     # (Shape: the sizes only)


@pytest.mark.parametrize("ffn", ["pkm", "fff"])
def test_product_keys_and_trees_decode_in_onnx_runtime(ffn, tmp_path):
    model = tiny_lm(ffn).eval()
    check_decoding(model, exported(model, tmp_path))


def test_a_float16_lm_decodes_in_float16(tmp_path):
    """(Product keys: a σ-MoE LM's export takes three times as long, and test_onnx.py runs a
    float16 σ-MoE layer.)"""
    model = tiny_lm("pkm").half().eval()
    decoder = sparseffn.OnnxDecoder(exported(model, tmp_path))
    assert decoder.dtype.__name__ == "float16"
    tokens = torch.randint(0, 20, (2, 12))
    with torch.no_grad():
        whole = model(tokens).float()
    torch.testing.assert_close(teacher_forced(decoder, tokens, [5, 1, 6]), whole,
                               rtol=1e-2, atol=1e-2)


def test_misuse_is_named(tmp_path):
    path = exported(tiny_lm("dense").eval(), tmp_path)
    with pytest.raises(TypeError, match="exports a TransformerLM, got Linear"):
        sparseffn.decoder_to_onnx(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"call model.eval\(\) first"):
        sparseffn.decoder_to_onnx(tiny_lm("dense").train())
    with pytest.raises(ValueError, match=r"blocks\.0\.ffn\.router routes each token by the "
                                         r"tokens evaluated with it"):
        sparseffn.decoder_to_onnx(capacity_lm(0.5).eval())
    decoder = sparseffn.OnnxDecoder(ort.InferenceSession(path))
    with pytest.raises(ValueError, match=r"no cache yet; call reset\(batch\) first"):
        decoder.step(torch.randint(0, 20, (2, 1)))
    decoder.reset(2)
    decoder.step(torch.randint(0, 20, (2, 10)))
    with pytest.raises(ValueError, match="10 cached and 3 new tokens exceed the model's "
                                         "context of 12"):
        decoder.step(torch.randint(0, 20, (2, 3)))
    with pytest.raises(ValueError, match="the cache holds 2 sequences, got 3"):
        decoder.step(torch.randint(0, 20, (3, 1)))
    with pytest.raises(ValueError, match=r"token ids outside \[0, 20\)"):
        decoder.step(torch.tensor([[3], [20]]))
    assert decoder.length == 10                          # refused steps add nothing
    with pytest.raises(ValueError, match="batch must be a positive integer"):
        decoder.reset(0)
    assert decoder.generate(torch.zeros(0, 3, dtype=torch.long), 4).shape == (0, 7)
    layer = sparseffn.to_onnx(torch.nn.Linear(4, 4).eval(), (torch.randn(2, 4),))
    layer.save(str(tmp_path / "layer.onnx"))
    with pytest.raises(ValueError, match="not a program of decoder_to_onnx"):
        sparseffn.OnnxDecoder(tmp_path / "layer.onnx")


def test_without_onnx_runtime_the_error_says_what_to_install(monkeypatch, tmp_path):
    import builtins
    real_import = builtins.__import__

    def no_onnxruntime(name, *args, **kwargs):
        if name == "onnxruntime":
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_onnxruntime)
    from sparseffn.bench.plotting import MissingDependency
    with pytest.raises(MissingDependency,
                       match=r"pip install 'sparseffn\[onnx\]' \(or onnxruntime\)"):
        sparseffn.OnnxDecoder(tmp_path / "decoder.onnx")     # (asked before it is read)
