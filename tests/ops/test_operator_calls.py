"""How a ``sparseffn::`` operator is called: its implementation directly in plain eager mode,
the registered operator wherever something must see it (dispatch modes, fake tensors,
torch.compile, inputs that require grad)."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from sparseffn.ops import kernels


class _SeenOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


def _spy(monkeypatch):
    calls = []
    op = kernels.fff_expand.op
    monkeypatch.setattr(kernels.fff_expand, "op",
                        lambda *a, **k: calls.append("op") or op(*a, **k))
    return calls


def test_eager_calls_run_the_implementation_and_agree_with_the_operator(monkeypatch):
    p = torch.rand(5, 7)
    calls = _spy(monkeypatch)
    direct = kernels.fff_expand(p, 3, kernels.FFF_PRODUCT, None)
    assert calls == []
    registered = kernels.fff_expand.op(p, 3, kernels.FFF_PRODUCT, None)
    assert torch.equal(direct, registered)


def test_dispatch_modes_and_fake_tensors_see_the_operator(monkeypatch):
    p = torch.rand(5, 7)
    with _SeenOps() as seen:
        kernels.fff_expand(p, 3, kernels.FFF_PRODUCT, None)
    assert "sparseffn.fff_expand" in seen.names
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(p)
        out = kernels.fff_expand(fake, 3, kernels.FFF_PRODUCT, None)
    assert out.shape == (5, 8)


def test_an_input_that_requires_grad_goes_through_the_operator(monkeypatch):
    p = torch.rand(5, 7, requires_grad=True)
    calls = _spy(monkeypatch)
    with torch.no_grad():
        kernels.fff_expand(p, 3, kernels.FFF_PRODUCT, None)
    assert calls == []
    kernels.fff_expand(p, 3, kernels.FFF_PRODUCT, None)
    assert calls == ["op"]


def test_compiled_calls_trace_the_operator():
    p = torch.rand(5, 7)
    compiled = torch.compile(lambda t: kernels.fff_expand(t, 3, kernels.FFF_PRODUCT, None) * 2,
                             fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(p), kernels.fff_expand(p, 3, kernels.FFF_PRODUCT, None) * 2)
