"""The one cast a layer makes for its router and its store (``ops.precision.cast_for_two``)."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparseffn.ops.precision import cast_for_two


class _Ops(TorchDispatchMode):
    """The names of the operators whose output has ``shape``."""

    def __init__(self, shape):
        super().__init__()
        self.shape, self.names = shape, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.shape == self.shape:
            self.names.append(str(func.overloadpacket).replace("aten.", ""))
        return out


def _readers(a, b, w_a, w_b):
    return (a @ w_a).float().square().sum() + (b @ w_b).float().sin().sum()


@pytest.mark.unpoisoned   # counts every operator the backward dispatches
def test_the_input_gradient_is_the_bits_of_one_tensor_read_twice_in_one_operator():
    torch.manual_seed(0)
    x = torch.randn(37, 19)
    w_a, w_b = torch.randn(19, 5).bfloat16(), torch.randn(19, 7).bfloat16()
    x_twice = x.clone().requires_grad_()
    shared = x_twice.to(torch.bfloat16)             # what autograd sums, then casts back
    _readers(shared, shared, w_a, w_b).backward()
    x_once = x.clone().requires_grad_()
    a, b = cast_for_two(x_once, torch.bfloat16)
    assert a.dtype == b.dtype == torch.bfloat16 and torch.equal(a, shared)
    assert b.data_ptr() == a.data_ptr(), "one copy of x, not two"
    loss = _readers(a, b, w_a, w_b)
    ops = _Ops(x.shape)
    with ops:
        loss.backward()
    assert x_once.grad.dtype == torch.float32
    assert torch.equal(x_once.grad, x_twice.grad)
    # on [T, d]: the two readers' products, then one sum-and-widen (not an add and a cast)
    compute = [n for n in ops.names if n not in ("mm", "empty", "detach", "view", "t")]
    assert compute == ["add"], ops.names


def test_a_reader_that_takes_no_gradient_leaves_the_other_readers_part():
    torch.manual_seed(0)
    x = torch.randn(6, 4, requires_grad=True)
    a, b = cast_for_two(x, torch.float16)
    (b.float() * 3).sum().backward()
    assert x.grad.dtype == torch.float32
    assert torch.equal(x.grad, torch.full_like(x, 3.0))
    a, b = cast_for_two(torch.randn(0, 4, requires_grad=True), torch.bfloat16)
    assert a.shape == b.shape == (0, 4)
