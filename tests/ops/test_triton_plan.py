"""The counting sort of ops/triton_plan against the stable ``torch.sort`` it replaces in a
:class:`~sparseffn.ops.DispatchPlan`: on the GPU when there is one, else in Triton's CPU
interpreter. Every allocation is poisoned (tests/poison.py), so an output element the kernels
did not write fails the comparisons."""

import copy
import importlib

import pytest
import torch

from tests.ops.triton_cases import skip_without_usable_triton

skip_without_usable_triton()

import sparseffn   # noqa: E402
from sparseffn.ops import DispatchPlan, triton_cvmm, triton_plan   # noqa: E402
from tests.layers.test_conformance import EXAMPLES   # noqa: E402
from tests.ops.triton_cases import DEVICE   # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_on_cpu")
# the module (``sparseffn.ops.cvmm`` is also the name of its function)
cvmm_module = importlib.import_module("sparseffn.ops.cvmm")


def _stable_sort(keys, num_experts, k):
    """The reference: a stable sort of the keys, rows' tokens, and each expert's pairs."""
    order = torch.sort(keys.cpu(), stable=True).indices
    counts = torch.stack([(keys.cpu() == e).sum() for e in range(num_experts)]) \
        if num_experts else torch.zeros(0, dtype=torch.int64)
    return order, order // max(k, 1), counts


