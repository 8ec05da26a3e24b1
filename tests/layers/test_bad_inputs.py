"""Bad inputs to every registered layer and router (driven by the conformance examples, so a
new registration is covered by adding its example): NaN and ±inf reach only their own
token, empty batches give empty outputs, any batch shape and memory layout work, and a wrong
width, dtype or kind of tensor is a clear error naming the layer. Also: configs reject
non-finite numbers, and layers take their config as a dict."""

import math

import pytest
import torch

import sparseffn
from sparseffn.ops.assignment import exact_balanced_assignment, sinkhorn_log_plan
from sparseffn.registry import LayerConfig, RouterConfig
from tests.layers.test_conformance import EXAMPLES

NAMES = sorted(EXAMPLES)
# Batch-statistics query norms mix the tokens of a training batch by design.
_BATCH_NORMED = {"layer:peer"}


def _layer(name, train):
    torch.manual_seed(0)
    return sparseffn.build_layer(EXAMPLES[name]).train(train)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name, train", [(n, t) for n in NAMES for t in (False, True)
                                         if not (t and n in _BATCH_NORMED)])
def test_a_non_finite_token_reaches_no_other_token(name, train, bad):
    layer = _layer(name, train)
    x = torch.randn(7, layer.d_model)
    x[3, 1] = bad
    x.requires_grad_(True)
    y = layer(x)
    others = [0, 1, 2, 4, 5, 6]
    assert bool(torch.isfinite(y[others]).all()), "a non-finite token changed other tokens"
    y[others].sum().backward()             # the backward of the clean tokens runs too


@pytest.mark.parametrize("shape", [(0,), (2, 0), (0, 5)])
@pytest.mark.parametrize("name", NAMES)
def test_empty_batches_give_empty_outputs_and_zero_gradients(name, shape):
    layer = _layer(name, True)
    x = torch.randn(*shape, layer.d_model, requires_grad=True)
    y = layer(x)
    assert y.shape == (*shape, EXAMPLES[name].output_width if hasattr(EXAMPLES[name],
                       "output_width") else layer.d_model)
    (y.sum() + sparseffn.aux_loss(layer)).backward()
    for p in layer.parameters():
        if p.grad is not None:
            grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
            assert bool((grad == 0).all())


@pytest.mark.parametrize("name", NAMES)
def test_any_batch_shape_and_memory_layout(name):
    layer = _layer(name, False)
    d = layer.d_model
    x = torch.randn(2, 3, d)
    y = layer(x)
    assert y.shape[:2] == (2, 3)
    transposed = torch.randn(d, 6).t()           # non-contiguous [6, d]
    torch.testing.assert_close(layer(transposed), layer(transposed.contiguous()))
    strided = torch.randn(6, 2 * d)[:, ::2]       # a column stride of 2
    torch.testing.assert_close(layer(strided), layer(strided.contiguous()))


@pytest.mark.parametrize("name", NAMES)
def test_wrong_width_dtype_or_kind_is_a_clear_error(name):
    layer = _layer(name, False)
    label = type(layer).__name__
    d = layer.d_model
    with pytest.raises(ValueError, match=f"{label}.*d_model={d}"):
        layer(torch.randn(4, d + 1))
    with pytest.raises(ValueError, match=label):
        layer(torch.tensor(1.0))
    with pytest.raises(TypeError, match=f"{label}.*floating-point"):
        layer(torch.ones(4, d, dtype=torch.long))
    with pytest.raises(TypeError, match=f"{label}.*float32 parameters.*float64"):
        layer(torch.randn(4, d, dtype=torch.float64))
    with pytest.raises(TypeError, match=label):
        layer([[0.0] * d])


@pytest.mark.parametrize("family", [LayerConfig, RouterConfig])
def test_configs_reject_non_finite_numbers_in_every_float_field(family):
    """Every float field of every registered config: NaN, ±inf and a string are rejected by
    name (constructed from a valid example, one field at a time)."""
    examples = {type(c): c for c in EXAMPLES.values()}
    examples.update({type(c.router): c.router for c in EXAMPLES.values()
                     if getattr(c, "router", None) is not None and not isinstance(c.router, dict)})
    checked = 0
    for cls in family._registry.values():
        if cls not in examples:
            continue
        base = examples[cls].to_dict()
        base.pop("type")
        for f in cls.__dataclass_fields__.values():
            if f.type not in ("float", "float | None"):
                continue
            for bad in (math.nan, math.inf, -math.inf, "x"):
                with pytest.raises(ValueError, match=f"{cls.__name__}.{f.name}"):
                    cls(**{**base, f.name: bad})
                checked += 1
    assert checked > 0


