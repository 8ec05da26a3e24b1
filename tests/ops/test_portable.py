"""The portable forms of the inference operators (``sparseffn.ops.portable``, what ONNX export
runs) against the operators themselves and the float64 loop of Eq. 25: odd sizes, an expert
with no rows, pairs dropped at capacity, an empty batch, and NaN in the input.

Ties between equal scores are left to ``tests/test_onnx.py``: the forms rank with
``torch.topk``, whose order among equal values ONNX's TopK fixes (by index) and PyTorch's CPU
kernel does not."""

import pytest
import torch

from sparseffn.activations import activation_fn
from sparseffn.ops import DispatchPlan, kernels, portable
from tests.ops.reference import expert_mlp_reference

E, M, N = 5, 13, 7          # experts, input width, output width (odd)


def _plan(tokens: int, k: int, seed: int, drop: bool):
    """Indices over experts 0, 1, 3, 4 (expert 2 gets no row); with ``drop``, every third
    pair is dropped (never computed)."""
    gen = torch.Generator().manual_seed(seed)
    indices = torch.tensor([0, 1, 3, 4])[torch.randint(0, 4, (tokens, k), generator=gen)]
    dispatched = (torch.arange(tokens * k) % 3 != 0).view(tokens, k) if drop else None
    return indices, DispatchPlan.build(indices, E, dispatched), gen


def _assert_same(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("tokens", [0, 1, 11])
@pytest.mark.parametrize("drop", [False, True])
def test_cvmm_rows_first_layer_as_the_operator(tokens, drop):
    """Rows gathered from the tokens, ReLU; the hidden rows of dropped pairs exactly zero."""
    k = 3
    _, plan, gen = _plan(tokens, k, 0, drop)
    x = torch.randn(tokens, M, generator=gen)
    if tokens > 4:
        x[4, 2] = float("nan")
    weight = torch.randn(E, M, N, generator=gen)
    args = (x, weight, plan.counts, plan.token_of_row, None, None, plan.order.shape[0], 1,
            True, None, None)
    got, want = portable.cvmm_rows(*args), kernels.cvmm_rows(*args)
    _assert_same(got[0], want[0])
    assert got[1].shape == want[1].shape == (0,)


@pytest.mark.parametrize("tokens", [0, 1, 11])
@pytest.mark.parametrize("drop", [False, True])
def test_cvmm_rows_second_layer_as_the_operator(tokens, drop):
    """Sorted rows scaled by the gates and summed into each token's k slots."""
    k = 3
    _, plan, gen = _plan(tokens, k, 1, drop)
    rows = torch.randn(tokens * k, M, generator=gen)
    if tokens > 4:
        rows[5, 0] = float("nan")
    gates = torch.rand(tokens * k, generator=gen).index_select(0, plan.order)
    gates[int(plan.counts.sum()):] = float("nan")   # a dropped row's scale may be anything
    weight = torch.randn(E, M, N, generator=gen)
    args = (rows, weight, plan.counts, None, plan.order, gates, tokens, k, False, None, None)
    got, want = portable.cvmm_rows(*args), kernels.cvmm_rows(*args)
    _assert_same(got[0], want[0])


@pytest.mark.parametrize("drop", [False, True])
def test_cvmm_rows_mask_and_dots_as_the_operator(drop):
    """The backward's options (a ReLU mask, the gate dots), which the forms also take."""
    tokens, k = 9, 2
    _, plan, gen = _plan(tokens, k, 2, drop)
    grad = torch.randn(tokens, N, generator=gen)
    weight = torch.randn(E, N, M, generator=gen)
    rows = plan.order.shape[0]
    hidden = torch.randn(rows, M, generator=gen)
    scale = torch.rand(rows, generator=gen)
    args = (grad, weight, plan.counts, plan.token_of_row, None, scale, rows, 1, False, hidden,
            hidden)
    got, want = portable.cvmm_rows(*args), kernels.cvmm_rows(*args)
    _assert_same(got[0], want[0])
    _assert_same(got[1], want[1])


@pytest.mark.parametrize("gated, biases, activation",
                         [(False, False, "relu"), (False, True, "gelu"), (True, False, "silu"),
                          (True, True, "quick_gelu")])
@pytest.mark.parametrize("tokens", [0, 1, 11])
def test_expert_mlp_pairs_as_the_loop_of_eq_25(gated, biases, activation, tokens):
    """Every MLP option, pairs not kept adding zero, an expert never chosen, one NaN token,
    against the float64 loop and the operator."""
    k, G = 3, 6
    indices, _, gen = _plan(tokens, k, 3, False)
    x = torch.randn(tokens, M, generator=gen)
    if tokens > 4:
        x[4, 1] = float("nan")
    gates = torch.rand(tokens, k, generator=gen)
    keep = torch.rand(tokens, k, generator=gen) > 0.3
    w1, w2 = torch.randn(E, G, M, generator=gen), torch.randn(E, G, N, generator=gen)
    w_gate = torch.randn(E, G, M, generator=gen) if gated else None
    b1 = torch.randn(E, G, generator=gen) if biases else None
    b2 = torch.randn(E, N, generator=gen) if biases else None
    args = (x, indices, gates, w1, w2, activation, b1, b2, w_gate, keep)
    got = portable.expert_mlp_pairs(*args)
    _assert_same(got, kernels.expert_mlp_pairs(*args))
    want = expert_mlp_reference(
        x.double(), indices, (gates * keep).double(), w1.double().transpose(1, 2),
        w2.double(), activation_fn(activation),
        w_gate=None if w_gate is None else w_gate.double().transpose(1, 2),
        b1=None if b1 is None else b1.double(), b2=None if b2 is None else b2.double())
    torch.testing.assert_close(got, want.float(), rtol=1e-4, atol=1e-4, equal_nan=True)
    if tokens > 4:   # the NaN stays in its token
        assert torch.isnan(got).any(1).nonzero().flatten().tolist() == [4]


@pytest.mark.parametrize("tokens", [0, 1, 10])
def test_gathered_rows_as_the_operators(tokens):
    """gather_sum and gather_dot; a NaN table row reaches only the tokens that pick it."""
    gen = torch.Generator().manual_seed(4)
    table = torch.randn(17, M, generator=gen)
    table[3, 5] = float("nan")
    idx = torch.randint(0, 17, (tokens, 4), generator=gen)
    weights, x = torch.rand(tokens, 4, generator=gen), torch.randn(tokens, M, generator=gen)
    _assert_same(portable.gather_sum(idx, weights, table), kernels.gather_sum(idx, weights, table))
    _assert_same(portable.gather_dot(x, table, idx), kernels.gather_dot(x, table, idx))


@pytest.mark.parametrize("rows", [0, 1, 6])
def test_top_k_as_the_operators(rows):
    """topk_rows and product_key_topk (with a -inf score, which the operators rank below
    every finite one) on scores without ties. (+inf ranks as a huge finite number, and its
    sums with the other half's scores round to one value: ties, for the ONNX test.)"""
    gen = torch.Generator().manual_seed(5)
    scores = torch.randn(rows, 9, generator=gen)
    for got, want in zip(portable.topk_rows(scores, 4), kernels.topk_rows(scores, 4)):
        _assert_same(got, want)
    a, b = torch.randn(rows, 6, generator=gen), torch.randn(rows, 5, generator=gen)
    if rows > 1:
        a[1, 2], b[0, 4] = float("-inf"), float("-inf")
    for k in (1, 7):
        got, want = portable.product_key_topk(a, b, k), kernels.product_key_topk(a, b, k)
        _assert_same(got[0], want[0])
        assert torch.equal(got[1], want[1])


@pytest.mark.parametrize("form", ["_products_per_expert", "_products_in_blocks"])
@pytest.mark.parametrize("counts", [[0, 19, 1, 2], [20, 0, 0, 0], [3, 3, 3, 3], [0, 0, 0, 0]])
def test_expert_products_as_a_loop_over_the_experts(form, counts):
    """Both forms of the per-expert products (one product per expert; rows cut into blocks
    of each expert's rows and one batched product) against a float64 loop over the experts:
    a busy expert (cut into many blocks), experts with no rows, two rows dropped after the
    last expert's (NaN there), more dropped, and no row kept; a NaN row stays in its row."""
    gen = torch.Generator().manual_seed(7)
    rows = torch.randn(24, M, generator=gen)
    rows[22:, 0] = float("nan")                       # dropped: exactly zero, even against NaN
    rows[1, 3] = float("nan")
    weight = torch.randn(4, M, N, generator=gen)
    counts = torch.tensor(counts, dtype=torch.int32)
    want = torch.zeros(24, N, dtype=torch.float64)
    start = 0
    for e, count in enumerate(counts.tolist()):
        want[start:start + count] = rows[start:start + count].double() @ weight[e].double()
        start += count
    got = getattr(portable, form)(rows, weight, counts)
    torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5, equal_nan=True)
    assert torch.isnan(got).any(1).nonzero().flatten().tolist() == ([1] if start > 1 else [])


