"""The FastFeedForward layer (Belcak & Wattenhofer 2023, arXiv:2308.14711): its modes against
per-leaf loops, hard inference, training, config, and the fastfeedforward package given the same
weights."""

import math

import pytest
import torch
from torch.nn import functional as F

import sparseffn
from tests.conftest import native_or_torch
from sparseffn import FastFeedForward, FFFConfig, config_from_dict
from sparseffn.ops import fff

FORMULATIONS = fff.SOFT_FORMULATIONS


@pytest.fixture(params=["native", "torch"])
def tree_path(request):
    """Run through the C kernels of fff_cpu.c and through their PyTorch fallback."""
    yield from native_or_torch(request)


def _leaf_loop(layer, x, leaf_weights):
    """Σ_i w_i f_i(x) with f_i = W2_i act(W1_i x + b1_i) + b2_i: a loop over tokens and leaves."""
    rows = []
    for t in range(x.shape[0]):
        y = 0
        for i in range(layer.config.num_leaves):
            w = leaf_weights[t, i]
            if w == 0:
                continue
            h = F.relu(layer.store.w1[i] @ x[t] + layer.store.b1[i])
            y = y + w * (h @ layer.store.w2[i] + layer.store.b2[i])
        rows.append(y)
    return torch.stack(rows)


@pytest.mark.parametrize("activation", ["logsigmoid", "softplus", "linear"])
def test_soft_layer_matches_the_leaf_loop(activation):
    layer = FastFeedForward(d_model=10, depth=3, leaf_width=4, d_out=6,
                            router={"activation": activation})
    x = torch.randn(9, 10, requires_grad=True)
    y = layer(x)
    probs = layer.router.leaf_probs(x)
    ref = _leaf_loop(layer, x, probs)
    torch.testing.assert_close(y, ref)
    g = torch.randn_like(y)
    params = [x, layer.router.weight, layer.router.bias, layer.store.w1, layer.store.b1, layer.store.w2, layer.store.b2]
    grads = torch.autograd.grad((y * g).sum(), params)
    ref_grads = torch.autograd.grad((ref * g).sum(), params)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_sparse_layer_matches_the_leaf_loop(matmul_path):
    layer = FastFeedForward(d_model=10, depth=3, leaf_width=4, train_mode="sparse", k=2)
    x = torch.randn(9, 10, requires_grad=True)
    y = layer(x)
    probs = layer.router.leaf_probs(x)
    top, idx = probs.topk(2, -1)
    weights = torch.zeros_like(probs).scatter(1, idx, top)
    ref = _leaf_loop(layer, x, weights)
    torch.testing.assert_close(y, ref)
    params = [x, layer.router.weight, layer.store.w1, layer.store.b1, layer.store.w2, layer.store.b2]
    grads = torch.autograd.grad(y.square().sum(), params)
    ref_grads = torch.autograd.grad(ref.square().sum(), params)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("node_width", [1, 4])
def test_hard_inference_equals_soft_output_with_the_path_weight_one(node_width):
    layer = FastFeedForward(d_model=12, depth=4, leaf_width=5, router={"node_width": node_width},
                            eval_mode="hard").eval()
    x = torch.randn(50, 12)
    y = layer(x)
    leaves = layer.router.hard_leaves(x)
    assert torch.equal(leaves, fff.descend_logits(layer.router.node_logits(x)))
    onehot = F.one_hot(leaves, 16).float()
    torch.testing.assert_close(y, layer.soft_output(x, onehot))
    torch.testing.assert_close(y, _leaf_loop(layer, x, onehot))
    assert torch.equal(layer.routing_stats["counts"], torch.bincount(leaves, minlength=16).float())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, "autocast"],
                         ids=["bf16", "fp16", "fp64", "bf16_autocast"])
