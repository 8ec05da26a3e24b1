import pytest
import torch

from sparseffn.ops import triton_cvmm


@pytest.fixture
def triton_on_cpu():
    """Without a GPU, route the operators' CPU calls through the Triton kernels (in Triton's
    interpreter) for the duration of a test. Skips it where Triton cannot run them
    (``triton_cvmm.UNUSABLE_REASON``, or not installed)."""
    if not triton_cvmm.available():
        pytest.skip(triton_cvmm.UNUSABLE_REASON or "Triton is not installed")
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        triton_cvmm.set_interpreter_for_cpu(True)
    yield
    if on_cpu:
        triton_cvmm.set_interpreter_for_cpu(False)