def test_the_expert_products_trace_to_one_graph_for_any_number_of_experts():
    """Above ``PER_EXPERT_PRODUCTS_UP_TO`` experts, what ONNX export traces for the expert
    products has the same nodes for any number of experts: a product per expert made a
    64-expert σ-MoE layer take about a minute to export."""
    class Products(torch.nn.Module):
        def forward(self, rows, weight, counts):
            return portable._per_expert_products(rows, weight, counts)

    def traced_ops(experts: int) -> list[str]:
        rows, weight = torch.randn(30, M), torch.randn(experts, M, N)
        counts = torch.bincount(torch.arange(30) % experts, minlength=experts)
        program = torch.export.export(Products(), (rows, weight, counts),
                                      dynamic_shapes=({0: torch.export.Dim("rows")}, None, None))
        return [str(node.target) for node in program.graph.nodes]
    assert traced_ops(portable.PER_EXPERT_PRODUCTS_UP_TO + 1) == traced_ops(40)


@pytest.mark.parametrize("biased", [False, True])
def test_fff_descend_as_the_operator(biased):
    gen = torch.Generator().manual_seed(6)
    depth, x = 3, torch.randn(10, M, generator=gen)
    weight = torch.randn(2 ** depth - 1, M, generator=gen)
    bias = torch.randn(2 ** depth - 1, generator=gen) if biased else None
    assert torch.equal(kernels.fff_descend_torch(x, weight, bias, depth),
                       kernels.fff_descend(x, weight, bias, depth))


def test_every_inference_operator_has_a_form():
    """The operators a layer's inference forward calls (the backward ones, row_index,
    dense_rows, scatter_*, expert_weight_grad, fff_expand_backward, are not exported)."""
    inference = {"cvmm_rows", "expert_mlp_pairs", "gather_dot", "gather_sum", "topk_rows",
                 "product_key_topk", "fff_expand", "fff_descend"}
    assert {op.name().split("::")[1] for op in portable.forms()} == inference