@pytest.mark.parametrize("node_width", [1, 3])
def test_hard_inference_descends_the_node_logits_in_every_dtype(node_width, dtype):
    """In a bf16, fp16 or float64 module and under bf16 autocast, hard inference descends the
    node logits as :meth:`node_logits` computes them (in float32; float64 in a float64
    module) and returns the module's dtype (bf16 under autocast). With nodes of several
    neurons it raised outside float32 (float32 inputs against the module's weights), and
    under autocast it computed them in bf16."""
    torch.manual_seed(0)
    layer = FastFeedForward(d_model=12, depth=4, leaf_width=5, router={"node_width": node_width},
                            eval_mode="hard").eval()
    layer = layer if dtype == "autocast" else layer.to(dtype)
    x = torch.randn(2000, 12, dtype=torch.float32 if dtype == "autocast" else dtype)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16, enabled=dtype == "autocast"):
        y = layer(x)
        z = layer.router.node_logits(x)
        leaves = layer.router.hard_leaves(x)
        want = layer.soft_output(x, F.one_hot(leaves, 16).to(y.dtype))
    assert y.dtype == (torch.bfloat16 if dtype == "autocast" else dtype)
    assert z.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(leaves, fff.descend_logits(z))
    torch.testing.assert_close(y, want, atol=1e-2 if y.element_size() == 2 else 1e-6,
                               rtol=1e-2)


def test_modes_follow_train_and_eval():
    layer = FastFeedForward(d_model=8, depth=2, leaf_width=3)
    assert layer.mode == "soft" and layer.eval().mode == "soft"
    sparse = FastFeedForward(d_model=8, depth=2, leaf_width=3, train_mode="sparse", k=2)
    assert sparse.mode == "sparse" and sparse.eval().mode == "topk"
    hard = FastFeedForward(d_model=8, depth=2, leaf_width=3, eval_mode="hard")
    assert hard.mode == "soft" and hard.eval().mode == "hard"
    x = torch.randn(2, 5, 8)
    assert hard(x).shape == (2, 5, 8)
    assert "entropy" not in hard.routing_stats
    layer.train()(x)
    probs = layer.router.leaf_probs(x.reshape(-1, 8)).detach()     # the mean entropy of R, nats
    torch.testing.assert_close(layer.routing_stats["entropy"],
                               -(probs * probs.log()).sum(-1).mean())


def _negative_usage_entropy(probs):
    """Σ_i p_i log p_i with p_i the batch mean of R(i|x), written out (Csordás et al. Eq. 35)."""
    p = probs.double().mean(0)
    return sum(float(q) * math.log(float(q)) for q in p if q > 0)


def test_sparse_training_records_the_leaf_usage_entropy_with_its_weight():
    layer = FastFeedForward(d_model=10, depth=3, leaf_width=4, train_mode="sparse", k=2,
                            router={"entropy_weight": 0.25})
    x = torch.randn(30, 10)
    layer(x)
    want = _negative_usage_entropy(layer.router.leaf_probs(x).detach())
    assert layer.aux_losses["entropy"].item() == pytest.approx(want, rel=1e-5)
    assert sparseffn.aux_loss(layer).item() == pytest.approx(0.25 * want, rel=1e-5)
    # the same batch seen as two processes' halves: each computes the global batch's loss
    from sparseffn.losses import BatchSum

    class OtherHalf(BatchSum):
        def sum(self, values):
            other = torch.cat([layer.router.leaf_probs(x[15:]).sum(0), torch.tensor([15.0])])
            return values + other.detach()
    layer.router.global_batch = OtherHalf()
    layer(x[:15])
    assert layer.aux_losses["entropy"].item() == pytest.approx(want, rel=1e-5)
    # soft training computes every leaf: nothing to balance, no loss recorded
    soft = FastFeedForward(d_model=10, depth=3, leaf_width=4)
    soft(x)
    assert soft.aux_losses == {} and sparseffn.aux_loss(soft).item() == 0.0
    off = FastFeedForward(d_model=10, depth=3, leaf_width=4, train_mode="sparse", k=2,
                          router={"entropy_weight": 0.0})
    off(x)
    assert "entropy" in off.aux_losses and not sparseffn.aux_loss(off).requires_grad
    with pytest.raises(ValueError, match="entropy_weight"):
        FFFConfig(d_model=4, depth=2, leaf_width=2, router={"entropy_weight": -1.0})


