"""Fast feed-forward tree operators: every formulation against Eq. 9 of the matrix-FFF note
(Chaunin & Mikhailovskiy) in float64, the C kernels against their PyTorch path, hard descent,
and the biased expert MLP of the leaves against a loop."""

import pytest
import torch
from torch.nn import functional as F

import sparseffn
from tests.conftest import native_or_torch, require_native, torch_threads
from sparseffn import TreeRouterConfig
from sparseffn.ops import expert_mlp, DispatchPlan, fff
from sparseffn.routers import build_router

FORMULATIONS = fff.SOFT_FORMULATIONS


@pytest.fixture(params=["native", "torch"])
def tree_path(request):
    """Run through the C kernels of fff_cpu.c and through their PyTorch fallback."""
    yield from native_or_torch(request)


def _reference_probs(z64, activation):
    return fff.leaf_probs_matrix(z64, activation)   # Eq. 9, dense, float64


# --- the matrices of Eq. 9 --------------------------------------------------------------

def test_tree_matrices_match_the_depth_2_example_of_chaunin_and_mikhailovskiy():
    T, S = fff.tree_matrices(2)
    assert torch.equal(T, torch.tensor([[1, 0, 1, 0, 0, 0],
                                        [1, 0, 0, 1, 0, 0],
                                        [0, 1, 0, 0, 1, 0],
                                        [0, 1, 0, 0, 0, 1]], dtype=torch.float32))
    assert torch.equal(S, torch.tensor([[1, 0, 0], [-1, 0, 0], [0, 1, 0], [0, -1, 0],
                                        [0, 0, 1], [0, 0, -1]], dtype=torch.float32))


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_tree_matrices_structure(depth):
    T, S = fff.tree_matrices(depth)
    N, L = 2 ** depth - 1, 2 ** depth
    assert T.shape == (L, 2 * N) and S.shape == (2 * N, N)
    assert torch.equal(T.sum(1), torch.full((L,), float(depth)))     # d nodes per path
    assert torch.equal(T.sum(0)[:2], torch.full((2,), L / 2))        # root: half the leaves each way
    assert torch.equal(S.abs().sum(0), torch.full((N,), 2.0))
    # the product form: leaf i's probability is the product of σ(±z) along its path
    z = torch.randn(3, N, dtype=torch.float64)
    for leaf in range(L):
        node, prob = 0, torch.ones(3, dtype=torch.float64)
        for level in range(depth):
            turn = (leaf >> (depth - 1 - level)) & 1
            prob = prob * torch.sigmoid(z[:, node] if turn == 0 else -z[:, node])
            node = 2 * node + 1 + turn
        torch.testing.assert_close(_reference_probs(z, "logsigmoid")[:, leaf], prob)


# --- formulations -------------------------------------------------------------------------

@pytest.mark.parametrize("activation", fff.TREE_ACTIVATIONS)
@pytest.mark.parametrize("depth", range(1, 11))
def test_formulations_agree_outputs_and_gradients(depth, activation, tree_path):
    z64 = (2 * torch.randn(4, 2 ** depth - 1, dtype=torch.float64)).requires_grad_()
    grad_out = torch.randn(4, 2 ** depth, dtype=torch.float64)
    ref = _reference_probs(z64, activation)
    (ref_grad,) = torch.autograd.grad((ref * grad_out).sum(), z64)
    for formulation in FORMULATIONS:
        if formulation == "matrix" and depth > 8:
            continue   # the float64 reference is this formulation
        z = z64.detach().float().requires_grad_()
        probs = fff.leaf_probs(z, formulation, activation)
        (grad,) = torch.autograd.grad((probs * grad_out.float()).sum(), z)
        torch.testing.assert_close(probs.double(), ref, atol=2e-6, rtol=1e-4,
                                   msg=f"{formulation} output")
        torch.testing.assert_close(grad.double(), ref_grad, atol=5e-6, rtol=1e-3,
                                   msg=f"{formulation} gradient")


@pytest.mark.parametrize("activation", fff.TREE_ACTIVATIONS)
def test_leaf_probabilities_are_a_distribution(activation):
    z = 3 * torch.randn(64, 2 ** 7 - 1)
    for formulation in FORMULATIONS:
        probs = fff.leaf_probs(z, formulation, activation)
        assert (probs >= 0).all()
        torch.testing.assert_close(probs.sum(-1), torch.ones(64), atol=1e-5, rtol=0)


def test_levelwise_kernel_equals_its_torch_path():
    require_native()
    z = torch.randn(33, 2 ** 9 - 1).requires_grad_()
    for activation in fff.TREE_ACTIVATIONS:
        out = fff.leaf_probs_levelwise(z, activation)
        (g,) = torch.autograd.grad(out.square().sum(), z)
        ref = fff._levelwise_torch(z, 9, activation)
        (g_ref,) = torch.autograd.grad(ref.square().sum(), z)
        torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(g, g_ref, atol=1e-6, rtol=1e-4)


