"""ONNX export (``sparseffn.to_onnx``): every layer, a whole language model and a sparsified
Hugging Face model run in ONNX Runtime and compute what they compute in PyTorch, at token
counts other than the one traced (other routings), an empty batch, and with NaN in a token."""

import tempfile
import warnings

import pytest
import torch

ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import sparseffn                                              # noqa: E402
from sparseffn import onnx_export                             # noqa: E402
from sparseffn.ops import kernels, portable, sizes            # noqa: E402
from sparseffn.requirements import torch_release              # noqa: E402
from tests.layers.test_conformance import D, EXAMPLES, _build  # noqa: E402
from tests.onnx_release import NEEDS_2_8, example              # noqa: E402


def _session(program) -> "ort.InferenceSession":
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/model.onnx"
        program.save(path)
        return ort.InferenceSession(path)


def _run(session, *inputs: torch.Tensor) -> list[torch.Tensor]:
    feeds = {arg.name: x.numpy() for arg, x in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(out) for out in session.run(None, feeds)]


def _check_outputs(session, module: torch.nn.Module, counts: tuple[int, ...]) -> None:
    """The session gives ``module``'s eager outputs at each of ``counts`` tokens."""
    for n in counts:
        x = torch.randn(n, D)
        with torch.no_grad():
            want = module(x)
        got, = _run(session, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _check_token_counts(session, module: torch.nn.Module, counts: tuple[int, ...]) -> None:
    """:func:`_check_outputs` at each of ``counts`` tokens, and the same at 9 tokens with a
    NaN in token 3, which stays in its row."""
    _check_outputs(session, module, counts)
    x = torch.randn(9, D)
    x[3, 2] = float("nan")
    with torch.no_grad():
        want = module(x)
    got, = _run(session, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(got).any(1).nonzero().flatten().tolist() == [3]


def _op_types(graph) -> set[str]:
    """The op types of an ONNX graph's nodes and of its subgraphs' (an ``If``'s branches)."""
    return {node.op_type for node in graph.node} | {
        op for node in graph.node for a in node.attribute if a.g.node
        for op in _op_types(a.g)}


@pytest.mark.parametrize("name", [example(name) for name in EXAMPLES])
def test_every_layer_runs_in_onnx_runtime_at_any_token_count(name, monkeypatch):
    """Traced at 37 tokens with the count dynamic; run at 0, 1, 4, 5 and 300 tokens and at 9
    with a NaN in token 3, which stays in its row. The layer's eager outputs, one output.

    Exported for any token count at inference, an expert MLP is an ``If``: the pairs read
    straight from the weights up to ``few_pairs_tokens`` tokens, the dispatch plan above, as
    eager inference chooses. With the bound lowered to 4 tokens (in eager mode too), both
    branches run here; the pairs' branch has no NonZero (no block per expert)."""
    import importlib
    for module in map(importlib.import_module, ["sparseffn.ops.expert_mlp",
                                                "sparseffn.stores.mlp"]):
        monkeypatch.setattr(module, "few_pairs_tokens", lambda *args: 4)
    torch.manual_seed(0)
    layer = _build(EXAMPLES[name]).eval()
    tokens = torch.export.Dim("tokens", min=2)
    program = sparseffn.to_onnx(layer, (torch.randn(37, D),), dynamic_shapes=({0: tokens},))
    choices = [node for node in program.model_proto.graph.node if node.op_type == "If"]
    if isinstance(layer, sparseffn.MoE):      # an expert MLP (FFF's leaves are not chosen so)
        choice, = choices
        pairs = next(a.g for a in choice.attribute if a.name == "then_branch")
        assert "NonZero" not in {node.op_type for node in pairs.node}
    session = _session(program)
    assert len(session.get_outputs()) == 1
    _check_token_counts(session, layer, (0, 1, 4, 5, 300))


@pytest.mark.parametrize("name", [example(n) for n in ("layer:sigma_moe", "layer:pkm",
                                                         "layer:fff")])
def test_a_float16_layer_runs_in_onnx_runtime(name):
    """A layer in float16 (``.half()``): a float16 graph, the layer's outputs to float16's
    rounding."""
    torch.manual_seed(0)
    layer = _build(EXAMPLES[name]).half().eval()
    tokens = torch.export.Dim("tokens", min=2)
    session = _session(sparseffn.to_onnx(layer, (torch.randn(37, D).half(),),
                                         dynamic_shapes=({0: tokens},)))
    x = torch.randn(300, D).half()
    with torch.no_grad():
        want = layer(x)
    got, = _run(session, x)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-2, atol=2e-3)


@pytest.mark.parametrize("mixture", ["jacobs", "deep"])
def test_the_classic_mixtures_run_in_onnx_runtime(mixture):
    """Jacobs et al. 1991's mixture of experts and Eigen et al. 2013's deep mixture."""
    from sparseffn.layers.classic import DeepMixtureOfExperts, MixtureOfExperts
    torch.manual_seed(0)
    model = (MixtureOfExperts(8, 3, 4) if mixture == "jacobs" else
             DeepMixtureOfExperts(8, 3)).eval()
    batch = torch.export.Dim("batch", min=2)
    session = _session(sparseffn.to_onnx(model, (torch.randn(5, 8),),
                                         dynamic_shapes=({0: batch},)))
    x = torch.randn(33, 8)
    with torch.no_grad():
        want = model(x)
    got, = _run(session, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@NEEDS_2_8
def test_a_tree_with_hard_inference_runs_in_onnx_runtime():
    """FFF's greedy descent at inference (``eval_mode="hard"``, Belcak & Wattenhofer): the
    one operator no conformance layer calls in evaluation."""
    torch.manual_seed(0)
    layer = sparseffn.build_layer(sparseffn.FFFConfig(d_model=D, depth=3, leaf_width=4,
                                                      eval_mode="hard")).eval()
    tokens = torch.export.Dim("tokens", min=2)
    session = _session(sparseffn.to_onnx(layer, (torch.randn(37, D),),
                                         dynamic_shapes=({0: tokens},)))
    x = torch.randn(300, D)
    with torch.no_grad():
        want = layer(x)
    got, = _run(session, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@NEEDS_2_8
@pytest.mark.parametrize("router", ["switch", "gshard", "gshard_groups"])
def test_capacity_at_inference_exports_for_any_token_count(router):
    """Switch and GShard with an ``eval_capacity_factor`` (Fedus et al. 2022; Lepikhin et al.
    2020): the capacity follows the token count in the program (it was fixed to the traced
    count's, and the buffer positions' binary search had no ONNX form). At 300 tokens the
    capacity drops pairs: the outputs differ from the same layer's without one."""
    def layer(eval_capacity_factor):
        kind = (sparseffn.SwitchRouterConfig if router == "switch" else
                sparseffn.GShardRouterConfig)
        options = {"group_size": 64} if router == "gshard_groups" else {}
        torch.manual_seed(0)
        return sparseffn.build_layer(sparseffn.MoEConfig(
            d_model=D, num_experts=4, expert_size=8, k=1 if router == "switch" else 2,
            router=kind(capacity_factor=1.0, eval_capacity_factor=eval_capacity_factor,
                        **options))).eval()
    capped, dropless = layer(1.0), layer(None)
    tokens = torch.export.Dim("tokens", min=2)
    session = _session(sparseffn.to_onnx(capped, (torch.randn(37, D),),
                                         dynamic_shapes=({0: tokens},)))
    for size in (5, 300):
        x = torch.randn(size, D)
        with torch.no_grad():
            want = capped(x)
        got, = _run(session, x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        assert not torch.allclose(want, dropless(x))


@NEEDS_2_8
def test_many_experts_export_as_blocks_and_run_in_onnx_runtime():
    """Above ``PER_EXPERT_PRODUCTS_UP_TO`` experts the expert products are exported as one
    batched product over blocks of each expert's rows: a Switch layer of 40 experts with a
    capacity at inference (dropped pairs) gives its outputs at 0, 1 and 300 tokens and at 9
    with a NaN, and its graph has no NonZero (no product per expert)."""
    from sparseffn.ops import portable
    experts = portable.PER_EXPERT_PRODUCTS_UP_TO + 8
    torch.manual_seed(0)
    layer = sparseffn.build_layer(sparseffn.MoEConfig(
        d_model=D, num_experts=experts, expert_size=4, k=1,
        router=sparseffn.SwitchRouterConfig(capacity_factor=1.0, eval_capacity_factor=0.5))
    ).eval()
    program = sparseffn.to_onnx(layer, (torch.randn(37, D),),
                                dynamic_shapes=({0: torch.export.Dim("tokens", min=2)},))
    assert "NonZero" not in _op_types(program.model_proto.graph)
    _check_token_counts(_session(program), layer, (0, 1, 300))
    with torch.no_grad():    # at 300 tokens the capacity drops pairs
        x = torch.randn(300, D)
        assert (layer(x) == 0).all(1).any()


class _TopK(torch.nn.Module):
    def forward(self, scores_a, scores_b):
        return (*kernels.topk_rows(scores_a, 3), *kernels.product_key_topk(scores_a, scores_b, 5))


def test_equal_scores_rank_by_index_in_onnx_runtime():
    """The operators order equal scores by index; ONNX's TopK does the same for the forms'
    ``torch.topk``. Integer-valued scores (many ties) and +inf, which ranks as a huge number
    whose sums with the other half round to one value."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 3, (6, 8), generator=gen).float()
    b = torch.randint(0, 3, (6, 7), generator=gen).float()
    a[1, 2] = a[4, 5] = float("inf")
    rows = torch.export.Dim("rows", min=2)
    session = _session(sparseffn.to_onnx(_TopK(), (a, b), dynamic_shapes=({0: rows}, {0: rows})))
    for got, want in zip(_run(session, a, b), _TopK()(a, b)):
        assert torch.equal(got, want)


def test_training_mode_is_refused_by_name():
    layer = _build(EXAMPLES["layer:sigma_moe"]).train()
    with pytest.raises(ValueError, match=r"model.eval\(\).*<model>"):
        sparseffn.to_onnx(layer, (torch.randn(5, D),))


@NEEDS_2_8
def test_torch_onnx_export_alone_exports_the_sparse_layers():
    """``torch.onnx.export(model, args, dynamo=True)``, nothing of sparseffn's in the call and
    gradients enabled: its capture traces each operator as its portable form and each layer
    as inference (the expert MLP's ``If``), and the program gives the layers' outputs at
    other token counts, an empty batch and with a NaN in a token (in its row only)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_build(EXAMPLES[name]) for name in
                                  ("layer:sigma_moe", "layer:pkm", "layer:fff"))).eval()
    tokens = torch.export.Dim("tokens", min=2)
    program = torch.onnx.export(model, (torch.randn(37, D),), dynamo=True, verbose=False,
                                dynamic_shapes=({0: tokens},))
    targets = {str(node.target) for node in program.exported_program.graph.nodes}
    assert not [target for target in targets if target.startswith("sparseffn.")]
    if torch_release(torch.__version__) >= (2, 9):
        # (2.8's torch.export reads grad mode as on inside the layer's no_grad block: the
        # program has the plan alone, which gives the same outputs)
        assert "If" in _op_types(program.model_proto.graph)
    _check_token_counts(_session(program), model, (1, 300, 0))
    # the forms stay with the export: torch.export alone still keeps the operators
    program = torch.export.export(model, (torch.randn(37, D),))
    assert any(str(node.target).startswith("sparseffn.") for node in program.graph.nodes)


@pytest.mark.skipif(torch_release(torch.__version__) < (2, 11),
                    reason="strict export on PyTorch 2.8 and 2.9 refuses the layers' writes of "
                           "their statistics: 'Mutating module attribute aux_losses during "
                           "export'")
def test_a_strict_export_serves_every_token_count():
    """``to_onnx(..., strict=True)``: Dynamo traces the layers, where a symbolic size looks
    like an int, so a path chosen by size was a guard ("<= 7281") and an unbounded ``Dim``
    failed. Layers that choose by size (the expert MLP's ``If``, product-key retrieval's
    chunks, the tree router's padded GEMM, GShard's groups) give their outputs at 1, 300 and
    0 tokens."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_build(EXAMPLES[name]) for name in (
        "layer:sigma_moe", "layer:pkm", "router:tree", "router:gshard"))).eval()
    tokens = torch.export.Dim("tokens", min=2)
    program = sparseffn.to_onnx(model, (torch.randn(37, D),), dynamic_shapes=({0: tokens},),
                                strict=True)
    has_if = "If" in _op_types(program.model_proto.graph)
    assert has_if != onnx_export.dynamo_forgets_writes_after_cond()
    _check_outputs(_session(program), model, (1, 300, 0))


class _Active:
    """A global that code writes and reads around each call, as the ``kernels`` package
    (transformers 5.25's attention) does with its context variable."""
    token = None


_ACTIVE = _Active()


class _Block(torch.nn.Module):
    """A σ-MoE layer whose call sets ``_ACTIVE.token`` and checks, after the layer, that it
    still reads what it set (a stale read raises, as ``ContextVar.reset`` did)."""

    def __init__(self, index):
        super().__init__()
        self.index = index
        self.layer = _build(EXAMPLES["layer:sigma_moe"])

    def forward(self, x):
        _ACTIVE.token = self.index
        y = self.layer(x)
        if _ACTIVE.token != self.index:
            raise RuntimeError(f"block {self.index} read the token of block {_ACTIVE.token}")
        _ACTIVE.token = None
        return x + y


@pytest.mark.skipif(torch_release(torch.__version__) < (2, 11),
                    reason="strict export on PyTorch 2.8 and 2.9 refuses the layers' writes of "
                           "their statistics")
@pytest.mark.parametrize("forgets", [True, False])
def test_a_strict_export_puts_no_cond_where_dynamo_forgets_writes_after_one(forgets,
                                                                            monkeypatch):
    """Dynamo (PyTorch 2.13) reads an attribute written after a ``torch.cond`` as it was
    before the cond: a model that writes and reads a global around each block failed a
    strict export at the block after the first σ-MoE layer's ``If``. Where
    ``dynamo_forgets_writes_after_cond`` says so, ``to_onnx(strict=True)`` puts no cond in the
    program (the dispatch plan at every count); elsewhere it keeps the ``If``. Checked both
    ways by setting the check's answer: with the cond kept the export succeeds only on a
    PyTorch that reads the writes."""
    forgets_here = onnx_export.dynamo_forgets_writes_after_cond()
    monkeypatch.setattr(onnx_export, "dynamo_forgets_writes_after_cond", lambda: forgets)
    torch.manual_seed(0)
    model = torch.nn.Sequential(_Block(1), _Block(2)).eval()
    tokens = torch.export.Dim("tokens", min=2)

    def export():
        return sparseffn.to_onnx(model, (torch.randn(37, D),), dynamic_shapes=({0: tokens},),
                                 strict=True)
    if not forgets and forgets_here:
        with pytest.raises(Exception, match="block 2 read the token of block 1"):
            export()
        return
    program = export()
    assert sizes.cond_allowed()          # the switch is off again after the export
    has_if = "If" in _op_types(program.model_proto.graph)
    assert has_if == (not forgets)
    _check_outputs(_session(program), model, (1, 300, 0))


@NEEDS_2_8
@pytest.mark.unpoisoned   # (filled fresh memory had made the strict capture fail too)
def test_torch_onnx_export_refuses_a_layer_in_training_mode():
    """Refused by the exporter's non-strict capture and by its strict one after it, where
    Dynamo reads PyTorch's ONNX flag as False: the message is the layer's."""
    layer = _build(EXAMPLES["layer:sigma_moe"])
    with pytest.raises(Exception, match=r"SigmaMoE is in training mode.*model.eval\(\)"):
        torch.onnx.export(layer.train(), (torch.randn(5, D),), dynamo=True, verbose=False)


def test_torchscript_tracing_is_refused_by_name():
    """``torch.jit.trace`` and the TorchScript exporter (``dynamo=False``), whose trace records
    a C kernel's output buffer but not the kernel (the program would return memory nothing
    wrote), stop with a message saying what to use."""
    layer = _build(EXAMPLES["layer:sigma_moe"]).eval()
    with pytest.raises(NotImplementedError, match="SigmaMoE: TorchScript tracing"):
        torch.jit.trace(layer, torch.randn(5, D))
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with pytest.raises(NotImplementedError, match=r"dynamo=True\) or sparseffn.to_onnx"):
            torch.onnx.export(layer, (torch.randn(5, D),), f"{folder}/m.onnx", dynamo=False)


@NEEDS_2_8
def test_torch_export_keeps_the_operators():
    """The forms are traced for ONNX alone: ``torch.export`` (whose fake tensors would prefer
    a registered decomposition to the operators' shape functions) keeps the operators,
    PyTorch's global decomposition table holds none of them, and ``portable_forms()`` turns
    such a program into ATen ops that compute the layer's outputs."""
    from torch._decomp import decomposition_table
    layer = _build(EXAMPLES["layer:sigma_moe"]).eval()
    program = torch.export.export(layer, (torch.randn(37, D),)).run_decompositions()
    targets = {str(node.target) for node in program.graph.nodes}
    assert any(target.startswith("sparseffn.") for target in targets), sorted(targets)
    assert not set(portable.forms()) & set(decomposition_table)
    # portable_forms() for run_decompositions: a program of ATen ops, the layer's outputs
    aten = program.run_decompositions(sparseffn.portable_forms())
    assert not [n for n in aten.graph.nodes if str(n.target).startswith("sparseffn.")]
    x = torch.randn(37, D)
    with torch.no_grad():
        torch.testing.assert_close(aten.module()(x), layer(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("preset", [pytest.param("sigma_moe", marks=NEEDS_2_8), "pkm"])
def test_a_language_model_runs_in_onnx_runtime(preset):
    """A whole LM (attention, positions, a preset's FFNs) with batch and length dynamic."""
    from tests.models.test_generate import tiny_lm
    model = tiny_lm(preset, context=32).eval()
    batch, length = torch.export.Dim("batch", min=1), torch.export.Dim("length", min=2, max=32)
    session = _session(sparseffn.to_onnx(model, (torch.randint(0, 20, (2, 9)),),
                                         dynamic_shapes=({0: batch, 1: length},)))
    for shape in ((3, 17), (1, 32)):
        tokens = torch.randint(0, 20, shape)
        with torch.no_grad():
            want = model(tokens)
        got, = _run(session, tokens)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@NEEDS_2_8
def test_a_sparsified_hugging_face_model_runs_in_onnx_runtime():
    """A Llama with σ-MoE FFNs (``hf.sparsify``), exported by ``torch.onnx.export`` as
    docs/huggingface.md shows, with gradients enabled as a script has them: logits at other
    batch sizes and lengths."""
    pytest.importorskip("transformers")
    from sparseffn import hf
    from tests.test_hf import llama

    model = llama(layers=1)
    hf.sparsify(model, sparseffn.SigmaMoEConfig(d_model=32, num_experts=4, expert_size=8, k=2))
    model.eval()
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])
    # PyTorch 2.9's torch.onnx.export specialises a Llama's batch (dense or sparse) at 1;
    # 2.11 and 2.13 do not
    first = 1 if torch_release(torch.__version__) >= (2, 11) else 2
    batch, length = torch.export.Dim("batch", min=first), torch.export.Dim("length", min=2)
    session = _session(torch.onnx.export(
        model, (), kwargs={"input_ids": ids, "use_cache": False}, dynamo=True, verbose=False,
        dynamic_shapes={"input_ids": {0: batch, 1: length}, "use_cache": None},
        input_names=["input_ids"], output_names=["logits"]))
    assert [out.name for out in session.get_outputs()] == ["logits"]
    for shape in ((3, 11), (first, 4)):
        ids = torch.randint(0, 50, shape)
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits
        got, = _run(session, ids)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer,strict", [
    *(pytest.param(name, False, marks=NEEDS_2_8)
      for name in ("switch_capacity", "sigma_moe", "gshard", "peer")),
    pytest.param("sigma_moe", True, id="sigma_moe-strict", marks=pytest.mark.skipif(
        torch_release(torch.__version__) < (2, 11), reason="2.8 and 2.9 refuse a strict "
        "export of the layers' aux_losses writes"))])
def test_a_model_that_skips_padding_exports_with_its_mask(layer, strict):
    """``hf.skip_padding`` installed (as ``SparseTrainer`` does): the hook would read the mask
    on the host, which an export cannot; the exported program skips padding for every mask
    and gives the model's logits for batches with and without padding. The real tokens'
    count is then data-dependent: Switch's capacity at inference follows it, σ-MoE's k = 2
    pairs and GShard's statistics are counted from it, PEER's query BatchNorm normalises
    it. A strict export (Dynamo tracing the data-dependent count) too."""
    pytest.importorskip("transformers")
    from sparseffn import hf
    from tests.test_hf import llama

    configs = {
        "switch_capacity": sparseffn.MoEConfig(
            d_model=32, num_experts=4, expert_size=8, k=1, router=sparseffn.SwitchRouterConfig(
                capacity_factor=1.0, eval_capacity_factor=1.0)),
        "sigma_moe": sparseffn.SigmaMoEConfig(d_model=32, num_experts=4, expert_size=8, k=2),
        "gshard": sparseffn.MoEConfig(d_model=32, num_experts=4, expert_size=8, k=2,
                                      router=sparseffn.GShardRouterConfig()),
        "peer": sparseffn.PEERConfig(d_model=32, num_experts=16, heads=2, k=2, key_dim=8,
                                     query_norm="batchnorm")}
    # one block, but two for the strict export, where Dynamo had read the next block wrongly
    model = llama(layers=2 if strict else 1)
    hf.sparsify(model, configs[layer])
    with torch.no_grad():   # statistics as after training, not the identity of a fresh norm
        for norm in (m for m in model.modules() if isinstance(m, torch.nn.BatchNorm1d)):
            norm.running_mean.uniform_(-1, 1), norm.running_var.uniform_(0.5, 2)
            norm.weight.uniform_(0.5, 2), norm.bias.uniform_(-1, 1)
    hf.skip_padding(model)
    model.eval()
    ids = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    batch, length = torch.export.Dim("batch", min=1), torch.export.Dim("length", min=2)
    session = _session(sparseffn.to_onnx(
        model, (), kwargs={"input_ids": ids, "attention_mask": mask, "use_cache": False},
        dynamic_shapes={"input_ids": {0: batch, 1: length},
                        "attention_mask": {0: batch, 1: length}, "use_cache": None},
        strict=strict))
    ids = torch.randint(1, 50, (3, 9))
    for mask in (torch.ones(3, 9, dtype=torch.long),
                 torch.tensor([[1] * 9, [1] * 6 + [0] * 3, [1] * 3 + [0] * 6])):
        with torch.no_grad():
            want = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        got = _run(session, ids, mask)[0]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_without_the_onnx_packages_the_error_says_what_to_install(monkeypatch):
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "onnxscript" else real(name, *a))
    from sparseffn.bench.plotting import MissingDependency
    with pytest.raises(MissingDependency, match=r"onnxscript: pip install 'sparseffn\[onnx\]'"):
        sparseffn.to_onnx(_build(EXAMPLES["layer:dense"]).eval(), (torch.randn(3, D),))


@pytest.mark.parametrize("release,model", [((2, 7), "layer:sigma_moe"),
                                           ((2, 8), "layer:sigma_moe"), ((2, 7), None)])
def test_a_failed_export_on_pytorch_2_7_says_what_it_cannot_export(release, model,
                                                                     monkeypatch):
    """On 2.7 (whose torch.export cannot trace the expert MLPs' data-dependent sizes) a
    failed export of a model with sparse layers keeps its error and gets a note naming the
    layers and the release that exports them; from 2.8, or for a model without sparse
    layers, the error is as it was. The export's failure is stood in for."""
    def fails(*args, **kwargs):
        raise RuntimeError("Cond doesn't work unless it is captured completely")
    monkeypatch.setattr(onnx_export, "torch_release", lambda version: release)
    monkeypatch.setattr(torch.export, "export", fails)
    module = torch.nn.Linear(D, D) if model is None else _build(EXAMPLES[model]).eval()
    with pytest.raises(RuntimeError, match="Cond doesn't work") as raised:
        sparseffn.to_onnx(module, (torch.randn(3, D),))
    notes = getattr(raised.value, "__notes__", [])
    if release < (2, 8) and model is not None:
        assert len(notes) == 1 and "PyTorch >= 2.8 exports them" in notes[0]
        assert "σ-MoE" in notes[0] and "FFF trees" in notes[0]
    else:
        assert notes == []


@NEEDS_2_8
def test_bench_onnx_reports_both_runtimes_and_their_agreement(tmp_path, capsys):
    """``sparseffn bench onnx``: a row and a record per layer, the ratios positive and the
    two runtimes' outputs within float32 rounding of each other."""
    import json

    from sparseffn import cli
    path = tmp_path / "onnx.json"
    # (σ-MoE and the dense MLP: each sparse layer's export takes seconds)
    assert cli.main(["bench", "onnx", "--layers", "sigma_moe", "dense", "--tokens", "24",
                     "--d-model", "16", "--repeats", "2", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["layer"] for r in records] == ["sigma_moe", "dense"]
    for record in records:
        assert record["max_abs_difference"] < 1e-4
        assert all(record[key] > 0 for key in ("torch_ms", "ort_ms", "ort_over_torch",
                                                "torch_over_dense", "ort_over_dense"))
    out = capsys.readouterr().out
    assert "ORT/dense" in out and out.count("\nsigma_moe ") == 1