def test_the_leaf_entropy_regulariser_revives_leaves_a_tree_starves():
    """A root biased hard to the left sends every token's top-2 to the left subtree, so half
    the leaves get no token and no gradient. Descending aux_loss alone spreads the usage back
    over all 8 leaves."""
    torch.manual_seed(0)
    layer = FastFeedForward(d_model=8, depth=3, leaf_width=4, train_mode="sparse", k=2,
                            router={"entropy_weight": 1.0})
    with torch.no_grad():
        layer.router.bias[0] = 6.0                        # σ(6) ≈ 0.998 of the mass goes left
    x = torch.randn(256, 8)
    layer(x)
    assert set(layer.routing_stats["counts"].nonzero().flatten().tolist()) <= {0, 1, 2, 3}
    opt = torch.optim.SGD(layer.router.parameters(), lr=2.0)
    for _ in range(100):
        opt.zero_grad()
        layer(x)
        sparseffn.aux_loss(layer).backward()
        opt.step()
    layer(x)
    assert int((layer.routing_stats["counts"] > 0).sum()) == 8
    assert -_negative_usage_entropy(layer.router.leaf_probs(x).detach()) > 0.9 * math.log(8)


@pytest.mark.slow
@pytest.mark.parametrize("train_mode", ["soft", "sparse"])
def test_fff_layer_learns_a_piecewise_task(train_mode):
    torch.manual_seed(0)
    x = torch.randn(512, 6)
    target = torch.where(x[:, :1] > 0, x @ torch.randn(6, 3), torch.sin(3 * x[:, 1:4]))
    layer = FastFeedForward(d_model=6, depth=3, leaf_width=8, d_out=3, train_mode=train_mode,
                            k=2)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    baseline = (target - target.mean(0)).square().mean().item()
    for _ in range(300):
        opt.zero_grad()
        loss = (layer(x) - target).square().mean()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * baseline


def test_config_round_trip_cost_and_errors():
    cfg = FFFConfig(d_model=16, depth=3, leaf_width=4, eval_mode="hard", router={"node_width": 2})
    assert config_from_dict(cfg.to_dict()) == cfg
    layer = sparseffn.build_layer(cfg)
    assert cfg.cost().total_params == sum(p.numel() for p in layer.parameters())
    leaf = 16 * 4 + 4 * 16 + 4 + 16
    node = 2 * 16 + 2 + 2 + 1
    assert cfg.cost().active_params == 3 * node + leaf
    soft = cfg.replace(eval_mode="soft")
    assert soft.cost().active_params == soft.cost().total_params
    with pytest.raises(ValueError, match="k must be an integer in \\[1, num_leaves=8\\]"):
        FFFConfig(d_model=4, depth=3, leaf_width=2, k=9)
    with pytest.raises(ValueError, match="eval_mode"):
        FFFConfig(d_model=4, depth=3, leaf_width=2, eval_mode="greedy")
    with pytest.raises(ValueError, match="use 'levelwise'"):
        FFFConfig(d_model=4, depth=15, leaf_width=2, router={"formulation": "matrix"})
    eye = torch.eye(8).tolist()
    with pytest.raises(ValueError, match="not defined for explicit"):
        FFFConfig(d_model=4, depth=3, leaf_width=2, eval_mode="hard",
                  router={"activation": "linear", "t_matrix": eye, "s_matrix": eye})
    with pytest.raises(ValueError, match="power of two"):
        sparseffn.MoEConfig(d_model=4, num_experts=6, expert_size=2, k=1, router="tree")
    with pytest.raises(ValueError, match="t_matrix has 3 rows"):
        sparseffn.MoEConfig(d_model=4, num_experts=4, expert_size=2, k=1,
                            router={"type": "tree", "t_matrix": torch.eye(3).tolist(),
                                    "s_matrix": torch.eye(3).tolist()})
    with pytest.raises(ValueError, match="d_model=16"):
        layer(torch.randn(3, 15))