def _keys(pairs, num_experts, dropped=0.0, seed=0):
    """Random experts of ``pairs`` pairs, a fraction ``dropped`` of them num_experts."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randint(0, num_experts, (pairs,), generator=gen)
    keys[torch.rand(pairs, generator=gen) < dropped] = num_experts
    return keys.to(DEVICE)


def _equal(got, want):
    for g, w, name in zip(got, want, ("order", "token_of_row", "counts")):
        assert g.dtype == torch.int64, name
        assert torch.equal(g.cpu(), w), name


@pytest.mark.parametrize("pairs, num_experts, k, chunk", [
    (1, 1, 1, None),            # one pair, one expert
    (7, 3, 1, None),            # fewer pairs than a block
    (3001, 8, 4, None),         # several default chunks, the last one partial
    (1999, 63, 2, 48),          # 64 bins; chunks not a multiple of the block (rounded up)
    (777, triton_plan.MAX_EXPERTS, 3, 16),  # the most experts: 256 bins, 49 chunks
    (500, 16, 5, 16),           # 17 bins (padded to 32); chunks of one block
])
def test_counting_sort_is_the_stable_sort(pairs, num_experts, k, chunk):
    """Order, rows' tokens and counts equal the stable sort's, element for element, with
    pairs dropped at capacity sorted last and not counted."""
    keys = _keys(pairs, num_experts, dropped=0.2)
    got = triton_plan.expert_order(keys, num_experts, k, chunk=chunk)
    _equal(got, _stable_sort(keys, num_experts, k))


def test_experts_without_pairs_and_all_pairs_in_one_expert():
    keys = torch.full((300,), 5, device=DEVICE)
    keys[::7] = 9                                    # the dropped bin (9 experts)
    got = triton_plan.expert_order(keys, 9, 2, chunk=32)
    _equal(got, _stable_sort(keys, 9, 2))
    assert got[2].tolist() == [0] * 5 + [300 - 43] + [0] * 3


def test_an_empty_batch_gives_empty_orders_and_zero_counts():
    order, token_of_row, counts, mass = triton_plan.expert_order(
        torch.zeros(0, dtype=torch.int64, device=DEVICE), 6, 4,
        torch.zeros(0, device=DEVICE))
    assert order.shape == token_of_row.shape == (0,)
    assert counts.tolist() == [0] * 6 and mass.tolist() == [0.0] * 6


def test_keys_outside_the_experts_sort_with_the_dropped_pairs():
    """An invalid expert index (unchecked on a GPU unless checks are on) is never computed:
    the order stays a permutation and the pair sorts as if dropped."""
    keys = _keys(400, 6, seed=1)
    bad = keys.clone()
    bad[3], bad[50], bad[399] = -1, 7, 1 << 40
    got = triton_plan.expert_order(bad, 6, 2, chunk=64)
    dropped = bad.clone()
    dropped[(bad < 0) | (bad > 6)] = 6
    _equal(got, _stable_sort(dropped, 6, 2))


def test_narrow_key_dtypes_sort_the_same():
    keys = _keys(600, 12, dropped=0.1, seed=2)
    want = triton_plan.expert_order(keys, 12, 3, chunk=64)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        _equal(triton_plan.expert_order(keys.to(dtype), 12, 3, chunk=64),
               [w.cpu() for w in want])


def test_chunks_grow_to_keep_at_most_max_chunks(monkeypatch):
    """Every program of the second launch reads all chunks' counts, so a large batch gets
    larger chunks, not more of them; the sort is the same."""
    bins, block, chunk, chunks = triton_plan._sizes(10 ** 7, 64, None)
    assert bins == 128 and chunks <= 256 and chunk % block == 0
    assert (chunks - 1) * chunk < 10 ** 7 <= chunks * chunk
    assert triton_plan._sizes(5000, 8, None)[2:] == (1024, 5)
    monkeypatch.setattr(triton_plan, "MAX_CHUNKS", 3)
    monkeypatch.setattr(triton_plan, "CHUNK", 16)
    keys = _keys(1000, 10, dropped=0.1, seed=3)
    assert triton_plan._sizes(1000, 10, None)[2:] == (512, 2)
    _equal(triton_plan.expert_order(keys, 10, 4), _stable_sort(keys, 10, 4))


def _calls_of(monkeypatch, name):
    """The number of experts of each call of ``triton_plan.<name>`` while the test runs."""
    calls = []
    counting_sort = getattr(triton_plan, name)
    monkeypatch.setattr(triton_plan, name,
                        lambda *a, **kw: calls.append(a[1]) or counting_sort(*a, **kw))
    return calls


@pytest.mark.parametrize("dropping", [False, True])
def test_plans_are_built_by_the_counting_sort_and_equal_the_torch_plan(monkeypatch, dropping):
    """``DispatchPlan.build`` sorts through the counting sort where it applies, and builds
    the plan of the PyTorch sort; above ``MAX_EXPERTS`` experts it takes the PyTorch sort."""
    calls = _calls_of(monkeypatch, "expert_order")
    gen = torch.Generator().manual_seed(4)
    for experts in (5, triton_plan.MAX_EXPERTS + 1):
        indices = torch.randint(0, experts, (3, 41, 2), generator=gen).to(DEVICE)
        dispatched = (torch.rand(3, 41, 2, generator=gen) < 0.8).to(DEVICE) if dropping \
            else None
        plan = DispatchPlan.build(indices, experts, dispatched)
        keys = indices.reshape(-1)
        if dropping:
            keys = keys.masked_fill(~dispatched.reshape(-1), experts)
        want = cvmm_module._expert_order_torch(keys.cpu(), experts, 2)
        _equal((plan.order, plan.token_of_row, plan.counts), want)
    assert calls == [5]


def test_the_operator_traces_and_matches_its_fake():
    keys = _keys(300, 7, dropped=0.1, seed=5)
    torch.library.opcheck(torch.ops.sparseffn.expert_order.default, (keys, 7, 3))
    weights = torch.rand(300, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    torch.library.opcheck(torch.ops.sparseffn.expert_order.default, (keys, 7, 3, weights))


def test_a_compiled_plan_is_one_graph_through_the_operator():
    """Under ``torch.compile`` the counting sort is one opaque node of the plan's graph (no
    graph break, nothing read on the host), and gives the eager plan."""
    targets = []

    def backend(gm, example_inputs):
        targets.extend(str(node.target) for node in gm.graph.nodes)
        return gm.forward

    def build(indices):
        plan = DispatchPlan.build(indices, 6)
        return plan.order, plan.token_of_row, plan.counts

    indices = torch.randint(0, 6, (37, 2), generator=torch.Generator().manual_seed(6))
    indices = indices.to(DEVICE)
    torch._dynamo.reset()
    got = torch.compile(build, fullgraph=True, backend=backend)(indices)
    assert "sparseffn.expert_order.default" in targets
    assert not any("sort" in t and "expert_order" not in t for t in targets)
    _equal(got, [w.cpu() for w in build(indices)])


def _positions_by_counting(experts, num_experts):
    """The reference: each pair's count of earlier pairs of its expert, in a loop."""
    seen = [0] * (num_experts + 1)
    out = []
    for e in experts.tolist():
        out.append(seen[e])
        seen[e] += 1
    return out


