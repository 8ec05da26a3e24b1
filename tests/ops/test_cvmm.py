import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.reference import cvmm_reference
from sparseffn.ops import DispatchPlan, cvmm
from sparseffn.ops.ids import id_dtype


def _inputs(T, k, E, m, n, per_slot=False, dtype=torch.float32, gated=False):
    x = torch.randn(T, k, m) if per_slot else torch.randn(T, m)
    indices = torch.randint(0, E, (T, k))
    weight = torch.randn(E, m, n)
    gates = torch.rand(T, k) if gated else None
    tensors = [x.to(dtype), weight.to(dtype)] + ([gates.to(dtype)] if gated else [])
    for t in tensors:
        t.requires_grad_(True)
    return indices, tensors


def _check(indices, tensors, E, gated, atol=1e-4, rtol=1e-4, **kwargs):
    x, weight = tensors[0], tensors[1]
    gates = tensors[2] if gated else None
    plan = DispatchPlan.build(indices, E)
    out = cvmm(x, plan, weight, gates, **kwargs)
    ref_inputs = [t.detach().float().requires_grad_(True) for t in tensors]
    ref = cvmm_reference(ref_inputs[0], indices, ref_inputs[1], ref_inputs[2] if gated else None)
    assert out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
    grad = torch.randn_like(ref)
    out.backward(grad.to(out.dtype))
    if ref.requires_grad:
        ref.backward(grad)
    for got, want in zip(tensors, ref_inputs):
        if want.grad is None:   # nothing reached the reference input (empty batch)
            want.grad = torch.zeros_like(want)
        assert got.grad is not None
        torch.testing.assert_close(got.grad.float(), want.grad, atol=atol * 10, rtol=rtol * 10)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("per_slot", [False, True])
def test_cvmm_matches_reference(matmul_path, k, gated, per_slot):
    indices, tensors = _inputs(T=13, k=k, E=5, m=7, n=9, per_slot=per_slot, gated=gated)
    _check(indices, tensors, 5, gated)


@settings(max_examples=25, deadline=None)
@given(T=st.integers(0, 9), k=st.integers(1, 4), E=st.integers(1, 6),
       m=st.integers(1, 6), n=st.integers(1, 6), gated=st.booleans(), per_slot=st.booleans())
def test_cvmm_matches_reference_for_any_sizes(T, k, E, m, n, gated, per_slot):
    indices, tensors = _inputs(T, k, E, m, n, per_slot=per_slot, gated=gated)
    _check(indices, tensors, E, gated)


def test_experts_without_tokens_get_zero_gradient(matmul_path):
    E = 6
    indices = torch.tensor([[0, 2], [2, 0], [0, 2]])  # experts 1, 3, 4, 5 get nothing
    x = torch.randn(3, 4, requires_grad=True)
    weight = torch.randn(E, 4, 5, requires_grad=True)
    gates = torch.rand(3, 2, requires_grad=True)
    cvmm(x, DispatchPlan.build(indices, E), weight, gates).sum().backward()
    assert weight.grad is not None
    assert torch.all(weight.grad[[1, 3, 4, 5]] == 0)
    assert weight.grad[0].abs().sum() > 0 and weight.grad[2].abs().sum() > 0


def test_empty_batch(matmul_path):
    indices = torch.zeros(0, 3, dtype=torch.long)
    x = torch.randn(0, 4, requires_grad=True)
    weight = torch.randn(5, 4, 6, requires_grad=True)
    gates = torch.rand(0, 3, requires_grad=True)
    plan = DispatchPlan.build(indices, 5)
    out = cvmm(x, plan, weight, gates)
    assert out.shape == (0, 6)
    out.sum().backward()
    assert x.grad.shape == (0, 4) and torch.all(weight.grad == 0) and gates.grad.shape == (0, 3)
    assert cvmm(x, plan, weight).shape == (0, 3, 6)


def test_leading_batch_shape_and_non_contiguous_input(matmul_path):
    base = torch.randn(4, 5, 16)
    x = base[:, :, ::2].detach().requires_grad_(True)       # [4, 5, 8], non-contiguous
    assert not x.is_contiguous()
    indices = torch.randint(0, 3, (4, 5, 2))
    weight = torch.randn(3, 8, 6, requires_grad=True)
    gates = torch.rand(4, 5, 2).requires_grad_(True)
    out = cvmm(x, DispatchPlan.build(indices, 3), weight, gates)
    assert out.shape == (4, 5, 6)
    ref_x = x.detach().reshape(20, 8).requires_grad_(True)
    ref = cvmm_reference(ref_x, indices.reshape(20, 2), weight, gates.reshape(20, 2))
    torch.testing.assert_close(out.reshape(20, 6), ref)
    out.sum().backward()
    ref_x_grad = torch.autograd.grad(ref.sum(), ref_x)[0]
    torch.testing.assert_close(x.grad.reshape(20, 8), ref_x_grad)


