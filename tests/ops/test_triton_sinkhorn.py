"""The Triton kernels of S-BASE's assignment (ops/triton_sinkhorn) against the PyTorch form
(``sinkhorn_log_plan`` and a top-k): on the GPU when there is one, else in Triton's CPU
interpreter (fp32 and fp16 logits)."""

import pytest
import torch

from tests.ops.triton_cases import skip_without_usable_triton

skip_without_usable_triton()

from sparseffn import SBaseRouterConfig   # noqa: E402
from sparseffn.ops import assignment, triton_sinkhorn   # noqa: E402
from sparseffn.ops.assignment import sinkhorn_log_plan   # noqa: E402
from sparseffn.routers import build_router   # noqa: E402
from tests.ops.triton_cases import DEVICE, DTYPES, torch_path   # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_on_cpu")


def _logits(tokens, experts, dtype, seed=0, pad=3):
    """Skewed logits [tokens, experts] as a view of wider rows (the kernels take a row
    stride)."""
    gen = torch.Generator().manual_seed(seed)
    wide = 2 * torch.randn(tokens, experts + pad, generator=gen)
    wide[:, :experts] += torch.linspace(0, 2, experts)
    return wide.to(dtype).to(DEVICE)[:, :experts]


def _assert_top_k_of_the_plan(got, logits, iterations, k):
    """``got`` [T, k] holds k distinct experts per token whose plan entries are the plan's k
    largest, best first (to float32 rounding: the kernel's plan differs from the PyTorch
    form's by that, so exact near-ties may fall the other way)."""
    plan = sinkhorn_log_plan(logits.float().cpu(), iterations)
    got = got.cpu()
    tokens, experts = plan.shape
    assert got.shape == (tokens, k) and got.dtype == torch.int64
    assert bool(((got >= 0) & (got < experts)).all())
    assert all(len(set(row)) == k for row in got.tolist())
    chosen = plan.gather(1, got)
    want = torch.topk(plan, k, dim=1).values
    # log-probabilities, O(1) to O(10) (O(2^120) where a logit was not finite): an absolute
    # tolerance for the first, a relative one for the second
    torch.testing.assert_close(chosen, want, atol=2e-4, rtol=1e-5)
    assert bool((chosen[:, :-1] >= chosen[:, 1:] - 2e-4).all()), "not best first"