_EXTREME_LOGITS = [0.0, -0.0, 1e-8, -1e-8, 20.0, -20.0, 86.9, -86.9, 87.5, -87.5, 200.0, -200.0,
                   float("inf"), -float("inf")]


@pytest.mark.parametrize("depth", [1, 2, 5, 9])
@pytest.mark.parametrize("rows", [0, 1, 3, 70])
def test_c_kernel_sigmoid_of_logits_matches_torch_sigmoid(depth, rows):
    """Mode 3 of fff_cpu.c computes σ(z) itself (a vectorised exp): the leaf probabilities and
    the gradient equal mode 0 given torch.sigmoid(z), for ordinary and extreme logits."""
    require_native()
    from sparseffn.ops import kernels, native
    N, L = 2 ** depth - 1, 2 ** depth
    z = 4 * torch.randn(rows, N)
    extreme = torch.tensor(_EXTREME_LOGITS)
    z.view(-1)[:min(z.numel(), extreme.numel())] = extreme[:z.numel()]
    p = torch.sigmoid(z)
    got = native.fff_expand(z, depth, kernels.FFF_PRODUCT_OF_LOGITS)
    want = native.fff_expand(p, depth, kernels.FFF_PRODUCT)
    assert got.shape == (rows, L)
    torch.testing.assert_close(got, want, atol=1e-7, rtol=1e-6)
    grad = torch.randn(rows, L)
    got_g = native.fff_expand_backward(grad, got, z, depth, kernels.FFF_PRODUCT_OF_LOGITS)
    want_g = native.fff_expand_backward(grad, want, p, depth, kernels.FFF_PRODUCT)
    torch.testing.assert_close(got_g, want_g, atol=1e-6, rtol=1e-5)


def test_c_kernel_sigmoid_saturates_exactly():
    """σ(±inf) and σ(±200) are exactly 1 and 0 (as torch.sigmoid gives), σ(0) exactly 1/2."""
    require_native()
    from sparseffn.ops import kernels, native
    z = torch.tensor([[-float("inf")], [float("inf")], [-200.0], [200.0], [0.0]])
    probs = native.fff_expand(z, 1, kernels.FFF_PRODUCT_OF_LOGITS)
    assert probs.tolist() == [[0.0, 1.0], [1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.5, 0.5]]
    assert torch.equal(probs[:, 0], torch.sigmoid(z[:, 0]))


def test_c_kernel_sigmoid_keeps_nan_in_its_subtree():
    """A NaN logit at node n makes NaN exactly the leaves under n, in the probabilities and,
    through them, in the gradient; every other leaf keeps its value."""
    require_native()
    from sparseffn.ops import kernels, native
    z = torch.randn(2, 15)
    z[0, 2] = float("nan")          # node 2: the root's right child, leaves 8..15
    probs = native.fff_expand(z, 4, kernels.FFF_PRODUCT_OF_LOGITS)
    assert probs[0, 8:].isnan().all() and not probs[0, :8].isnan().any()
    assert not probs[1].isnan().any()
    torch.testing.assert_close(probs[1], fff._levelwise_torch(z[1:], 4, "logsigmoid")[0])


@pytest.mark.parametrize("rows", [3, 40])     # below and above the kernels' one-thread limit
def test_fff_c_kernels_are_thread_independent(rows):
    require_native()
    from sparseffn.ops import kernels, native
    z, x, w = torch.randn(rows, 511), torch.randn(rows, 33), torch.randn(511, 33)
    grad = torch.randn(rows, 512)
    results = []
    for threads in (1, 2):
        with torch_threads(threads):
            probs = native.fff_expand(z, 9, kernels.FFF_PRODUCT_OF_LOGITS)
            results.append((probs, native.fff_expand_backward(grad, probs, z, 9, 3),
                            native.fff_descend(x, w, None, 9)))
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_identity_matrices_recover_the_softmax_moe_router():
    """Chaunin & Mikhailovskiy (matrix FFF) §2.2: T = S = I and a = identity give softmax(W x)."""
    z = torch.randn(16, 8)
    eye = torch.eye(8)
    torch.testing.assert_close(fff.leaf_probs_matrix(z, "linear", eye, eye), torch.softmax(z, -1))
    # and as a router in a layer, next to the softmax top-k router with the same weight
    rows = eye.tolist()
    tree = build_router(TreeRouterConfig(activation="linear", bias=False, t_matrix=rows,
                                         s_matrix=rows), 12, 8, 2)
    softmax = build_router(sparseffn.SoftmaxRouterConfig(), 12, 8, 2)
    with torch.no_grad():
        tree.weight.copy_(softmax.weight)
    x = torch.randn(20, 12)
    a, b = tree(x), softmax(x)
    assert torch.equal(a.indices, b.indices)
    torch.testing.assert_close(a.weights, b.weights)