def test_sorted_chain_equals_unsorted(matmul_path):
    """Two CVMMs chained through the sorted layout equal the per-slot layout."""
    indices = torch.randint(0, 4, (11, 3))
    plan = DispatchPlan.build(indices, 4)
    x = torch.randn(11, 6, requires_grad=True)
    w1, w2 = torch.randn(4, 6, 5, requires_grad=True), torch.randn(4, 5, 6, requires_grad=True)
    gates = torch.rand(11, 3, requires_grad=True)
    fast = cvmm(torch.relu(cvmm(x, plan, w1, sorted_output=True)), plan, w2, gates,
                sorted_input=True)
    slow = cvmm(torch.relu(cvmm(x, plan, w1)), plan, w2, gates)
    torch.testing.assert_close(fast, slow)
    grads_fast = torch.autograd.grad(fast.square().sum(), [x, w1, w2, gates])
    grads_slow = torch.autograd.grad(slow.square().sum(), [x, w1, w2, gates])
    for a, b in zip(grads_fast, grads_slow):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("gated", [False, True])
def test_bf16_close_to_fp32_reference(matmul_path, gated):
    indices, tensors = _inputs(T=17, k=2, E=4, m=16, n=8, dtype=torch.bfloat16, gated=gated)
    _check(indices, tensors, 4, gated, atol=5e-2, rtol=5e-2)
    assert tensors[0].grad.dtype == torch.bfloat16


