"""Benchmarks that compile many models: none of them may run eagerly unannounced.

``torch.compile`` keeps at most ``recompile_limit`` (8) versions of one function and runs it
eagerly past that. ``bench lm`` compiles ``TransformerLM.loss`` once per FFN preset, so its
ninth model ran eagerly while reported as compiled, until ``compiling_many``.
"""

import pytest
import torch

from sparseffn import runtime
from sparseffn.bench.measure import first_call_or_eager
from sparseffn.runtime import compiling_many, recompile_limit_name


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled_affine(graphs: list):
    """``2x + 1`` under torch.compile with static shapes: a new version for each input size,
    each one appended to ``graphs``."""
    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward
    return torch.compile(lambda x: 2 * x + 1, backend=backend, dynamic=False)


def test_without_it_torch_runs_the_ninth_version_eagerly():
    graphs = []
    affine = _compiled_affine(graphs)
    limit = getattr(torch._dynamo.config, recompile_limit_name())
    for size in range(1, limit + 4):
        assert torch.equal(affine(torch.ones(size)), torch.full((size,), 3.0))
    assert len(graphs) == limit      # the last three ran eagerly


def test_under_it_every_version_compiles():
    graphs = []
    affine = _compiled_affine(graphs)
    limit = getattr(torch._dynamo.config, recompile_limit_name())
    with compiling_many():
        for size in range(1, limit + 4):
            assert torch.equal(affine(torch.ones(size)), torch.full((size,), 3.0))
    assert len(graphs) == limit + 3
    assert getattr(torch._dynamo.config, recompile_limit_name()) == limit    # restored


def test_one_version_too_many_is_reported_as_eager(monkeypatch, capsys):
    monkeypatch.setattr(runtime, "COMPILED_VERSIONS", 2)
    graphs = []
    affine = _compiled_affine(graphs)
    with compiling_many():
        affine(torch.ones(1))
        affine(torch.ones(2))
        step, is_compiled = first_call_or_eager(lambda: affine(torch.ones(3)),
                                                lambda: (lambda: "eager"), "third")
    assert not is_compiled and step() == "eager" and len(graphs) == 2
    assert "third: does not compile" in capsys.readouterr().out
