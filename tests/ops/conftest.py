import pytest
import torch

from sparseffn.ops import triton_cvmm
from tests.ops.triton_cases import skip_without_usable_triton


@pytest.fixture
def triton_on_cpu():
    """Without a GPU, route the operators' CPU calls through the Triton kernels (in Triton's
    interpreter) for the duration of a test. Skips it where Triton cannot run them
    (``triton_cvmm.UNUSABLE_REASON``, or not installed)."""
    skip_without_usable_triton()
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        triton_cvmm.set_interpreter_for_cpu(True)
    yield
    if on_cpu:
        triton_cvmm.set_interpreter_for_cpu(False)


@pytest.fixture
def kept_arrival_counts(monkeypatch):
    """The arrival counts each call of a kernel that adds its split parts itself allocates
    (``triton_cvmm.arrival_counts``), kept to be read after it."""
    kept = []
    allocate = triton_cvmm.arrival_counts

    def keeping(blocks, device):
        kept.append(allocate(blocks, device))
        return kept[-1]
    monkeypatch.setattr(triton_cvmm, "arrival_counts", keeping)
    return kept