def test_bad_node_counts_and_matrices_are_named():
    with pytest.raises(ValueError, match="2\\^depth - 1 nodes"):
        fff.leaf_probs(torch.randn(2, 6))
    with pytest.raises(ValueError, match="formulation must be one of"):
        fff.leaf_probs(torch.randn(2, 7), "fast")
    with pytest.raises(ValueError, match="tree activation"):
        fff.leaf_probs(torch.randn(2, 7), "levelwise", "tanh")
    with pytest.raises(ValueError, match="do not chain"):
        fff.leaf_probs_matrix(torch.randn(2, 7), "linear", torch.eye(3), torch.eye(7))


# --- hard inference -------------------------------------------------------------------

def _path_signs_leaf(z64):
    """The leaf reached by going left wherever the node logit is positive (reference)."""
    depth = fff.depth_of(z64.shape[1])
    leaves = []
    for t in range(z64.shape[0]):
        node = 0
        for _ in range(depth):
            node = 2 * node + (1 if z64[t, node] > 0 else 2)
        leaves.append(node - (2 ** depth - 1))
    return torch.tensor(leaves)


@pytest.mark.parametrize("depth", [1, 4, 9])
def test_hard_descent_follows_the_signs_of_the_node_logits(depth, tree_path):
    x = torch.randn(300, 40)
    weight, bias = torch.randn(2 ** depth - 1, 40), torch.randn(2 ** depth - 1)
    z64 = x.double() @ weight.double().T + bias.double()
    leaves = fff.descend(x, weight, bias)
    expected = _path_signs_leaf(z64)
    # tokens with a node logit within rounding of zero on their path may go either way
    clear = torch.tensor([all(abs(z64[t, n]) > 1e-4 for n in range(z64.shape[1]))
                          for t in range(300)]) if depth == 1 else torch.ones(300, dtype=torch.bool)
    assert torch.equal(leaves[clear], expected[clear])
    assert torch.equal(fff.descend_logits(z64), expected)


def test_hard_descent_reaches_every_leaf_and_only_reads_its_path():
    weight = torch.zeros(7, 3)      # depth 3
    # node n looks at one coordinate; x picks the path explicitly
    weight[:, 0] = 1.0
    x = torch.tensor([[1.0, 0, 0], [-1.0, 0, 0]])
    assert fff.descend(x, weight).tolist() == [0, 7]
    weight[1, 0] = -1.0      # the root's left child turns right for positive x
    assert fff.descend(x, weight).tolist() == [2, 7]
    weight[5, 0] = 5.0       # node 5 is off both paths: nothing changes
    assert fff.descend(x, weight).tolist() == [2, 7]


# --- the router and the layer ---------------------------------------------------------------


def test_expert_mlp_with_biases_matches_the_loop(matmul_path):
    E, G, d_in, d_out = 5, 3, 7, 4
    x = torch.randn(11, d_in, requires_grad=True)
    w1, w2 = torch.randn(E, G, d_in, requires_grad=True), torch.randn(E, G, d_out, requires_grad=True)
    b1, b2 = torch.randn(E, G, requires_grad=True), torch.randn(E, d_out, requires_grad=True)
    indices = torch.randint(0, E, (11, 2))
    gates = torch.rand(11, 2, requires_grad=True)
    y = expert_mlp(x, DispatchPlan.build(indices, E), w1, w2, gates, b1=b1, b2=b2, indices=indices)
    ref = torch.stack([sum(gates[t, j] * (F.relu(w1[e] @ x[t] + b1[e]) @ w2[e] + b2[e])
                           for j, e in enumerate(indices[t].tolist())) for t in range(11)])
    torch.testing.assert_close(y, ref)
    for a, b in zip(torch.autograd.grad(y.sum(), [x, w1, w2, b1, b2, gates]),
                    torch.autograd.grad(ref.sum(), [x, w1, w2, b1, b2, gates])):
        torch.testing.assert_close(a, b)
    with pytest.raises(ValueError, match="need the expert indices"):
        expert_mlp(x, DispatchPlan.build(indices, E), w1, w2, gates, b1=b1)


# --- the authors' package, same weights ---------------------------------------------------


def test_tree_matrix_cache_is_bounded_by_bytes_and_survives_inference_mode(monkeypatch):
    cache = fff._TreeMatrixCache(max_bytes=3 * 4 * (1 << 6) * 2 * ((1 << 6) - 1))
    monkeypatch.setattr(fff, "tree_matrix_cache", cache)
    z = torch.randn(5, (1 << 6) - 1, requires_grad=True)
    with torch.inference_mode():              # a first call under inference mode ...
        fff.leaf_probs(z.detach(), "matrix")
    probs = fff.leaf_probs(z, "matrix")       # ... leaves nothing behind that breaks autograd
    probs.sum().backward()
    assert z.grad is not None
    for depth in range(6, 9):                 # deeper trees push the shallow ones out
        fff.leaf_probs(torch.randn(2, (1 << depth) - 1), "matrix")
        assert cache.nbytes() <= cache.max_bytes
    T, S = fff.tree_matrices(8)
    too_big = T.numel() * 4 + S.numel() * 4
    assert too_big > cache.max_bytes and cache.nbytes() <= cache.max_bytes