@pytest.mark.parametrize("pairs, num_experts, chunk", [
    (1, 1, None), (9, 4, None), (3001, 8, None), (1000, 63, 32),
    (600, triton_plan.MAX_EXPERTS, 16),
])
def test_capacity_positions_count_the_earlier_pairs_of_each_expert(pairs, num_experts, chunk):
    """Switch's buffer positions from the counting sort: each pair's rank among its expert's
    pairs, in pair order, across chunks."""
    experts = _keys(pairs, num_experts, seed=7)
    got = triton_plan.positions_in_expert(experts, num_experts, chunk=chunk)
    assert got.dtype == torch.int64
    assert got.cpu().tolist() == _positions_by_counting(experts.cpu(), num_experts)
    assert triton_plan.positions_in_expert(experts[:0], num_experts).shape == (0,)


def test_positions_go_through_the_operator_for_one_group_only(monkeypatch):
    """``positions_in_expert`` takes the counting sort for one group (Switch), the sort for
    groups (GShard) and above MAX_EXPERTS experts; the same positions each way, and the
    operator traces."""
    assignment = importlib.import_module("sparseffn.ops.assignment")
    calls = _calls_of(monkeypatch, "positions_in_expert")
    gen = torch.Generator().manual_seed(8)
    for experts in (6, triton_plan.MAX_EXPERTS + 1):
        top1 = torch.randint(0, experts, (500,), generator=gen)
        got = assignment.positions_in_expert(top1.to(DEVICE), experts)
        assert got.cpu().tolist() == _positions_by_counting(top1, experts)
    groups = torch.randint(0, 3, (500,), generator=gen)
    grouped = assignment.positions_in_expert(top1.to(DEVICE) % 6, 6, groups.to(DEVICE), 3)
    assert grouped.cpu().tolist() == \
        _positions_by_counting(groups * 6 + top1 % 6, 18)
    assert calls == [6]
    torch.library.opcheck(torch.ops.sparseffn.expert_positions.default,
                          (top1[:300].to(DEVICE) % 6, 6))


def _mass_by_summing(keys, weights, num_experts):
    """The reference: each expert's weights summed in float64."""
    keys, weights = keys.cpu(), weights.cpu().double()
    return torch.stack([weights[keys == e].sum() for e in range(num_experts)])


@pytest.mark.parametrize("pairs, num_experts, chunk, dtype", [
    (1, 1, None, torch.float32), (3001, 8, None, torch.float32),
    (1000, 63, 32, torch.float16), (600, triton_plan.MAX_EXPERTS, 16, torch.float32),
])
def test_the_mass_is_each_experts_weights_summed_the_same_on_every_run(
        pairs, num_experts, chunk, dtype):
    """With weights, the sort also sums them per expert (the usage statistics' mass) in
    float32, dropped pairs left out, in a fixed order (the same bits twice), and still
    gives the stable sort's order."""
    keys = _keys(pairs, num_experts, dropped=0.2, seed=9)
    weights = torch.rand(pairs, generator=torch.Generator().manual_seed(9)).to(dtype)
    weights = weights.to(DEVICE)
    got = triton_plan.expert_order(keys, num_experts, 2, weights, chunk=chunk)
    _equal(got[:3], _stable_sort(keys, num_experts, 2))
    mass = got[3]
    assert mass.dtype == torch.float32 and mass.shape == (num_experts,)
    torch.testing.assert_close(mass.cpu().double(), _mass_by_summing(keys, weights, num_experts),
                               rtol=1e-6, atol=1e-6)
    again = triton_plan.expert_order(keys, num_experts, 2, weights, chunk=chunk)[3]
    assert torch.equal(mass, again)


