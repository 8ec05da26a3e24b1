"""The Triton kernels of the fast feed-forward tree operators (ops/triton_tree) against the
operators' PyTorch implementation, the float64 Eq. 9 reference and the sign-following descent:
on the GPU when there is one, else in Triton's CPU interpreter (fp32 and fp16)."""

import pytest
import torch

from tests.ops.triton_cases import skip_without_usable_triton

skip_without_usable_triton()

from sparseffn import FFFConfig, FastFeedForward, TreeRouterConfig   # noqa: E402
from sparseffn.ops import fff, kernels, triton_tree   # noqa: E402
from sparseffn.routers import build_router   # noqa: E402
from tests.ops.triton_cases import DEVICE, DTYPES, close, torch_path   # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_on_cpu")

MODES = {"product": kernels.FFF_PRODUCT, "sum_shifted": kernels.FFF_SUM_SHIFTED,
         "sum_odd": kernels.FFF_SUM_ODD, "product_of_logits": kernels.FFF_PRODUCT_OF_LOGITS}


def _node_inputs(tokens, depth, mode, dtype, seed=0, pad=0):
    """Node values (σ(z) in the product mode, z given the logits) and logits
    [tokens, 2^depth - 1], as views of rows ``pad`` columns wider than they are (the kernels
    take any row stride)."""
    gen = torch.Generator().manual_seed(seed)
    nodes = (1 << depth) - 1
    z = (2 * torch.randn(tokens, nodes + pad, generator=gen))[:, :nodes]
    a = {kernels.FFF_PRODUCT: torch.sigmoid(z), kernels.FFF_PRODUCT_OF_LOGITS: z}.get(
        mode, torch.nn.functional.softplus(z))
    return a.to(dtype).to(DEVICE), z.to(dtype).to(DEVICE)


