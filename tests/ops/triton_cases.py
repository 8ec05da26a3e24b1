"""What the Triton kernel tests share: the device they run on (the GPU, else Triton's CPU
interpreter, which has no bf16), the dtypes and tolerances. Their modules also set
``pytestmark = pytest.mark.usefixtures("triton_on_cpu")`` (the fixture is in this folder's
conftest)."""

import pytest
import torch

from sparseffn.ops import native, triton_cvmm

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def skip_without_usable_triton() -> None:
    """Skip the calling test or test module where Triton is not installed, or is installed
    but cannot define its kernels here (``triton_cvmm.UNUSABLE_REASON``: Triton 3.3, PyTorch
    2.7's, on a machine without a GPU); the PyTorch paths that run instead are tested
    everywhere."""
    pytest.importorskip("triton", reason="Triton is optional; these cases test its kernels")
    if not triton_cvmm.available():
        pytest.skip(triton_cvmm.UNUSABLE_REASON, allow_module_level=True)


def close(got, want, dtype):
    """Equal to a tolerance scaled to the output's magnitude."""
    assert got.shape == want.shape
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype] * scale,
                               rtol=TOL[dtype], equal_nan=True)


def torch_path(fn, *args):
    """``fn`` through the operators' PyTorch implementation (no Triton, no C kernels)."""
    triton_cvmm.set_triton_enabled(False)
    native.set_native_enabled(False)
    try:
        return fn(*args)
    finally:
        triton_cvmm.set_triton_enabled(True)
        native.set_native_enabled(True)
