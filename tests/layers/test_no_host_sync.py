"""No layer reads a device tensor on the host during a training step (the GPU issue's
requirement: a step that never waits for the GPU, and can be captured in a CUDA graph):
the benchmarks' layer configs, every example of the conformance suite (each registered layer
type, router and variant) and the classic mixtures. The one documented exception is a sparse
table gradient (``sparse_grad=True``), whose row count is read on the host.

On a GPU, ``scripts/gpu_check.py`` checks it directly with
``torch.cuda.set_sync_debug_mode("error")``. Here, without one, every aten op a training step
dispatches is recorded on CPU tensors, with the C kernels off (the PyTorch implementations are
what CUDA runs where Triton does not) and the bounds checks off (on CPU they read the indices on
purpose; on a GPU they run only in debug mode), and the ops that synchronise on CUDA are
forbidden: reading a scalar (``.item()``, ``int()``, ``bool()``), ``nonzero``, boolean-mask
indexing, ``masked_select``, ``unique``, ``bincount``, ``equal``, and ``repeat_interleave``
without ``output_size``.

A ``sparseffn::`` operator is one op to the recorder, its implementation invisible; so every
operator whose PyTorch implementation is what CUDA runs is replaced by that implementation
while the step runs. The CVMM operators stay whole: on CUDA they are the Triton kernels.
"""

import importlib
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sparseffn
from sparseffn import PKMConfig
from sparseffn.bench.compiled import layer_configs
from sparseffn.layers.classic import (DeepMixtureOfExperts, HierarchicalMixtureOfExperts,
                                      MixtureOfExperts)
from sparseffn.ops import native
from sparseffn.ops.kernels import Operator
from tests.layers.test_conformance import EXAMPLES

# the modules that call checks_enabled (debug's indices_outside: cvmm's and rows' index checks)
_CHECKING_MODULES = [importlib.import_module(f"sparseffn.ops.{m}") for m in ("debug", "kernels")]

_SYNCING = {"aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten._unique2",
            "aten.unique_dim", "aten.unique_consecutive", "aten.bincount", "aten.equal",
            "aten.is_nonzero", "aten.allclose"}


# Triton kernels on CUDA (scripts/gpu_check.py checks them there with the sync debug mode)
_OPAQUE_OPERATORS = {"cvmm_rows", "expert_weight_grad"}


def _open_operators(monkeypatch) -> list[str]:
    """Replace every other ``sparseffn::`` operator, wherever a sparseffn module holds it, by
    its Python implementation; returns the names replaced."""
    opened = set()
    for name, module in list(sys.modules.items()):
        if not name.startswith("sparseffn"):
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, Operator) and value.op._name not in _OPAQUE_OPERATORS:
                monkeypatch.setattr(module, attr, value.implementation)
                opened.add(value.op._name)
    return sorted(opened)


def _synchronises(func, args, kwargs) -> bool:
    name = str(func.overloadpacket)
    if name in _SYNCING:
        return True
    if name == "aten.repeat_interleave" and isinstance(args[0], torch.Tensor) \
            and (kwargs or {}).get("output_size") is None:
        return True
    if name == "aten.index" and len(args) > 1:   # a boolean mask is a nonzero
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
    return False


class _RecordSyncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.found = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if _synchronises(func, args, kwargs):
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_recorder_sees_a_host_read():
    with _RecordSyncs() as record:
        torch.ones(3).sum().item()
        torch.arange(4)[torch.arange(4) > 1]
    assert record.found == ["aten._local_scalar_dense.default", "aten.index.Tensor"]


def _training_step_syncs(layer: torch.nn.Module, x: torch.Tensor, dtype, monkeypatch
                         ) -> list[str]:
    """The host reads one training step of ``layer`` on ``x`` makes (fp32, or under autocast
    to ``dtype``), with the C kernels and the bounds checks off and every operator opened."""
    for module in _CHECKING_MODULES:
        monkeypatch.setattr(module, "checks_enabled", lambda tensor: False)
    assert {"topk_rows", "product_key_topk", "gather_sum"} <= set(_open_operators(monkeypatch))
    native.set_native_enabled(False)
    layer.train()
    x = x.detach().clone().requires_grad_(True)
    try:
        with _RecordSyncs() as record:
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = layer(x).float().square().sum() + sparseffn.aux_loss(layer)
            loss.backward()
    finally:
        native.set_native_enabled(True)
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters()
                                      if p.requires_grad)
    return record.found


_DTYPES = pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16_autocast"])


@_DTYPES
@pytest.mark.parametrize("name", list(layer_configs(64)))
def test_a_training_step_reads_nothing_on_the_host(name, dtype, monkeypatch):
    torch.manual_seed(0)
    layer = sparseffn.build_layer(layer_configs(64)[name])
    assert _training_step_syncs(layer, torch.randn(40, 64), dtype, monkeypatch) == []


# sparse_grad=True: a coalesced sparse gradient's row count is data-dependent (below)
_SPARSE_GRAD = {name for name, config in EXAMPLES.items() if getattr(config, "sparse_grad", False)}


@_DTYPES
@pytest.mark.parametrize("name", sorted(set(EXAMPLES) - _SPARSE_GRAD))
def test_every_registered_layer_router_and_variant_reads_nothing_on_the_host(name, dtype,
                                                                            monkeypatch):
    """The conformance suite's examples: every registered layer type and router (the dense
    gates, the hierarchical gate and the product-key router included) and the variants."""
    torch.manual_seed(0)
    layer = sparseffn.build_layer(EXAMPLES[name])
    assert _training_step_syncs(layer, torch.randn(30, 12), dtype, monkeypatch) == []


CLASSIC = {
    "jacobs_classification": lambda: MixtureOfExperts(12, 5, 4),
    "jacobs_regression": lambda: MixtureOfExperts(12, 5, 4, task="regression", expert_hidden=8),
    "jordan_jacobs": lambda: HierarchicalMixtureOfExperts(12, 5, branching=2, depth=3),
    "eigen_margin": lambda: DeepMixtureOfExperts(12, 5, hidden=(8, 8), margin=0.1),
}


@_DTYPES
@pytest.mark.parametrize("name", list(CLASSIC))
def test_the_classic_mixtures_read_nothing_on_the_host(name, dtype, monkeypatch):
    torch.manual_seed(0)
    assert _training_step_syncs(CLASSIC[name](), torch.randn(30, 12), dtype, monkeypatch) == []


@pytest.mark.parametrize("config", [
    PKMConfig(d_model=12, num_subkeys=4, heads=2, k=3, query="linear", key_dim=6,
              sparse_grad=True),
    EXAMPLES["variant:peer_sparse_grad"]], ids=["pkm", "peer"])
def test_a_sparse_table_gradient_reads_its_row_count_on_the_host(config, monkeypatch):
    """The documented exception: ``sparse_grad=True`` gives a coalesced sparse gradient of the
    rows the batch read, whose number only ``torch.unique`` on the host can tell, one per
    sparse table (as the optimizer's ``coalesce`` of ``nn.Embedding(sparse=True)``'s would)."""
    torch.manual_seed(0)
    layer = sparseffn.build_layer(config)
    found = _training_step_syncs(layer, torch.randn(30, 12), None, monkeypatch)
    tables = sum(p.grad.is_sparse for p in layer.parameters() if p.grad is not None)
    assert tables >= 1 and found == ["aten._unique2.default"] * tables
