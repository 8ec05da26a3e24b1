"""Kernel outputs allocated without deterministic mode's NaN fill (``ops/written.py``).

Under ``torch.use_deterministic_algorithms(True)`` (``sparseffn train``'s default) PyTorch fills
each new uninitialised tensor with NaN: on a GPU a launch and a pass over memory for every
output a Triton kernel then writes in full. The kernels' wrappers allocate without it; that
the kernels write all they return is what the poisoned allocations of every kernel test
check (tests/poison.py)."""

import sys

import pytest
import torch

import sparseffn
from sparseffn.bench.measure import forward_backward_fn
from sparseffn.ops import triton_cvmm
from sparseffn.ops.written import written_in_full
from sparseffn.runtime import deterministic_algorithms
from tests.layers.test_conformance import EXAMPLES


def _fill() -> bool:
    return torch.utils.deterministic.fill_uninitialized_memory


def test_the_fill_is_off_inside_and_as_it_was_after():
    with deterministic_algorithms(True, torch.device("cpu")):
        assert _fill()
        with written_in_full():
            assert not _fill()
        assert _fill()
        with pytest.raises(RuntimeError), written_in_full():
            raise RuntimeError("a failed kernel launch")
        assert _fill(), "put back on an error too"
        torch.utils.deterministic.fill_uninitialized_memory = False
        try:
            with written_in_full():
                assert not _fill()
            assert not _fill(), "a user's own choice of no fill is kept"
        finally:
            torch.utils.deterministic.fill_uninitialized_memory = True
    with written_in_full():     # no deterministic algorithms: nothing to change
        assert _fill()


_TRITON_FILES = ("triton_cvmm.py", "triton_rows.py", "triton_tree.py", "triton_sinkhorn.py",
                 "triton_plan.py")
_ALLOCATORS = ((torch, "empty"), (torch, "empty_like"), (torch.Tensor, "new_empty"))


@pytest.fixture
def allocations_by_the_triton_wrappers(monkeypatch):
    """(file, whether the NaN fill was on) of every allocation made directly by the code of
    the Triton kernel modules while the test runs."""
    seen = []
    for owner, name in _ALLOCATORS:
        allocate = getattr(owner, name)

        def recording(*args, _allocate=allocate, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.endswith(_TRITON_FILES):
                seen.append((caller.rsplit("/", 1)[-1], _fill()))
            return _allocate(*args, **kwargs)
        monkeypatch.setattr(owner, name, recording)
    return seen


@pytest.mark.usefixtures("triton_on_cpu")
@pytest.mark.parametrize("example", ["layer:sigma_moe", "layer:pkm", "layer:peer",
                                     "variant:fff_sparse", "router:sbase"])
def test_triton_wrappers_allocate_without_the_nan_fill(example, monkeypatch,
                                                       allocations_by_the_triton_wrappers):
    """A training step of each kind of layer on the Triton kernels (the expert products, the
    split weight gradient with its parts, the row kernels, the product-key top-k, the tree
    kernels, the Sinkhorn kernels, the plan's counting sort), under deterministic
    algorithms: every output the wrappers allocate is allocated with the NaN fill off, and
    the step's result is the one without deterministic algorithms."""
    monkeypatch.setattr(triton_cvmm, "WEIGHT_GRAD_SPLITS", 3)
    torch.manual_seed(0)
    layer = sparseffn.build_layer(EXAMPLES[example])
    x = torch.randn(64, layer.d_model, requires_grad=True)
    step = forward_backward_fn(layer, x, None, None)
    want = step().detach().clone()
    x.grad = None
    del allocations_by_the_triton_wrappers[:]
    with deterministic_algorithms(True, torch.device("cpu")):
        got = step()
        assert _fill(), "on again after the step"
    files = {name for name, _ in allocations_by_the_triton_wrappers}
    assert example != "layer:sigma_moe" or "triton_plan.py" in files
    assert files, "the step allocated nothing through the Triton wrappers"
    filled = [name for name, fill in allocations_by_the_triton_wrappers if fill]
    assert not filled, f"allocated with the NaN fill on in {sorted(set(filled))}"
    torch.testing.assert_close(got, want, rtol=0, atol=0)
