"""``torch.compile(layer, dynamic=True)``: one graph serves every batch size.

A user whose batches vary in length (the last batch of an epoch, packed sequences, decoding)
compiles with ``dynamic=True`` and expects no recompilation per size. Python arithmetic on a
symbolic size defeats that: a ``range`` over the token count or ``math.log`` of it fixes the
count, and then every new size compiles again (until Dynamo's recompile limit turns the layer
eager). The graph is traced with the ``aot_eager`` backend, which runs Dynamo and AOT
autograd (where the guards come from) without Inductor's code generation, so the check is
fast; Inductor adds no size guards to these layers (checked by hand for every config).

Sizes 0 and 1 are left out on purpose: Dynamo always specialises them. The sizes here also
stay below the thresholds at which a layer picks another path by its batch size, each a
bounded number of graphs rather than one per size: the tree router's padded GEMM from 512
tokens on the CPU, and product-key retrieval's chunks of sub-key scores.
"""

import copy

import pytest
import torch
from torch._dynamo.utils import counters

import sparseffn
from sparseffn.bench.compiled import layer_configs
from sparseffn.requirements import torch_release

SIZES = (37, 64, 5, 300)
# routers that draw random numbers in training; the compiled graph draws them in another order
_RANDOM_IN_TRAINING = {"noisy_topk", "gshard"}


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("name", list(layer_configs(32)))
def test_one_graph_serves_every_batch_size(name, mode):
    _check_one_graph(name, mode == "train", "cpu", "aot_eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["sigma_moe", "sbase", "pkm"])
def test_on_cuda_inductor_compiles_one_graph_for_every_batch_size(name):
    """The same on a GPU with Inductor under bf16 autocast, where the Triton kernels' operators
    (CVMM, S-BASE's Sinkhorn, the product-key top-k and row products) are traced, and Inductor's
    own lowering could add size guards."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        _check_one_graph(name, True, "cuda", "inductor", rtol=2e-2, atol=2e-2)


def _check_one_graph(name: str, training: bool, device: str, backend: str,
                     rtol: float = 1e-5, atol: float = 1e-5) -> None:
    torch.manual_seed(0)
    layer = sparseffn.build_layer(layer_configs(32)[name]).to(device).train(training)
    compiled_layer = copy.deepcopy(layer)
    compiled = torch.compile(compiled_layer, dynamic=True, fullgraph=True, backend=backend)
    compare = not training or name not in _RANDOM_IN_TRAINING
    torch._dynamo.reset()
    counters.clear()
    try:
        for tokens in SIZES:
            x = torch.randn(tokens, 32, device=device)
            x_eager, x_compiled = x.clone().requires_grad_(), x.clone().requires_grad_()
            y_eager, y_compiled = layer(x_eager), compiled(x_compiled)
            (y_eager.float().square().sum() + sparseffn.aux_loss(layer)).backward()
            (y_compiled.float().square().sum() + sparseffn.aux_loss(compiled_layer)).backward()
            assert y_compiled.shape == (tokens, 32)
            assert torch.isfinite(x_compiled.grad).all()
            if compare:
                torch.testing.assert_close(y_compiled, y_eager, rtol=rtol, atol=atol)
                torch.testing.assert_close(x_compiled.grad, x_eager.grad, rtol=10 * rtol,
                                           atol=atol)
        assert counters["stats"]["unique_graphs"] == 1, (
            f"{name} ({'train' if training else 'eval'}, {device}) compiled "
            f"{counters['stats']['unique_graphs']} graphs for {SIZES}")
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("grad", ["grad", "no_grad"])
@pytest.mark.parametrize("name", list(layer_configs(32)))
def test_torch_export_with_a_dynamic_token_count(name, grad, request):
    """``torch.export`` of the layer at inference with the token count dynamic and unbounded,
    with gradients enabled and under ``no_grad`` (where the MLP experts of a few tokens would
    take their own path): a layer that picks a path by batch size takes, for a dynamic size,
    the one that serves every size (``sparseffn/ops/sizes.py``; before, the tree routers and
    product keys exported only up to their thresholds, and every MoE under ``no_grad`` failed
    with "Constraints violated"). The exported program computes what the layer does at sizes
    other than the one traced. PyTorch 2.7 exports only the dense MLP so. (On 2.8 and 2.9 the
    tree routers export their levelwise expansion's PyTorch ops: the test below.)"""
    release = torch_release(torch.__version__)
    if name != "dense" and release < (2, 8):
        request.applymarker(pytest.mark.xfail(
            strict=True, reason="PyTorch 2.7's torch.export loses the token count's symbol "
                                "(\"Source of 's0' is None when lifting it to input of "
                                "top-level\")"))
    with torch.set_grad_enabled(grad == "grad"):
        _check_export(name)


@pytest.mark.parametrize("name", ["tree", "fff_sparse"])
def test_tree_routers_export_their_pytorch_ops_where_the_fused_function_does_not(
        name, monkeypatch):
    """PyTorch 2.8 and 2.9's ``torch.export`` loses a size of the fused levelwise expansion's
    autograd.Function output; there an exported tree router computes the expansion in PyTorch
    ops. That route, taken here on any release, exports and computes what the layer does."""
    if torch_release(torch.__version__) < (2, 8):
        pytest.skip("PyTorch 2.7's torch.export loses the token count's symbol (test above)")
    from sparseffn.ops import fff
    monkeypatch.setattr(fff, "_EXPORT_TAKES_PYTORCH_OPS", True)
    program = _check_export(name)
    ops = {str(node.target) for node in program.graph.nodes}
    assert not any("fff_expand" in op for op in ops), sorted(ops)


def _check_export(name: str) -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    layer = sparseffn.build_layer(layer_configs(32)[name]).eval()
    tokens = torch.export.Dim("tokens", min=2)
    program = torch.export.export(layer, (torch.randn(37, 32),), dynamic_shapes=({0: tokens},))
    for size in (5, 300, 1000):
        x = torch.randn(size, 32)
        with torch.no_grad():
            torch.testing.assert_close(program.module()(x), layer(x), rtol=1e-5, atol=1e-5)
    return program


@pytest.mark.parametrize("preset", ["sbase", "switch", "pkm"])
def test_an_lm_compiles_once_for_any_batch_and_sequence_length(preset):
    """A whole LM (attention, positions, a preset's FFNs; Switch with its capacity):
    training steps at four (batch, length) shapes, one graph, the eager loss and gradients."""
    from sparseffn.models import LMConfig, TransformerLM, ffn_preset
    layout = ffn_preset(preset, 64, 256, 2)
    config = LMConfig(vocab_size=256, d_model=64, n_layers=2, n_heads=4, context=128,
                      ffn=layout.ffn, sparse_every=layout.sparse_every,
                      dense_ffn=layout.dense_ffn)
    torch.manual_seed(0)
    model = TransformerLM(config).train()
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model.loss, dynamic=True, fullgraph=True,
                             backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    try:
        for batch, length in ((3, 37), (4, 64), (2, 100), (5, 21)):
            tokens = torch.randint(0, 256, (batch, length + 1))
            inputs, targets = tokens[:, :-1], tokens[:, 1:]
            model.zero_grad()
            compiled_model.zero_grad()
            loss = model.loss(inputs, targets)
            loss.backward()
            loss_compiled = compiled(inputs, targets)
            loss_compiled.backward()
            torch.testing.assert_close(loss_compiled, loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(compiled_model.embed.weight.grad, model.embed.weight.grad,
                                       rtol=1e-4, atol=1e-6)
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