def test_layers_take_their_config_as_a_dict_or_say_what_they_take():
    layer = sparseffn.SigmaMoE({"d_model": 8, "num_experts": 4, "expert_size": 4, "k": 2})
    assert layer(torch.randn(3, 8)).shape == (3, 8)
    with pytest.raises(TypeError, match="SigmaMoE takes a SigmaMoEConfig"):
        sparseffn.SigmaMoE(sparseffn.DenseMLPConfig(d_model=8, d_ff=4))
    with pytest.raises(TypeError, match="dict of type 'moe'"):
        sparseffn.SigmaMoE({"type": "moe", "d_model": 8})


def test_an_explicit_tree_matrix_with_nan_is_rejected():
    from sparseffn.routers.tree import TreeRouterConfig
    with pytest.raises(ValueError, match="t_matrix must hold finite"):
        TreeRouterConfig(t_matrix=((1.0, float("nan")), (0.0, 1.0)))


def test_exact_assignment_ranks_non_finite_scores_last():
    scores = torch.rand(6, 3)
    scores[1] = float("nan")
    scores[4, 2] = float("inf")
    assignment = exact_balanced_assignment(scores, 1)
    assert assignment.shape == (6, 1) and int(assignment[4, 0]) == 2
    assert torch.bincount(assignment.view(-1), minlength=3).max() <= 2


def test_a_nan_token_leaves_the_sinkhorn_plan_finite_and_finite_rows_as_they_were():
    torch.manual_seed(0)
    logits = torch.randn(20, 5)
    plain = logits.clone()                 # the iteration on finite logits, written out
    for _ in range(8):
        plain = plain - plain.logsumexp(0, keepdim=True) + math.log(20 / 5)
        plain = plain - plain.logsumexp(1, keepdim=True)
    torch.testing.assert_close(sinkhorn_log_plan(logits, 8), plain)
    logits[3] = float("nan")
    logits[5, 1] = float("inf")
    plan = sinkhorn_log_plan(logits, 8)
    assert bool(plan.isfinite().all())
    torch.testing.assert_close(plan.exp().sum(1), torch.ones(20))
    assert int(plan[5].argmax()) == 1
    equal = logits.clone()
    equal[3] = 0.0                         # a NaN token ranks every expert alike
    torch.testing.assert_close(plan[3], sinkhorn_log_plan(equal, 8)[3])


def test_noisy_top_k_and_exact_s_base_train_through_nan():
    for router in (sparseffn.NoisyTopKRouterConfig(),
                   sparseffn.SBaseRouterConfig(assignment="exact")):
        torch.manual_seed(0)
        layer = sparseffn.MoE(d_model=8, num_experts=4, expert_size=4, k=2, router=router).train()
        x = torch.randn(6, 8)
        x[2, 0] = float("nan")
        y = layer(x)
        assert bool(torch.isfinite(y[[0, 1, 3, 4, 5]]).all())


def test_product_key_retrieval_under_bf16_autocast_picks_the_fp32_keys():
    torch.manual_seed(0)
    layer = sparseffn.ProductKeyMemory(d_model=32, num_subkeys=64, heads=2, k=8, key_dim=32)
    x = torch.randn(64, 32)
    _, want = layer.router.retrieve(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, got = layer.router.retrieve(x)
    # the query network itself runs in bf16 under autocast; only ties could differ
    assert (got == want).float().mean() > 0.97
    _, in_bf16_module = layer.to(torch.bfloat16).router.retrieve(x.to(torch.bfloat16))
    assert in_bf16_module.shape == want.shape


def test_matrix_sparse_fff_under_bf16_autocast():
    from sparseffn.routers.tree import TreeRouterConfig
    layer = sparseffn.build_layer(sparseffn.FFFConfig(
        d_model=8, depth=3, leaf_width=4, router=TreeRouterConfig(formulation="matrix_sparse")))
    x = torch.randn(5, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    assert bool(torch.isfinite(x.grad).all())