def test_a_nan_weight_makes_only_its_experts_mass_nan():
    keys = torch.tensor([0, 1, 2, 1, 3, 0], device=DEVICE)
    weights = torch.tensor([0.5, float("nan"), 0.25, 1.0, float("nan"), 2.0], device=DEVICE)
    mass = triton_plan.expert_order(keys, 3, 1, weights)[3].cpu()   # key 3: dropped
    assert mass[1].isnan() and mass[[0, 2]].tolist() == [2.5, 0.25]


def test_a_layer_takes_its_usage_mass_from_the_plan(monkeypatch):
    """A σ-MoE training step's usage statistics: counts and mass from the plan's counting
    sort, with no scatter of their own; the torch path's numbers."""
    routing = importlib.import_module("sparseffn.routing")
    torch.manual_seed(0)
    layer = sparseffn.build_layer(EXAMPLES["layer:sigma_moe"]).to(DEVICE).train()
    twin = copy.deepcopy(layer)
    x = torch.randn(37, layer.config.d_model, device=DEVICE)
    scatters = []
    per_expert = routing.sum_per_expert
    monkeypatch.setattr(routing, "sum_per_expert",
                        lambda *a: scatters.append(1) or per_expert(*a))
    layer(x)
    assert not scatters
    triton_cvmm.set_triton_enabled(False)
    try:
        twin(x)
    finally:
        triton_cvmm.set_triton_enabled(True)
    assert scatters, "the torch path sums the mass itself"
    for name in ("counts", "mass"):
        torch.testing.assert_close(layer.routing_stats[name], twin.routing_stats[name])


def test_the_counting_sort_can_be_turned_off(monkeypatch):
    """``set_counting_sort_enabled(False)`` (``SPARSEFFN_COUNTING_SORT=0``) sorts plans and
    positions with PyTorch on the kernels' devices too."""
    sorts = _calls_of(monkeypatch, "expert_order")
    positions = _calls_of(monkeypatch, "positions_in_expert")
    assignment = importlib.import_module("sparseffn.ops.assignment")
    indices = torch.randint(0, 4, (20, 2), generator=torch.Generator().manual_seed(10))
    triton_plan.set_counting_sort_enabled(False)
    try:
        plan = DispatchPlan.build(indices.to(DEVICE), 4)
        assignment.positions_in_expert(indices[:, 0].to(DEVICE), 4)
    finally:
        triton_plan.set_counting_sort_enabled(True)
    assert plan.mass is None and not sorts and not positions
    assert triton_plan.usable(indices.to(DEVICE), 4)


def test_weights_of_another_shape_than_the_indices_are_refused():
    indices = torch.zeros(5, 2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"weights must have the indices' shape \(5, 2\)"):
        DispatchPlan.build(indices, 3, weights=torch.ones(10, device=DEVICE))


def test_the_operators_pytorch_path_gives_the_kernels_results():
    """``sparseffn::expert_order`` with the counting sort off (a direct call where the kernels
    do not run): the same order, tokens and counts, and the same mass to rounding, invalid
    keys counted with the dropped pairs as the kernels count them."""
    keys = _keys(700, 9, dropped=0.1, seed=11)
    keys[[5, 77, 300]] = torch.tensor([-2, 12, 9], device=DEVICE)
    weights = torch.rand(700, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    want = torch.ops.sparseffn.expert_order(keys, 9, 3, weights)
    triton_plan.set_counting_sort_enabled(False)
    try:
        got = torch.ops.sparseffn.expert_order(torch.where((keys < 0) | (keys > 9), 9, keys),
                                               9, 3, weights)
        got_invalid = torch.ops.sparseffn.expert_order(keys, 9, 3, weights)
    finally:
        triton_plan.set_counting_sort_enabled(True)
    _equal(got[:3], [w.cpu() for w in want[:3]])
    torch.testing.assert_close(got[3], want[3])
    torch.testing.assert_close(got_invalid[3], want[3])
