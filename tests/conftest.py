import contextlib
import importlib
import os


def _threads_per_worker() -> int | None:
    """Under pytest-xdist (``make test`` runs ``-n auto``), each worker's share of the cores.

    Two workers that each run PyTorch's default of one thread per core oversubscribe the
    machine: OpenMP's waiting threads spin, and on 2 cores the suite took 1,177 s against
    896 s with one thread a worker. Set before torch loads, so that the processes a test
    starts (ranks, CLI runs) inherit it; ``OMP_NUM_THREADS`` set by hand wins. Tests of the
    thread count itself set it explicitly. None outside xdist: PyTorch's default."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers <= 1 or "OMP_NUM_THREADS" in os.environ:
        return None
    cores = (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)
    return max(1, cores // workers)


_WORKER_THREADS = _threads_per_worker()
if _WORKER_THREADS is not None:
    os.environ["OMP_NUM_THREADS"] = str(_WORKER_THREADS)

import pytest  # noqa: E402
import torch  # noqa: E402

if _WORKER_THREADS is not None:
    torch.set_num_threads(_WORKER_THREADS)   # in case a plugin imported torch first


@contextlib.contextmanager
def torch_threads(n: int):
    """PyTorch's intra-op thread count set to ``n`` inside, the previous one restored after.
    Tests of thread independence name their counts: the default is 1 under the xdist
    workers."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

# Without a GPU the Triton kernels are tested in Triton's CPU interpreter, which must be chosen
# before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from sparseffn.ops import native

from .poison import poisoned_allocations

grouped_mm_module = importlib.import_module("sparseffn.ops.grouped_mm")

# The fused CPU kernels are part of what is tested: on a machine with a C compiler they must
# build. SPARSEFFN_NO_NATIVE=1 is the one way to opt out (then their cases are skipped).
NATIVE_OPTED_OUT = bool(os.environ.get("SPARSEFFN_NO_NATIVE"))


def require_native():
    if NATIVE_OPTED_OUT:
        pytest.skip("fused CPU kernels turned off with SPARSEFFN_NO_NATIVE")
    assert native.available(), f"fused CPU kernels did not build: {native.unavailable_reason()}"


@pytest.fixture(params=["fused", "grouped_mm", "loop"])
def matmul_path(request):
    """Run a test through each CVMM implementation: the fused CPU kernels (ops/native),
    ``torch._grouped_mm`` (where usable) and the per-expert loop."""
    if request.param == "fused":
        require_native()
    native.set_native_enabled(request.param == "fused")
    grouped_mm_module.set_grouped_mm_enabled(request.param == "grouped_mm")
    yield request.param
    native.set_native_enabled(True)
    grouped_mm_module.set_grouped_mm_enabled(True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _poisoned_allocations(request):
    """Every test runs with uninitialised memory filled (tests/poison.py), so a kernel that
    leaves part of its output unwritten fails its comparison instead of passing on zeros. A
    test of the allocation itself opts out with ``@pytest.mark.unpoisoned``."""
    if request.node.get_closest_marker("unpoisoned"):
        yield
        return
    with poisoned_allocations():
        yield


def native_or_torch(request):
    """Body of the fixtures that run a test through a C kernel and through its PyTorch
    fallback (``params=["native", "torch"]``)."""
    if request.param == "native":
        require_native()
    native.set_native_enabled(request.param == "native")
    yield request.param
    native.set_native_enabled(True)