def test_matches_fastfeedforward_given_the_same_weights():
    from fastfeedforward import FFF
    torch.manual_seed(1)
    theirs = FFF(input_width=12, leaf_width=5, output_width=7, depth=3)
    ours = FastFeedForward(d_model=12, depth=3, leaf_width=5, d_out=7, eval_mode="hard")
    with torch.no_grad():
        # their node sends σ(z) to the right child, ours to the left: negate the node
        ours.router.weight.copy_(-theirs.node_weights)
        ours.router.bias.copy_(-theirs.node_biases.squeeze(1))
        ours.store.w1.copy_(theirs.w1s.transpose(1, 2))
        ours.store.b1.copy_(theirs.b1s)
        ours.store.w2.copy_(theirs.w2s)
        ours.store.b2.copy_(theirs.b2s)
    x = torch.randn(40, 12)
    theirs.train()
    torch.testing.assert_close(ours.train()(x), theirs(x), atol=1e-5, rtol=1e-5)
    theirs.eval()
    ours.eval()
    y_hard = ours(x)
    leaves = ours.router.hard_leaves(x)
    # their eval_forward leaves out the leaf output bias b2; ours keeps it
    torch.testing.assert_close(y_hard, theirs(x) + ours.store.b2[leaves], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(y_hard, theirs(x))


def test_fff_config_embeds_its_tree_router():
    """The tree's fields live in the embedded TreeRouterConfig; by default its node biases
    follow ``bias`` and its init follows ``init``; flat fields of earlier releases still work."""
    from sparseffn import TreeRouterConfig
    cfg = FFFConfig(d_model=8, depth=2, leaf_width=4, bias=False, init="sigma_moe",
                    router={"activation": "softplus"})
    assert cfg.router == TreeRouterConfig(activation="softplus", bias=False, init="layer")
    assert config_from_dict(cfg.to_dict()) == cfg
    with pytest.warns(DeprecationWarning, match=r"router\.(activation|formulation)"):
        old = FFFConfig(d_model=8, depth=2, leaf_width=4, activation="softplus",
                        formulation="levelwise")
    assert old.router == TreeRouterConfig(activation="softplus", formulation="levelwise")
    explicit = FFFConfig(d_model=8, depth=2, leaf_width=4,
                         router=TreeRouterConfig(bias=False))
    assert explicit.bias and not explicit.router.bias        # leaves biased, nodes not
    layer = FastFeedForward(explicit)
    assert layer.router.bias is None and layer.store.b1 is not None
    with pytest.raises(ValueError, match="must be a TreeRouterConfig"):
        FFFConfig(d_model=8, depth=2, leaf_width=4, router="sigma")


@pytest.mark.parametrize("formulation", ("auto",) + FORMULATIONS)
@pytest.mark.parametrize("mode", ["train", "sparse", "soft", "hard"])
def test_every_formulation_compiles_in_one_graph(formulation, mode):
    """``torch.compile(fullgraph=True)`` of every tree formulation, training (soft, and sparse
    with its leaf-usage regulariser) and in both inference modes, with the tree-matrix cache
    empty at the trace (its lock broke the graph of ``matrix`` and ``matrix_sparse``): the
    same output, aux loss and gradients as eager."""
    _check_compiled_formulation(formulation, mode, "cpu")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_every_formulation_compiles_in_one_graph_on_cuda():
    """The same on CUDA, where the cached matrices become constants on the device."""
    for formulation in ("auto",) + FORMULATIONS:
        for mode in ("train", "sparse", "soft", "hard"):
            _check_compiled_formulation(formulation, mode, "cuda")


def _check_compiled_formulation(formulation: str, mode: str, device: str) -> None:
    torch.manual_seed(0)
    training = mode in ("train", "sparse")
    layer = FastFeedForward(d_model=12, depth=3, leaf_width=5, router={"formulation": formulation},
                            train_mode="sparse" if mode == "sparse" else "soft", k=2,
                            eval_mode="hard" if mode == "hard" else "soft").to(device)
    layer.train(training)
    x = torch.randn(7, 12, device=device, requires_grad=training)
    fff.tree_matrix_cache.clear()
    torch._dynamo.reset()
    with torch.set_grad_enabled(training):
        y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
        aux = sparseffn.aux_loss(layer)
        expected = layer(x)
        expected_aux = sparseffn.aux_loss(layer)
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(aux, expected_aux, rtol=1e-5, atol=1e-7)
    assert (mode == "sparse") == bool(aux.requires_grad)
    if training:
        grads = torch.autograd.grad(y.square().sum() + aux, [x, *layer.parameters()])
        wanted = torch.autograd.grad(expected.square().sum() + expected_aux,
                                     [x, *layer.parameters()])
        for got, want in zip(grads, wanted):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