def test_autocast_runs_in_bf16():
    indices = torch.randint(0, 3, (5, 2))
    x, weight = torch.randn(5, 4), torch.randn(3, 4, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = cvmm(x, DispatchPlan.build(indices, 3), weight)
    assert out.dtype == torch.bfloat16


def test_plan_sorts_pairs_by_expert_and_counts_them():
    indices = torch.tensor([[2, 0], [1, 2], [2, 1]])
    plan = DispatchPlan.build(indices, 4)
    assert plan.counts.tolist() == [1, 2, 3, 0]
    assert indices.reshape(-1)[plan.order].tolist() == [0, 1, 1, 2, 2, 2]
    assert plan.token_of_row.tolist() == (plan.order // 2).tolist()
    assert plan.offsets.tolist() == [1, 3, 6, 6]


@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_plan_counts_and_block_ends_match_bincount_with_dropped_pairs_and_empty_experts(tokens):
    torch.manual_seed(tokens)
    indices = torch.randint(0, 5, (tokens, 3)) * 2        # odd experts never chosen
    dispatched = torch.rand(tokens, 3) < 0.7
    plan = DispatchPlan.build(indices, 11, dispatched=dispatched)
    expected = torch.bincount(indices[dispatched], minlength=11)
    assert plan.counts.dtype == torch.int64 and plan.offsets.dtype == torch.int32
    assert plan.counts.tolist() == expected.tolist()
    assert plan.offsets.tolist() == expected.cumsum(0).tolist()
    assert sorted(plan.order.tolist()) == list(range(tokens * 3))


@pytest.mark.parametrize("num_experts", [1, 254, 255, 256, 32766, 32767, 40000])
def test_plan_order_is_a_stable_sort_at_every_key_width(num_experts):
    """The keys are sorted as the narrowest integers that hold 0..E (E: the dropped pairs);
    at each width's edge the plan is the stable int64 sort."""
    torch.manual_seed(num_experts)
    indices = torch.randint(0, num_experts, (300, 3))
    indices[:5] = num_experts - 1                          # the largest expert id is used
    dispatched = torch.rand(300, 3) < 0.8
    plan = DispatchPlan.build(indices, num_experts, dispatched=dispatched)
    keys = indices.reshape(-1).masked_fill(~dispatched.reshape(-1), num_experts)
    assert plan.order.tolist() == torch.argsort(keys, stable=True).tolist()
    expected = torch.bincount(indices[dispatched], minlength=num_experts)
    assert plan.counts.tolist() == expected.tolist()


def test_ids_take_the_narrowest_integer_dtype_that_holds_them():
    assert id_dtype(0, 255) == torch.uint8 and id_dtype(0, 256) == torch.int16
    assert id_dtype(-1, 127) == torch.int8 and id_dtype(-1, 128) == torch.int16
    assert id_dtype(0, 2 ** 15 - 1) == torch.int16 and id_dtype(0, 2 ** 15) == torch.int32
    assert id_dtype(-1, 2 ** 31 - 1) == torch.int32 and id_dtype(0, 2 ** 31) == torch.int64


def test_bad_inputs_raise_clear_errors():
    plan = DispatchPlan.build(torch.randint(0, 3, (5, 2)), 3)
    with pytest.raises(ValueError, match=r"cvmm input must have shape \(5, 4\) or \(5, 2, 4\)"):
        cvmm(torch.randn(5, 3), plan, torch.randn(3, 4, 6))
    with pytest.raises(ValueError, match="weight must have shape"):
        cvmm(torch.randn(5, 4), plan, torch.randn(2, 4, 6))
    with pytest.raises(ValueError, match="gates must have the shape"):
        cvmm(torch.randn(5, 4), plan, torch.randn(3, 4, 6), torch.rand(5, 3))
    with pytest.raises(TypeError, match="same dtype"):
        cvmm(torch.randn(5, 4, dtype=torch.float64), plan, torch.randn(3, 4, 6))
    with pytest.raises(ValueError, match=r"expert indices must lie in \[0, 3\), got values in "
                                         r"\[0, 3\]"):
        DispatchPlan.build(torch.tensor([[0, 3]]), 3)
    with pytest.raises(ValueError, match=r"got values in \[-2, 1\]"):
        DispatchPlan.build(torch.tensor([[1, -2]]), 3)
    with pytest.raises(TypeError, match="integer"):
        DispatchPlan.build(torch.tensor([[0.0, 1.0]]), 3)


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("per_slot", [False, True])
def test_dropped_pairs_are_not_computed_and_get_zero_output_and_gradient(matmul_path, gated,
                                                                        per_slot):
    T, k, E, m, n = 11, 3, 4, 5, 6
    indices, tensors = _inputs(T, k, E, m, n, per_slot=per_slot, gated=gated)
    dispatched = torch.rand(T, k) < 0.6
    dispatched[0, 0] = False
    plan = DispatchPlan.build(indices, E, dispatched=dispatched)
    assert int(plan.num_dispatched()) == int(dispatched.sum())
    assert plan.num_rows == T * k          # the dropped pairs sort last, never computed
    flat = indices.reshape(-1)[plan.order]
    kept = dispatched.reshape(-1)[plan.order]
    assert kept[:int(dispatched.sum())].all() and not kept[int(dispatched.sum()):].any()
    assert flat[:int(dispatched.sum())].tolist() == sorted(flat[:int(dispatched.sum())].tolist())
    x, weight = tensors[0], tensors[1]
    gates = tensors[2] if gated else None
    out = cvmm(x, plan, weight, gates)
    # The reference: every pair computed, dropped ones then zeroed (gates zero, or slot masked).
    ref_inputs = [t.detach().clone().requires_grad_(True) for t in tensors]
    if gated:
        ref = cvmm_reference(ref_inputs[0], indices, ref_inputs[1], ref_inputs[2] * dispatched)
    else:
        ref = cvmm_reference(ref_inputs[0], indices, ref_inputs[1]) * dispatched.unsqueeze(-1)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    grad = torch.randn_like(ref)
    out.backward(grad)
    ref.backward(grad)
    for got, want in zip(tensors, ref_inputs):
        torch.testing.assert_close(got.grad, want.grad, atol=1e-3, rtol=1e-3)
    if gated:
        assert torch.all(tensors[2].grad[~dispatched] == 0)


def test_dispatched_mask_must_match_the_indices():
    with pytest.raises(ValueError, match="dispatched must be a bool tensor"):
        DispatchPlan.build(torch.zeros(3, 2, dtype=torch.long), 2,
                           dispatched=torch.ones(3, dtype=torch.bool))


def test_grouped_mm_probe_leaves_the_global_rng_alone(monkeypatch):
    """The probe runs once, at the first MoE forward of a process: if it drew from the global
    RNG, a process's first training run would differ from its later ones under one seed."""
    import importlib
    grouped_mm = importlib.import_module("sparseffn.ops.grouped_mm")
    monkeypatch.setattr(grouped_mm, "_GROUPED_MM_OK", {})
    torch.manual_seed(0)
    before = torch.get_rng_state()
    grouped_mm._grouped_mm_usable(torch.device("cpu"), torch.float32)
    assert torch.equal(torch.get_rng_state(), before)


def test_grouped_mm_probe_inside_cuda_graph_capture_is_a_clear_error(monkeypatch):
    """The probe copies to the device and reads the result on the host, which CUDA graph
    capture forbids (PyTorch's own error names neither sparseffn nor the probe). It runs at
    the first call of the PyTorch path, normally an eager warm-up; a graph that reaches that
    path only when it is captured (seen when the Triton path was switched off after an earlier
    capture) gets this error, and a probed (device, dtype) needs no check at all."""
    import importlib
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("torch._grouped_mm (PyTorch >= 2.8) is not in this PyTorch: no probe")
    grouped_mm = importlib.import_module("sparseffn.ops.grouped_mm")
    monkeypatch.setattr(grouped_mm, "_GROUPED_MM_OK", {("cuda", torch.float32): True})
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(grouped_mm, "_probe_grouped_mm", lambda *a: pytest.fail("probed"))
    cuda = torch.device("cuda")
    assert grouped_mm._grouped_mm_usable(cuda, torch.float32)
    with pytest.raises(RuntimeError, match="grouped_mm has not yet been checked on cuda "
                                           "in torch.bfloat16.*graph capture"):
        grouped_mm._grouped_mm_usable(cuda, torch.bfloat16)
    assert not grouped_mm._GROUPED_MM_OK.get(("cuda", torch.bfloat16))