def _backward_inputs(tokens, depth, mode, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    a, z = _node_inputs(tokens, depth, mode, dtype, seed)
    grad = torch.randn(tokens, 1 << depth, generator=gen).to(dtype).to(DEVICE)
    products = (kernels.FFF_PRODUCT, kernels.FFF_PRODUCT_OF_LOGITS)
    leaf = torch_path(kernels.fff_expand, a, depth, mode, z) if mode in products else None
    data = {kernels.FFF_PRODUCT: a, kernels.FFF_SUM_SHIFTED: torch.sigmoid(z),
            kernels.FFF_SUM_ODD: None, kernels.FFF_PRODUCT_OF_LOGITS: z}[mode]
    return grad, leaf, data


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("depth", [1, 2, 5, 9])
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_expand_equals_the_torch_path(mode, depth, dtype):
    a, z = _node_inputs(37, depth, mode, dtype, pad=3)
    logits = z if mode == kernels.FFF_SUM_SHIFTED else None
    got = triton_tree.expand(a, depth, mode, logits)
    want = torch_path(kernels.fff_expand, a.float(), depth, mode,
                      None if logits is None else z.float())
    assert got.dtype == dtype and got.shape == (37, 1 << depth)
    close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("depth", [1, 2, 5, 9])
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_expand_backward_equals_the_torch_path(mode, depth, dtype):
    grad, leaf, data = _backward_inputs(29, depth, mode, dtype)
    got = triton_tree.expand_backward(grad, leaf, data, depth, mode)
    f = lambda t: None if t is None else t.float()   # noqa: E731
    want = torch_path(kernels.fff_expand_backward, grad.float(), f(leaf), f(data), depth, mode)
    assert got.dtype == dtype and got.shape == (29, (1 << depth) - 1)
    close(got, want, dtype)


def test_expand_backward_is_the_gradient_of_the_expansion():
    """The backward kernel against autograd through the PyTorch expansion, with respect to
    the node logits z: the product with p = σ(z) (log-sigmoid; given σ(z) or z), the shifted
    sum with a = softplus(z) (a' = σ), the odd sum with a = z."""
    depth = 6
    gen = torch.Generator().manual_seed(3)
    z = (2 * torch.randn(11, (1 << depth) - 1, generator=gen)).to(DEVICE).requires_grad_()
    grad = torch.randn(11, 1 << depth, generator=gen).to(DEVICE)
    for mode in MODES.values():
        if mode in (kernels.FFF_PRODUCT, kernels.FFF_PRODUCT_OF_LOGITS):
            a = torch.sigmoid(z)
            data = a.detach() if mode == kernels.FFF_PRODUCT else z.detach()
        elif mode == kernels.FFF_SUM_SHIFTED:
            a, data = torch.nn.functional.softplus(z), torch.sigmoid(z).detach()
        else:
            a, data = z, None
        product = mode in (kernels.FFF_PRODUCT, kernels.FFF_PRODUCT_OF_LOGITS)
        leaf = kernels.fff_expand_torch(a, depth, kernels.FFF_PRODUCT if product else mode, z)
        (want,) = torch.autograd.grad((leaf * grad).sum(), z)
        got = triton_tree.expand_backward(grad, leaf.detach() if product else None, data,
                                          depth, mode)
        close(got, want, torch.float32)


def test_expand_empty_batch_and_nan_rows():
    depth = 4
    a, z = _node_inputs(0, depth, kernels.FFF_PRODUCT, torch.float32)
    assert triton_tree.expand(a, depth, kernels.FFF_PRODUCT, None).shape == (0, 16)
    grad = torch.zeros(0, 16, device=DEVICE)
    assert triton_tree.expand_backward(grad, grad, a, depth, kernels.FFF_PRODUCT).shape == (0, 15)
    a, z = _node_inputs(6, depth, kernels.FFF_PRODUCT, torch.float32)
    a[2, 0] = float("nan")            # the root: every leaf of row 2
    a[4, 14] = float("nan")           # a last-level node: its two leaves only
    got = triton_tree.expand(a, depth, kernels.FFF_PRODUCT, None)
    want = kernels.fff_expand_torch(a, depth, kernels.FFF_PRODUCT, None)
    assert torch.isnan(got[2]).all() and torch.isnan(got[4]).sum() == 2
    assert torch.isnan(got[4, 14:]).all()
    torch.testing.assert_close(got, want, equal_nan=True)


def test_depth_beyond_the_kernel_takes_the_other_paths():
    t = torch.zeros(1, device=DEVICE)
    assert triton_tree.usable(triton_tree.MAX_DEPTH, t)
    assert not triton_tree.usable(triton_tree.MAX_DEPTH + 1, t)
    assert not triton_tree.usable(0, t)


def test_the_operators_dispatch_to_the_kernels(monkeypatch):
    calls = []
    for name in ("expand", "expand_backward", "descend"):
        real = getattr(triton_tree, name)
        monkeypatch.setattr(triton_tree, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    z = torch.randn(5, 7, device=DEVICE, requires_grad=True)
    fff.leaf_probs_levelwise(z).sum().backward()
    fff.descend(torch.randn(5, 3, device=DEVICE), torch.randn(7, 3, device=DEVICE))
    assert calls == ["expand", "expand_backward", "descend"]


@pytest.mark.parametrize("activation", fff.TREE_ACTIVATIONS)
def test_levelwise_probabilities_and_gradients_against_eq_9(activation):
    """Through the Triton kernels, every tree activation against the dense Eq. 9 of Chaunin &
    Mikhailovskiy in float64."""
    depth = 6
    z64 = (2 * torch.randn(9, (1 << depth) - 1, dtype=torch.float64)).requires_grad_()
    grad_out = torch.randn(9, 1 << depth, dtype=torch.float64)
    ref = fff.leaf_probs_matrix(z64, activation)
    (ref_grad,) = torch.autograd.grad((ref * grad_out).sum(), z64)
    z = z64.detach().float().to(DEVICE).requires_grad_()
    probs = fff.leaf_probs_levelwise(z, activation)
    (grad,) = torch.autograd.grad((probs * grad_out.float().to(DEVICE)).sum(), z)
    torch.testing.assert_close(probs.double().cpu(), ref, atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(grad.double().cpu(), ref_grad, atol=5e-6, rtol=1e-3)


# --- hard descent ---------------------------------------------------------------------------

def _integer_tree(tokens, dim, depth, dtype, seed=0, bias=True):
    """Small integers: every dot product is exact in fp32 (and fp16), so all paths must pick
    the same leaves, zero logits (which go right) included."""
    gen = torch.Generator().manual_seed(seed)
    nodes = (1 << depth) - 1
    x = torch.randint(-2, 3, (tokens, dim), generator=gen).to(dtype)
    w = torch.randint(-2, 3, (nodes, dim), generator=gen).to(dtype)
    b = torch.randint(-2, 3, (nodes,), generator=gen).to(dtype) if bias else None
    return x, w, b


def _sign_leaves(x, w, b):
    z = x.double() @ w.double().T + (0 if b is None else b.double())
    return fff.descend_logits(z)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("depth,dim,block_d", [(1, 5, None), (3, 37, None), (8, 37, 16),
                                               (5, 130, 32)])
@pytest.mark.parametrize("bias", [True, False])
def test_descend_follows_the_signs(depth, dim, block_d, bias, dtype):
    x, w, b = _integer_tree(41, dim, depth, dtype, bias=bias)
    want = _sign_leaves(x, w, b)
    dev = lambda t: None if t is None else t.to(DEVICE)   # noqa: E731
    got = triton_tree.descend(dev(x), dev(w), dev(b), depth, block_t=4, block_d=block_d)
    assert got.dtype == torch.int64
    assert torch.equal(got.cpu(), want)
    # the operator's other implementations agree
    assert torch.equal(torch_path(kernels.fff_descend, x.float(), w.float(),
                                  None if b is None else b.float(), depth), want)


def test_descend_zero_logits_and_nan_go_right_on_every_path():
    depth = 3
    w = torch.zeros(7, 4)
    x = torch.zeros(3, 4)
    x[1, 0] = float("nan")
    w[:, 0] = 1.0
    x[2, 0] = 1.0             # positive: left at every level, leaf 0
    want = [7, 7, 0]
    assert triton_tree.descend(x.to(DEVICE), w.to(DEVICE), None, depth).tolist() == want
    assert torch_path(kernels.fff_descend, x, w, None, depth).tolist() == want
    assert kernels.fff_descend(x, w, None, depth).tolist() == want    # C kernel or PyTorch
    z = x @ w.T
    assert fff.descend_logits(z).tolist() == want


def test_descend_empty_batch_and_mixed_dtypes():
    x, w, b = _integer_tree(0, 9, 4, torch.float32)
    assert triton_tree.descend(x.to(DEVICE), w.to(DEVICE), b.to(DEVICE), 4).shape == (0,)
    x, w, b = _integer_tree(23, 9, 4, torch.float32)
    got = triton_tree.descend(x.half().to(DEVICE), w.to(DEVICE), b.double().to(DEVICE), 4)
    assert torch.equal(got.cpu(), _sign_leaves(x, w, b))


def test_router_and_layer_through_the_kernels_equal_the_torch_path():
    """A tree router's hard leaves and an FFF layer's soft training step, through the
    Triton kernels and through the PyTorch path: same leaves, outputs and gradients."""
    torch.manual_seed(0)
    router = build_router(TreeRouterConfig(), 24, 32, 1).to(DEVICE)
    x = torch.randn(50, 24, device=DEVICE)
    assert torch.equal(router.hard_leaves(x).cpu(), torch_path(router.hard_leaves, x).cpu())

    layer = FastFeedForward(FFFConfig(d_model=24, depth=4, leaf_width=8, train_mode="soft")
                            ).to(DEVICE)

    def step(inp):
        layer.zero_grad()
        out = layer(inp)
        out.square().sum().backward()
        return out.detach(), [p.grad.clone() for p in layer.parameters()]

    inp = torch.randn(2, 13, 24, device=DEVICE)
    out, grads = step(inp)
    out_ref, grads_ref = torch_path(step, inp)
    close(out, out_ref, torch.float32)
    for g, g_ref in zip(grads, grads_ref):
        close(g, g_ref, torch.float32)
