"""The Python the README and the user guides in docs/ show runs as shown, with this version
of the library: each ```python block in order, one namespace per file. A block that uses a
reader's own object (``model``, ``x``, ...) gets a small stand-in, named in
:data:`STAND_INS`; a block that ends with ``# SomeError: message`` must raise that at its
last statement. docs/performance.md is a lab notebook (its snippets are measurement recipes
over names from its prose), and a few blocks need what a test cannot give, or more time than
a test should take; they are listed in :data:`NOT_RUN` with the reason, and the test fails if
the listed text is gone."""

import ast
import builtins
import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
GUIDES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md")
                                      if p.name != "performance.md")]


def _tiny_lm():
    from tests.models.test_generate import tiny_lm
    return tiny_lm("sigma_moe", context=12).eval()


def _hugging_face_models():
    pytest.importorskip("transformers")
    from tests.test_hf import _batches, bert, gpt2, llama
    return {"model": gpt2(), "bert": bert(), "llama": llama(), "batches": _batches()}


def _dense_mlp():
    import sparseffn
    torch.manual_seed(0)
    return {"dense_mlp": sparseffn.DenseMLP(d_model=32, d_ff=256), "x": torch.randn(512, 32)}


def _lm_batches():
    torch.manual_seed(0)
    batches = [torch.randint(0, 20, (2, 12)) for _ in range(3)]
    return {"model": _tiny_lm(), "batches": batches, "x": batches[0]}


# (file, text of the block) -> the reader's objects it uses, built small
STAND_INS = {
    ("README.md", "hf.sparsify(model"): _hugging_face_models,
    ("README.md", "Decoder(model"): lambda: {"model": _tiny_lm(),
                                             "prompt": torch.randint(0, 20, (8, 3))},
    ("huggingface.md", "convert.moefy(dense_mlp"): _dense_mlp,
    ("reproduce.md", "analyze_model(model, batches)"): _lm_batches,
}
# (file, text of the block): why it does not run here
NOT_RUN = {
    ("distributed.md", 'dist.init_process_group("gloo")'):
        "needs torchrun's processes; tests/test_expert_parallel.py runs the same calls",
    ("distributed.md", "fixed_exchange=FixedExchange(tokens=4096"):
        "needs a process group; tests/test_expert_parallel.py runs the fixed exchange",
    ("huggingface.md", 'load_safetensors_model("runs/NAME/model.safetensors"'):
        "needs a trained run; tests/train/test_export_model.py exports and loads one",
    ("huggingface.md", 'kwargs={"input_ids": ids, "use_cache": False}'):
        "exports a whole model (10-15 s); tests/test_onnx.py's "
        "test_a_sparsified_hugging_face_model_runs_in_onnx_runtime makes the same call",
    ("README.md", "decoder_to_onnx(model.eval())"):
        "exports a whole LM (10 s); tests/test_onnx_decoding.py's check_decoding makes the "
        "same calls",
    ("huggingface.md", "torch.compile(model.forward, fullgraph=True)"):
        "Inductor takes 30-40 s to compile it on a CPU; tests/test_hf.py's "
        "test_generation_with_a_static_cache_compiles_one_graph_per_phase makes the same calls "
        "with Dynamo's eager backend",
}


def _blocks(doc: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", doc.read_text(), re.S | re.M)


def _keyed(table: dict, doc: Path, block: str):
    return [value for (name, text), value in table.items() if name == doc.name and text in block]


def test_every_listed_block_is_still_there():
    for name, text in [*STAND_INS, *NOT_RUN]:
        doc = ROOT / name if name == "README.md" else ROOT / "docs" / name
        assert any(text in block for block in _blocks(doc)), (name, text)


@pytest.mark.parametrize("doc", GUIDES, ids=lambda p: p.name)
def test_the_python_shown_runs(doc, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)       # blocks that save write here
    namespace: dict = {}
    for number, block in enumerate(_blocks(doc)):
        if _keyed(NOT_RUN, doc, block):
            continue
        for stand_ins in _keyed(STAND_INS, doc, block):
            namespace.update(stand_ins())
        where = f"{doc.name}, python block {number}"
        statements = ast.parse(block).body
        raises = re.search(r"^# (\w+Error): (.*)$", block.rstrip().splitlines()[-1])
        if raises:     # the last statement raises what the comment under it says
            *statements, last = statements
        torch.manual_seed(0)
        exec(compile(ast.Module(statements, type_ignores=[]), where, "exec"), namespace)
        if raises:
            error = getattr(builtins, raises.group(1))
            with pytest.raises(error, match=re.escape(raises.group(2))):
                exec(compile(ast.Module([last], type_ignores=[]), where, "exec"), namespace)
