"""No layer reads a device tensor on the host during a training step (the GPU issue's
requirement: a step that never waits for the GPU, and can be captured in a CUDA graph).

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
from sparseffn.bench.compiled import layer_configs
from sparseffn.ops import native
from sparseffn.ops.kernels import Operator

# the modules (the package exports functions of the same names)
_CHECKING_MODULES = [importlib.import_module(f"sparseffn.ops.{m}")
                     for m in ("cvmm", "rows", "kernels")]

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


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["fp32", "bf16_autocast"])
@pytest.mark.parametrize("name", list(layer_configs(64)))
def test_a_training_step_reads_nothing_on_the_host(name, dtype, monkeypatch):
    for module in _CHECKING_MODULES:
        monkeypatch.setattr(module, "checks_enabled", lambda tensor: False)
    assert {"topk_rows", "product_key_topk", "gather_sum"} <= set(_open_operators(monkeypatch))
    native.set_native_enabled(False)
    torch.manual_seed(0)
    layer = sparseffn.build_layer(layer_configs(64)[name]).train()
    x = torch.randn(40, 64, requires_grad=True)
    try:
        with _RecordSyncs() as record:
            with torch.autocast("cpu", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = layer(x).float().square().sum() + sparseffn.aux_loss(layer)
            loss.backward()
    finally:
        native.set_native_enabled(True)
    assert record.found == []
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters()
                                      if p.requires_grad)