# (tokens, experts, k, iterations, max_programs): one block; several programs of one block;
# programs of several blocks with a partial last block; more experts than a block of tokens
# holds (8 tokens a block); partials combined in two chunks (13 programs, 8 a chunk).
CASES = [(1, 1, 1, 1, 128), (37, 5, 2, 8, 128), (300, 33, 4, 3, 2), (20, 300, 7, 2, 128),
         (100, 300, 5, 3, 128), (65, 8, 8, 8, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,experts,k,iterations,max_programs", CASES)
def test_kernel_picks_each_tokens_top_k_of_the_plan(tokens, experts, k, iterations,
                                                     max_programs, dtype):
    logits = _logits(tokens, experts, dtype)
    got = triton_sinkhorn.sinkhorn_topk(logits, iterations, k, max_programs=max_programs)
    _assert_top_k_of_the_plan(got, logits, iterations, k)


def test_kernel_equals_the_torch_path_where_the_plan_has_no_near_ties():
    logits = _logits(200, 6, torch.float32, seed=3)
    got = triton_sinkhorn.sinkhorn_topk(logits, 8, 3, max_programs=4)
    want = torch_path(assignment.sinkhorn_topk, logits, 8, 3)
    plan = torch.sort(sinkhorn_log_plan(logits.cpu(), 8), dim=1, descending=True).values
    clear = (plan[:, :3] - plan[:, 1:4]).min(1).values > 1e-3     # rows with no near-tie
    assert int(clear.sum()) > 150
    assert torch.equal(got.cpu()[clear], want.cpu()[clear])


def test_the_kernels_first_choices_balance_a_skewed_batch():
    tokens, experts = 512, 8
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(tokens, experts, generator=gen)
              + torch.linspace(0, 3, experts)).to(DEVICE)     # most tokens prefer the last
    got = triton_sinkhorn.sinkhorn_topk(logits, 30, 1, max_programs=3)
    share = tokens / experts
    balanced = torch.bincount(got.flatten().cpu(), minlength=experts) / share
    greedy = torch.bincount(logits.argmax(1).cpu(), minlength=experts) / share
    assert 0.4 < balanced.min() and balanced.max() < 1.4
    assert greedy.max() > 3


def test_empty_batches_and_k_zero_give_empty_assignments():
    assert triton_sinkhorn.sinkhorn_topk(torch.zeros(0, 4, device=DEVICE), 8, 2).shape == (0, 2)
    assert triton_sinkhorn.sinkhorn_topk(torch.ones(5, 4, device=DEVICE), 8, 0).shape == (5, 0)
    assert assignment.sinkhorn_topk(torch.zeros(0, 4, device=DEVICE), 8, 2).shape == (0, 2)


def test_non_finite_logits_are_ranked_as_the_torch_path_ranks_them():
    logits = _logits(50, 6, torch.float32, seed=1).contiguous()
    logits[3] = float("nan")                       # a NaN token: every expert alike
    logits[7, 2] = float("inf")
    logits[9, 0] = float("-inf")
    logits[11, 4] = float("nan")
    plan = sinkhorn_log_plan(logits.cpu(), 8)
    assert bool(plan.isfinite().all()), "one NaN token spread to the whole plan"
    torch.testing.assert_close(plan.exp().sum(1), torch.ones(50))
    got = triton_sinkhorn.sinkhorn_topk(logits, 8, 3, max_programs=2)
    _assert_top_k_of_the_plan(got, logits, 8, 3)
    assert int(got[7, 0]) == 2 and 0 not in got[9].tolist()
    # the NaN token ranks every expert alike: its plan is a token with equal logits'
    equal = logits.cpu().clone()
    equal[3] = 0.0
    torch.testing.assert_close(plan[3], sinkhorn_log_plan(equal, 8)[3])


def test_bad_arguments_are_clear_errors():
    logits = torch.randn(6, 4, device=DEVICE)
    with pytest.raises(ValueError, match="k=5 distinct experts of 4"):
        assignment.sinkhorn_topk(logits, 8, 5)
    with pytest.raises(ValueError, match="at least one iteration"):
        assignment.sinkhorn_topk(logits, 0, 2)
    with pytest.raises(ValueError, match="at least one iteration"):
        triton_sinkhorn.sinkhorn_topk(logits, 0, 2)
    with pytest.raises(ValueError, match="k=5 distinct experts of 4"):
        triton_sinkhorn.sinkhorn_topk(logits, 8, 5)
    with pytest.raises(ValueError, match="at least one iteration"):
        torch_path(assignment.sinkhorn_topk, logits, 0, 2)     # the PyTorch form checks too


def test_the_s_base_router_trains_through_the_kernel():
    torch.manual_seed(0)
    router = build_router(SBaseRouterConfig(), 6, 8, 2).to(DEVICE).train()
    x = torch.randn(96, 6, device=DEVICE, requires_grad=True)
    routing = router(x)
    logits = (x @ router.weight.t()).detach()
    _assert_top_k_of_the_plan(routing.indices, logits, 8, 2)
    routing.weights.sum().backward()
    assert router.weight.grad is not None and bool(router.weight.grad.abs().sum() > 0)


def test_the_assignment_compiles_in_one_graph():
    logits = _logits(40, 5, torch.float32, seed=2).contiguous()
    compiled = torch.compile(lambda t: assignment.sinkhorn_topk(t, 4, 2), backend="aot_eager",
                             fullgraph=True)
    _assert_top_k_of_the_plan(compiled(logits), logits, 4, 2)
