"""The operators compute in the dtype of what goes in, whatever autocast is doing around them.

Autocast stays on inside a custom operator's implementation; on CUDA a ``sum`` of bf16 slot
rows inside ``cvmm_rows`` then came back in fp32, and every gradient of the σ-MoE ran in fp32
(measured on an H100: 1.2 ms instead of about 0.3 for the largest product). CPU autocast
upcasts other ops (``prod``), which is how these tests see the difference without a GPU.
"""

import torch

from sparseffn.ops import kernels, native


@kernels.operator("test_probe_prod")
def _probe(x: torch.Tensor) -> torch.Tensor:
    return torch.prod(x, 1)   # fp32 under CPU autocast, if autocast were on


@_probe.register_fake
def _(x):
    return x.new_empty(x.shape[0])


def test_an_operator_runs_its_implementation_without_autocast():
    x = torch.rand(5, 3, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.prod(x, 1).dtype == torch.float32   # autocast's own rule
        assert _probe(x).dtype == torch.bfloat16
        assert torch.is_autocast_enabled("cpu"), "autocast is back on after the operator"
    assert torch.equal(_probe(x), torch.prod(x, 1))


def test_cvmm_rows_sees_no_autocast_and_keeps_the_dtype(monkeypatch):
    seen = []
    torch_impl = kernels._cvmm_rows_torch

    def spy(*args):
        seen.append(torch.is_autocast_enabled("cpu"))
        return torch_impl(*args)

    monkeypatch.setattr(kernels, "_cvmm_rows_torch", spy)
    native.set_native_enabled(False)
    try:
        src = torch.randn(6, 4, dtype=torch.bfloat16)
        weight = torch.randn(2, 4, 3, dtype=torch.bfloat16)
        counts = torch.tensor([5, 7])
        in_idx = torch.arange(12) % 6
        order = torch.randperm(12)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, _ = kernels.cvmm_rows(src, weight, counts, in_idx, order, None, 6, 2, False,
                                       None, None)
    finally:
        native.set_native_enabled(True)
    assert seen == [False]
    assert out.dtype == torch.bfloat16 and out.shape == (6, 3)
