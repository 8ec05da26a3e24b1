"""The Triton CVMM kernels (ops/triton_cvmm) against the PyTorch implementation of the operators
and the loop references: on the GPU when there is one, else in Triton's CPU interpreter
(fp32 and fp16; the interpreter has no bf16)."""

import copy
import importlib

import pytest
import torch

from tests.ops.triton_cases import skip_without_usable_triton

skip_without_usable_triton()

from tests.layers.test_conformance import EXAMPLES   # noqa: E402
from tests.ops.reference import expert_mlp_reference   # noqa: E402
import sparseffn   # noqa: E402
from sparseffn.ops import DispatchPlan, expert_mlp, kernels, native, triton_cvmm   # noqa: E402
from tests.ops.triton_cases import DEVICE, DTYPES, close   # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_on_cpu")
# the module (``sparseffn.ops.expert_mlp`` is also the name of its function)
expert_mlp_module = importlib.import_module("sparseffn.ops.expert_mlp")


class _KernelChoice:
    """Which of ``cvmm_rows``' two kernels a test runs, and which ones its calls launched."""

    def __init__(self, name):
        self.name = name
        self.used = set()

    def recording(self, name, kernel):
        choice = self

        class Recorder:
            def __getitem__(self, grid):
                choice.used.add(name)
                return kernel[grid]
        return Recorder()


@pytest.fixture(params=["tile", "row_tile", "row_tile_split"])
def cvmm_kernel(request, monkeypatch):
    """Runs the test through the tile kernel (every inner size), the row-tile kernel, or the
    row-tile kernel with its columns split over several programs (as for small batches), and
    checks that no other kernel ran."""
    choice = _KernelChoice("tile" if request.param == "tile" else "row_tile")
    monkeypatch.setattr(triton_cvmm, "ROW_TILE_MAX_K", 0 if request.param == "tile" else 1 << 20)
    if request.param == "row_tile_split":
        monkeypatch.setattr(triton_cvmm, "_multiprocessors", lambda device: 1 << 20)
    for name, attr in (("tile", "_cvmm_kernel"), ("row_tile", "_cvmm_row_tile_kernel")):
        monkeypatch.setattr(triton_cvmm, attr,
                            choice.recording(name, getattr(triton_cvmm, attr)))
    yield choice
    assert choice.used <= {choice.name}, f"ran {choice.used}, expected only {choice.name}"


def _problem(counts, m, n, dropped=0, sources=40, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts, dtype=torch.int64)
    rows = int(counts.sum()) + dropped
    src = torch.randn(sources, m, generator=gen)
    weight = torch.randn(len(counts), m, n, generator=gen) / m ** 0.5
    in_idx = torch.randint(0, sources, (rows,), generator=gen)
    scale = torch.rand(rows, generator=gen)
    scale[int(counts.sum()):] = float("nan")     # a dropped pair's gate is never read
    to = lambda t: t.to(DEVICE)                  # noqa: E731
    return (to(src.to(dtype)), to(weight.to(dtype)), to(counts), to(in_idx),
            to(scale.to(dtype)), rows)


def _torch_rows(*args):
    """The operator's PyTorch implementation, in fp32."""
    args = [a.float() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args]
    return kernels._cvmm_rows_torch(*args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("epilogue", ["plain", "scale", "relu", "mask_and_dots"])
@pytest.mark.parametrize("transposed", [False, True])
def test_sorted_rows_match_the_torch_implementation(dtype, epilogue, transposed, cvmm_kernel):
    # odd sizes, an expert with no rows, 5 pairs dropped at capacity (rows that must be zero)
    src, weight, counts, in_idx, scale, rows = _problem([7, 0, 19, 1, 33], 37, 29, dropped=5,
                                                       dtype=dtype)
    if transposed:
        weight = weight.transpose(1, 2).contiguous().transpose(1, 2)
    use_scale = scale if epilogue != "plain" else None
    relu = epilogue == "relu"
    mask = dot = None
    if epilogue == "mask_and_dots":
        mask = torch.randn(rows, 29, device=DEVICE).to(dtype)
        dot = torch.randn(rows, 29, device=DEVICE).to(dtype)
    got, dots = kernels.cvmm_rows(src, weight, counts, in_idx, None, use_scale, rows, 1, relu,
                                  mask, dot)
    want, want_dots = _torch_rows(src, weight, counts, in_idx, None, use_scale, rows, 1, relu,
                                  mask, dot)
    assert got.dtype == dtype and cvmm_kernel.used == {cvmm_kernel.name}
    close(got, want, dtype)
    assert bool((got[rows - 5:] == 0).all()), "rows of dropped pairs must be written as zeros"
    if dot is not None:
        close(dots, want_dots, dtype)
        assert bool((dots[rows - 5:] == 0).all())
    else:
        assert dots.numel() == 0


def test_autotuning_zeroes_the_partial_dots_between_candidates():
    """Candidates write different rows of the partial-dot buffer (one per column tile or
    split), and the chosen one does not overwrite the others' rows: the autotuner must zero
    it before the real run, or the first call of a shape sums stale partials."""
    for kernel in (triton_cvmm._cvmm_kernel, triton_cvmm._cvmm_row_tile_kernel):
        assert kernel.reset_to_zero == ["dots_ptr"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 3])
def test_slot_sums_match_the_torch_implementation(dtype, group, cvmm_kernel):
    src, weight, counts, in_idx, scale, rows = _problem([5, 9, 0, 13], 21, 70, dropped=3,
                                                       dtype=dtype)
    slots = torch.randperm(rows).to(DEVICE)
    got, _ = kernels.cvmm_rows(src, weight, counts, in_idx, slots, scale, rows // group, group,
                               False, None, None)
    want, _ = _torch_rows(src, weight, counts, in_idx, slots, scale, rows // group, group,
                          False, None, None)
    close(got, want, dtype)


@pytest.fixture(params=[None, 1, 3, 5])
def weight_grad_splits(request, monkeypatch):
    """The weight gradient with the split count its heuristic picks (one, on the CPU), one
    range per expert, three ranges, or five (ranges are whole steps of 16 rows in the
    interpreter, so most of an expert's five ranges sum nothing)."""
    monkeypatch.setattr(triton_cvmm, "WEIGHT_GRAD_SPLITS", request.param)
    return request.param


def _weight_grad_loop(a: torch.Tensor, b: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Each expert's ``aᵀ b`` over its block of sorted rows, one matmul an expert."""
    ends = counts.cumsum(0)
    return torch.stack([a[s:e].t() @ b[s:e]
                        for s, e in zip((ends - counts).tolist(), ends.tolist())])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gathered", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_weight_gradient_matches_the_loop(dtype, gathered, scaled, weight_grad_splits):
    src, _, counts, in_idx, scale, rows = _problem([6, 0, 17, 2], 19, 1, dropped=4, dtype=dtype)
    b = torch.randn(30, 45, device=DEVICE).to(dtype)
    b_idx = torch.randint(0, 30, (rows,), device=DEVICE)
    a_rows = src[in_idx] if not gathered else src
    got = kernels.expert_weight_grad(a_rows, b[b_idx] if not gathered else b, counts,
                                     in_idx if gathered else None,
                                     b_idx if gathered else None, scale if scaled else None)
    a, bb = src[in_idx].float(), b[b_idx].float()
    if scaled:
        a = a * scale.float()[:, None]
    close(got, _weight_grad_loop(a, bb, counts), dtype)
    assert bool((got[1] == 0).all()), "an expert without rows gets an exact zero gradient"


@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_gradient_writes_the_first_rows_in_the_dtype_asked(dtype, weight_grad_splits):
    """``rows`` and ``out_dtype``: the gradient of a weight whose padded copy in a reduced
    dtype ran the products, [E, rows, nb] in float32 straight from the float32 sums (split or
    not): the first rows of the full gradient, bit for bit where the sums are rounded to
    float32 in both; an empty batch gives zeros of that shape and dtype."""
    src, _, counts, in_idx, scale, rows = _problem([6, 0, 17, 2], 19, 1, dropped=4, dtype=dtype)
    b = torch.randn(rows, 45, device=DEVICE).to(dtype)
    full = kernels.expert_weight_grad(src, b, counts, in_idx, None, scale, None, torch.float32)
    got = kernels.expert_weight_grad(src, b, counts, in_idx, None, scale, 13, torch.float32)
    assert got.shape == (4, 13, 45) and got.dtype == torch.float32 and got.is_contiguous()
    assert torch.equal(got, full[:, :13])
    a = src[in_idx].float() * scale.float()[:, None]
    close(got, _weight_grad_loop(a, b.float(), counts)[:, :13], dtype)
    assert bool((got[1] == 0).all())
    empty = kernels.expert_weight_grad(src[:0], b[:0], torch.zeros_like(counts), None, None,
                                       None, 13, torch.float32)
    assert empty.shape == (4, 13, 45) and empty.dtype == torch.float32
    assert bool((empty == 0).all())
    with pytest.raises(ValueError, match="rows must lie in"):
        kernels.expert_weight_grad(src, b, counts, in_idx, None, scale, 20, None)


def test_fused_experts_get_their_weight_gradients_unpadded_in_float32_under_autocast(
        monkeypatch):
    """Under autocast the fused ReLU experts cast and pad their own weight copies (G 13 runs
    as 16 units) and the weight-gradient kernel writes the float32 weights' gradients
    themselves, [E, 13, d] in float32: no gradient of the padded reduced-precision copy for
    autograd to slice and cast back. The gradients are the float32 reference's within the
    reduced dtype's rounding."""
    low = DTYPES[-1]                       # bf16 on a GPU, fp16 in the interpreter
    returned = []
    original = kernels.expert_weight_grad

    def spy(*args):
        out = original(*args)
        returned.append((tuple(out.shape), out.dtype))
        return out
    monkeypatch.setattr(kernels, "expert_weight_grad", spy)
    torch.manual_seed(5)
    T, k, E, G, d = 21, 2, 4, 13, 24
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    leaves = [torch.randn(T, d, device=DEVICE), torch.randn(E, G, d, device=DEVICE) / d ** 0.5,
              torch.randn(E, G, d, device=DEVICE) / G ** 0.5, torch.rand(T, k, device=DEVICE)]
    leaves = [t.requires_grad_() for t in leaves]
    refs = [t.detach().clone().requires_grad_() for t in leaves]
    with torch.autocast(DEVICE, dtype=low):
        y = expert_mlp(leaves[0], DispatchPlan.build(indices, E), *leaves[1:3], leaves[3])
    assert y.dtype == low
    grad = torch.randn(T, d, device=DEVICE)
    y.float().backward(grad)
    assert returned == [((E, G, d), torch.float32)] * 2
    want = expert_mlp_reference(refs[0], indices, refs[3], refs[1].transpose(1, 2), refs[2],
                                torch.relu)
    want.backward(grad)
    for got, ref in zip(leaves, refs):
        assert got.grad.dtype == torch.float32
        close(got.grad, ref.grad, low)


def test_weight_gradient_split_keeps_nan_in_its_expert_and_empty_experts_zero(
        weight_grad_splits):
    """Split or not, a NaN row reaches only its own expert's gradient, an expert with no
    rows gets exact zeros, and an empty batch gives a zero gradient of the right shape."""
    src, _, counts, in_idx, scale, rows = _problem([40, 0, 37, 3], 24, 1, dropped=2)
    b = torch.randn(rows, 33, device=DEVICE)
    src[in_idx[45]] = float("nan")     # read by row 45 (expert 2), perhaps by others
    got = kernels.expert_weight_grad(src, b, counts, in_idx, None, scale)
    for e, (first, last) in enumerate([(0, 40), (40, 40), (40, 77), (77, 80)]):
        reads_nan = bool((in_idx[first:last] == in_idx[45]).any())
        assert bool(got[e].isnan().any()) == reads_nan, f"expert {e}"
        assert reads_nan or bool(got[e].isfinite().all())
    assert bool((got[1] == 0).all())
    empty = kernels.expert_weight_grad(src[:0], b[:0], torch.zeros_like(counts), None, None,
                                       None)
    assert empty.shape == (4, 24, 33) and bool((empty == 0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 300), (1, 2049), (5, 0), (0, 4, 3)])
def test_partial_sums_add_in_order_and_round_once(dtype, shape):
    """``sum_partials`` (the split weight gradient's, the dots', the table gradient's): the
    float32 sum over the first index in that order, rounded to the dtype once, NaN kept where
    it is; zeros when there are no parts, nothing when there are no elements."""
    gen = torch.Generator().manual_seed(0)
    parts = (torch.randn(*shape, generator=gen) * 100).to(DEVICE)
    if parts.numel():
        parts.view(-1)[5] = float("nan")
    got = triton_cvmm.sum_partials(parts, dtype)
    want = torch.zeros(shape[1:], dtype=torch.float32, device=DEVICE)
    for part in parts:         # in order, in float32
        want = want + part
    assert got.dtype == dtype and got.shape == shape[1:]
    assert torch.equal(got.isnan(), want.to(dtype).isnan())
    torch.testing.assert_close(got, want.to(dtype), rtol=0, atol=0, equal_nan=True)


if triton_cvmm.available():
    import triton
    import triton.language as tl

    @triton.jit
    def _parts_in_a_shuffled_order(base_ptr, parts_ptr, part_of_program_ptr, numel,
                                   num_parts, arrivals_ptr, out_ptr, BLOCK: tl.constexpr):
        """Program (block, i) stores part ``p = part_of_program[i]`` of its block, ``(p + 1) ·
        base``, so the program that arrives last in the interpreter (the last one run) does
        not hold the last part."""
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offsets < numel
        part = tl.load(part_of_program_ptr + tl.program_id(1))
        value = (part + 1).to(tl.float32) * tl.load(base_ptr + offsets, mask=ok, other=0.0)
        tl.store(parts_ptr + part * numel + offsets, value, mask=ok)
        triton_cvmm.add_parts_if_last(parts_ptr, numel, offsets, ok, ok, num_parts,
                                      arrivals_ptr + tl.program_id(0), out_ptr)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_last_program_to_finish_adds_the_parts_in_their_order(dtype):
    """``add_parts_if_last``, the in-kernel sum of split parts: whichever program is last, the
    parts are added in the order of their index in float32 and rounded once (bit for bit
    ``sum_partials``, so the result does not depend on the order the programs finish in),
    NaN is kept, and the arrival counts are back at zero for the next launch, which gives the
    same result."""
    numel, block, num_parts = 37, 16, 5
    gen = torch.Generator().manual_seed(0)
    base = (torch.randn(numel, generator=gen) * 1e4).to(dtype).to(DEVICE)
    base[3] = float("nan")
    order = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32, device=DEVICE)
    blocks = triton_cvmm.cdiv(numel, block)
    parts = torch.empty(num_parts, numel, device=DEVICE)
    arrivals = torch.zeros(blocks, dtype=torch.int32, device=DEVICE)
    results = []
    for _ in range(2):
        out = torch.empty_like(base)
        _parts_in_a_shuffled_order[(blocks, num_parts)](base, parts, order, numel, num_parts,
                                                        arrivals, out, BLOCK=block)
        assert bool((arrivals == 0).all()), "every block's count back at zero"
        results.append(out)
    want_parts = torch.stack([(p + 1) * base.float() for p in range(num_parts)])
    assert torch.equal(parts.isnan(), want_parts.isnan())
    want = triton_cvmm.sum_partials(want_parts, dtype)
    for got in results:
        assert got.dtype == dtype
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


def _with_parts_added(where, monkeypatch, call):
    monkeypatch.setattr(triton_cvmm, "ADD_PARTS_IN_KERNEL", where == "kernel")
    return call()


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_weight_gradient_added_in_the_kernel_is_the_second_launchs_sum(
        dtype, monkeypatch, kept_arrival_counts):
    """Three ranges an expert (of 32, 32 and 16 rows in the first, where the order of the
    sum shows): the gradient the kernel adds itself is bit for bit the one ``sum_partials``
    adds in a second launch (NaN and an expert without rows included), and its tiles'
    arrival counts are back at zero."""
    monkeypatch.setattr(triton_cvmm, "WEIGHT_GRAD_SPLITS", 3)
    src, _, counts, in_idx, scale, rows = _problem([80, 0, 37, 3], 24, 1, dropped=2,
                                                   dtype=dtype)
    b = torch.randn(rows, 33, device=DEVICE).to(dtype)
    src[in_idx[45]] = float("nan")
    results = {where: _with_parts_added(where, monkeypatch, lambda: kernels.expert_weight_grad(
        src, b, counts, in_idx, None, scale)) for where in ("kernel", "second launch")}
    assert len(kept_arrival_counts) == 1 and bool((kept_arrival_counts[0] == 0).all())
    assert bool(results["kernel"].isnan().any()) and bool((results["kernel"][1] == 0).all())
    torch.testing.assert_close(results["kernel"], results["second launch"], rtol=0, atol=0,
                               equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gate_dots_added_in_the_kernel_are_the_second_launchs_sum(
        dtype, cvmm_kernel, monkeypatch, kept_arrival_counts):
    """The gate gradient's dots over several column tiles (or splits): added by each row
    tile's last program, bit for bit ``sum_partials``' sum; zeros for dropped pairs; NaN
    only in the rows that read it; the arrival counts back at zero."""
    src, weight, counts, in_idx, scale, rows = _problem([7, 0, 19, 1, 33], 37, 53, dropped=5,
                                                       dtype=dtype)
    dot = torch.randn(rows, 53, device=DEVICE).to(dtype)
    dot[11, 4] = float("nan")
    results = {where: _with_parts_added(where, monkeypatch, lambda: kernels.cvmm_rows(
        src, weight, counts, in_idx, None, scale, rows, 1, False, None, dot)[1])
        for where in ("kernel", "second launch")}
    assert len(kept_arrival_counts) == 1 and bool((kept_arrival_counts[0] == 0).all())
    dots = results["kernel"]
    assert dots.isnan().nonzero().flatten().tolist() == [11]
    assert bool((dots[rows - 5:] == 0).all()), "dropped pairs' dots are exact zeros"
    torch.testing.assert_close(dots, results["second launch"], rtol=0, atol=0, equal_nan=True)


@pytest.mark.skipif(DEVICE != "cuda", reason="a race between programs needs a GPU: the "
                    "interpreter runs them one after another")
def test_parts_added_in_the_kernel_race_nothing_on_a_gpu(monkeypatch):
    """At the LM's shapes (8 experts of [256, 256], 32,768 rows) with five ranges an expert,
    the dots over 8 to 16 column tiles, and a product-key table gradient of 62 rows cut in
    16 pieces each, 30 calls in a row: each the same bits as the sum in a second launch. A
    part read before the program that wrote it made it visible (a missing barrier or fence)
    or two programs both taking the last arrival would show here."""
    monkeypatch.setattr(triton_cvmm, "WEIGHT_GRAD_SPLITS", 5)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    counts = torch.full((8,), 4096, device=DEVICE)
    a = torch.randn(32768, 256, device=DEVICE, generator=gen).to(torch.bfloat16)
    b = torch.randn(32768, 256, device=DEVICE, generator=gen).to(torch.bfloat16)
    w = torch.randn(8, 256, 1024, device=DEVICE, generator=gen).to(torch.bfloat16)
    dot = torch.randn(32768, 1024, device=DEVICE, generator=gen).to(torch.bfloat16)
    sub_keys = torch.randint(0, 62, (16384, 32), device=DEVICE, generator=gen)
    scores = torch.rand(16384, 32, device=DEVICE, generator=gen).to(torch.bfloat16)
    calls = {
        "weight gradient": lambda: kernels.expert_weight_grad(a, b, counts, None, None, None),
        "dots": lambda: kernels.cvmm_rows(a, w, counts, None, None, None, 32768, 1, False, None,
                                          dot)[1],
        "table gradient": lambda: kernels.scatter_rows(sub_keys, scores, a[:16384, :128], 62),
    }
    for name, call in calls.items():
        want = _with_parts_added("second launch", monkeypatch, call)
        monkeypatch.setattr(triton_cvmm, "ADD_PARTS_IN_KERNEL", True)
        for attempt in range(30):
            assert torch.equal(call(), want), f"{name}, call {attempt}"


def test_weight_gradient_splits_only_where_the_tiles_are_too_few(monkeypatch):
    """The split-K heuristic: on 132 multiprocessors, the LM's 8 experts of [256, 256] over
    32,768 rows get several ranges; Fig. 2's 64 experts of [2048, 128] (4,096 tiles) none;
    and no range is cut below the minimum rows of a mean expert."""
    monkeypatch.setattr(triton_cvmm, "_multiprocessors", lambda device: 132)
    splits = lambda *shape: triton_cvmm.weight_grad_splits(*shape, torch.device(DEVICE))  # noqa
    assert splits(32768, 8, 256, 256) == 5          # 128 tiles: cdiv(4·132, 128)
    assert splits(131072, 16, 512, 128) == 3        # Fig. 2, d_model 512: 256 tiles
    assert splits(131072, 64, 2048, 128) == 1
    assert splits(8 * 1024, 8, 256, 256) == 2       # 1,024 rows an expert: two of 512
    assert splits(8 * 100, 8, 256, 256) == 1
    assert splits(10 ** 8, 1, 64, 64) == triton_cvmm._WEIGHT_GRAD_MAX_SPLITS
    monkeypatch.setattr(triton_cvmm, "WEIGHT_GRAD_SPLITS", 7)
    assert splits(0, 64, 2048, 128) == 7


def test_empty_batch_and_nan_rows(cvmm_kernel):
    src, weight, counts, in_idx, scale, rows = _problem([0, 0, 0], 8, 16, dropped=0)
    out, dots = kernels.cvmm_rows(src, weight, counts, in_idx, None, None, 0, 1, False, None,
                                  torch.empty(0, 16, device=DEVICE))
    assert out.shape == (0, 16) and dots.shape == (0,)
    slots_out, _ = kernels.cvmm_rows(src, weight, counts, in_idx, torch.empty(0, dtype=torch.long,
                                     device=DEVICE), None, 0, 2, False, None, None)
    assert slots_out.shape == (0, 16)
    grad = kernels.expert_weight_grad(src[:0], src[:0], counts, None, None, None)
    assert grad.shape == (3, 8, 8) and bool((grad == 0).all())
    # a NaN in one source row reaches only the rows that read it
    src, weight, counts, in_idx, scale, rows = _problem([4, 6], 8, 16)
    src[in_idx[3]] = float("nan")
    out, _ = kernels.cvmm_rows(src, weight, counts, in_idx, None, scale, rows, 1, True, None,
                               None)
    reads_nan = in_idx == in_idx[3]
    assert bool(out[reads_nan].isnan().all()), "ReLU keeps NaN"
    assert bool(out[~reads_nan].isfinite().all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_relu_expert_mlp_matches_the_loop_reference(dtype, cvmm_kernel):
    torch.manual_seed(0)
    T, k, E, d, G = 23, 3, 6, 20, 16
    indices = torch.randint(0, E - 1, (T, k), device=DEVICE)          # expert E-1 gets nothing
    x = torch.randn(T, d, device=DEVICE).to(dtype).requires_grad_()
    w1 = (torch.randn(E, G, d, device=DEVICE) / d ** 0.5).to(dtype).requires_grad_()
    w2 = (torch.randn(E, G, d, device=DEVICE) / G ** 0.5).to(dtype).requires_grad_()
    gates = torch.rand(T, k, device=DEVICE).to(dtype).requires_grad_()
    y = expert_mlp(x, DispatchPlan.build(indices, E), w1, w2, gates)
    ref_in = [t.detach().float().requires_grad_() for t in (x, w1, w2, gates)]
    want = expert_mlp_reference(ref_in[0], indices, ref_in[3], ref_in[1].transpose(1, 2),
                                ref_in[2], torch.relu)
    close(y, want, dtype)
    grad = torch.randn_like(want)
    y.backward(grad.to(dtype))
    want.backward(grad)
    for got, ref in zip((x, w1, w2, gates), ref_in):
        close(got.grad, ref.grad, dtype)


def _record_products(monkeypatch):
    """The (m, n) of every product the Triton CVMM kernels are launched on."""
    shapes = []
    original = triton_cvmm.cvmm_rows

    def spy(src, weight, *rest):
        shapes.append(tuple(weight.shape[1:]))
        return original(src, weight, *rest)
    monkeypatch.setattr(triton_cvmm, "cvmm_rows", spy)
    return shapes


@pytest.mark.parametrize("G", [13, 21])
@pytest.mark.parametrize("variant", ["relu", "gelu_biased", "swiglu"])
def test_odd_expert_sizes_are_padded_to_whole_vectors_and_match_the_reference(
        G, variant, monkeypatch):
    """Experts of a size not a multiple of 16 run as 16-multiples with zero units (the
    kernels then move the hidden rows in vectors): the output and every gradient, the
    unpadded weights' included, are the reference's; a token with NaN input stays alone."""
    products = _record_products(monkeypatch)
    torch.manual_seed(G)
    T, k, E, d = 19, 2, 5, 24
    indices = torch.randint(0, E - 1, (T, k), device=DEVICE)          # expert E-1 gets nothing
    x = torch.randn(T, d, device=DEVICE)
    w1 = torch.randn(E, G, d, device=DEVICE) / d ** 0.5
    w2 = torch.randn(E, G, d, device=DEVICE) / G ** 0.5
    w_gate = torch.randn(E, G, d, device=DEVICE) / d ** 0.5 if variant == "swiglu" else None
    b1 = torch.randn(E, G, device=DEVICE) if variant == "gelu_biased" else None
    b2 = torch.randn(E, d, device=DEVICE) if variant == "gelu_biased" else None
    gates = torch.rand(T, k, device=DEVICE)
    activation = {"relu": "relu", "gelu_biased": "gelu", "swiglu": "silu"}[variant]
    plan = DispatchPlan.build(indices, E)

    def run(inputs):
        return expert_mlp(inputs, plan, w1, w2, gates, activation=activation, b1=b1, b2=b2,
                          indices=indices, w_gate=w_gate)
    with torch.no_grad():                      # NaN in one token's input: only its output
        poisoned = x.clone()
        poisoned[4, 3] = float("nan")
        y = run(poisoned)
        assert bool(y[4].isnan().all())
        assert bool(y[torch.arange(T, device=DEVICE) != 4].isfinite().all())
    leaves = [t.requires_grad_() for t in (x, w1, w2, gates, w_gate, b1, b2) if t is not None]
    ref_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    assert expert_mlp_module.hidden_padding(x, w1, w2) == -G % 16
    products.clear()
    y = run(x)
    padded = G + (-G % 16)
    assert products and all(padded in shape and G not in shape for shape in products), \
        "every product ran on the padded width"
    named = dict(zip(["x", "w1", "w2", "gates", *(["w_gate"] if w_gate is not None else []),
                      *(["b1", "b2"] if b1 is not None else [])], ref_leaves))
    act = {"relu": torch.relu, "gelu": torch.nn.functional.gelu,
           "silu": torch.nn.functional.silu}[activation]
    want = expert_mlp_reference(
        named["x"], indices, named["gates"], named["w1"].transpose(1, 2), named["w2"], act,
        w_gate=None if w_gate is None else named["w_gate"].transpose(1, 2),
        b1=named.get("b1"), b2=named.get("b2"))
    close(y, want, torch.float32)
    grad = torch.randn_like(want)
    y.backward(grad)
    want.backward(grad)
    for got, ref in zip(leaves, ref_leaves):
        assert got.grad.shape == ref.grad.shape and bool(ref.grad.isfinite().all())
        close(got.grad, ref.grad, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G, unit", [(13, True), (16, False)])
@pytest.mark.parametrize("biases", ["b1 and b2", "b1", "b2"])
def test_biased_relu_experts_run_fused_on_whole_vectors_and_match_the_reference(
        G, unit, biases, dtype, monkeypatch):
    """Biased ReLU experts on the kernels: x gets 16 columns (ones into the bias column, so
    its rows stay whole vectors), and b2 rides the first padding unit where the width leaves
    one (13 -> 16) and ``gather_sum`` where it does not (16); the output and every gradient
    are the reference's, also with dropped pairs and an expert that gets no token."""
    products = _record_products(monkeypatch)
    gathered = []
    original_gather = expert_mlp_module.gather_sum
    monkeypatch.setattr(expert_mlp_module, "gather_sum",
                        lambda *a: gathered.append(1) or original_gather(*a))
    torch.manual_seed(G)
    T, k, E, d = 19, 2, 5, 24
    indices = torch.randint(0, E - 1, (T, k), device=DEVICE)          # expert E-1 gets nothing
    dispatched = torch.rand(T, k, device=DEVICE) < 0.8
    leaves = {"x": torch.randn(T, d, device=DEVICE),
              "w1": torch.randn(E, G, d, device=DEVICE) / d ** 0.5,
              "w2": torch.randn(E, G, d, device=DEVICE) / G ** 0.5,
              "gates": torch.rand(T, k, device=DEVICE)}
    if "b1" in biases:
        leaves["b1"] = torch.randn(E, G, device=DEVICE)
    if "b2" in biases:
        leaves["b2"] = torch.randn(E, d, device=DEVICE)
    ref = {name: t.clone().requires_grad_() for name, t in leaves.items()}
    got = {name: t.to(dtype).requires_grad_() for name, t in leaves.items()}
    plan = DispatchPlan.build(indices, E, dispatched=dispatched)
    y = expert_mlp(got["x"], plan, got["w1"], got["w2"], got["gates"] * dispatched,
                   b1=got.get("b1"), b2=got.get("b2"), indices=indices)   # as Routing gives them
    width = G + (-G % 16)
    assert products == [(d + 16, width), (width, d)]
    assert gathered == ([1] if "b2" in biases and not unit else [])
    want = expert_mlp_reference(ref["x"], indices, ref["gates"] * dispatched,
                                ref["w1"].transpose(1, 2), ref["w2"], torch.relu,
                                b1=ref.get("b1"), b2=ref.get("b2"))
    close(y, want, dtype)
    grad = torch.randn_like(want)
    y.backward(grad.to(dtype))
    want.backward(grad)
    for name in leaves:
        assert got[name].grad.shape == ref[name].grad.shape, name
        close(got[name].grad, ref[name].grad, dtype)
    for name in ("b1", "b2"):
        if name in leaves:
            assert torch.all(got[name].grad[E - 1] == 0)


@pytest.mark.parametrize("G", [13, 16])
def test_biased_relu_experts_on_the_kernels_keep_a_nan_token_alone_and_take_empty_batches(G):
    """On the kernels too, the constant input and the b2 unit spread no token's NaN to
    another's output, and an empty batch gives an empty output and zero gradients."""
    T, k, E, d = 9, 2, 4, 24
    indices = torch.randint(0, E, (T, k), device=DEVICE)
    w1 = torch.randn(E, G, d, device=DEVICE, requires_grad=True)
    w2 = torch.randn(E, G, d, device=DEVICE, requires_grad=True)
    b1 = torch.randn(E, G, device=DEVICE, requires_grad=True)
    b2 = torch.randn(E, d, device=DEVICE, requires_grad=True)
    x = torch.randn(T, d, device=DEVICE)
    x[5, 7] = float("nan")
    gates = torch.rand(T, k, device=DEVICE)
    y = expert_mlp(x, DispatchPlan.build(indices, E), w1, w2, gates, b1=b1, b2=b2,
                   indices=indices)
    others = torch.arange(T, device=DEVICE) != 5
    assert bool(y[5].isnan().all()) and bool(y[others].isfinite().all())
    want = expert_mlp_reference(x[others], indices[others], gates[others], w1.transpose(1, 2),
                                w2, torch.relu, b1=b1, b2=b2)
    close(y[others], want, torch.float32)
    empty = expert_mlp(x[:0], DispatchPlan.build(indices[:0], E), w1, w2, gates[:0], b1=b1,
                       b2=b2, indices=indices[:0])
    assert empty.shape == (0, d)
    grads = torch.autograd.grad(empty.sum(), [w1, w2, b1, b2], allow_unused=True)
    assert all(g is None or torch.equal(g, torch.zeros_like(p))
               for g, p in zip(grads, [w1, w2, b1, b2]))


def test_the_cpu_paths_keep_odd_expert_sizes_as_they_are():
    triton_cvmm.set_interpreter_for_cpu(False)
    try:
        x, w = torch.randn(3, 8), torch.randn(2, 13, 8)
        assert expert_mlp_module.hidden_padding(x, w, w) == 0
    finally:
        triton_cvmm.set_interpreter_for_cpu(not torch.cuda.is_available())
    assert expert_mlp_module.hidden_padding(x.to(DEVICE), w.to(DEVICE), w.to(DEVICE)) == 3


CVMM_LAYERS = ["layer:sigma_moe", "layer:moe", "router:switch", "router:sbase",
               "router:product_keys", "variant:fff_sparse"]


@pytest.mark.parametrize("name", CVMM_LAYERS)
def test_layers_train_the_same_through_the_kernels(name, monkeypatch):
    """A training forward+backward of each layer that runs on the CVMM operators gives the
    output and every gradient of the PyTorch/C path."""
    calls = []
    for fn in ("cvmm_rows", "expert_weight_grad"):
        original = getattr(triton_cvmm, fn)
        monkeypatch.setattr(triton_cvmm, fn,
                            lambda *a, _f=original, _n=fn: calls.append(_n) or _f(*a))
    torch.manual_seed(0)
    layer = sparseffn.build_layer(EXAMPLES[name]).to(DEVICE).train()
    x = torch.randn(2, 9, layer.config.d_model, device=DEVICE)

    def step(module, through_triton):
        triton_cvmm.set_triton_enabled(through_triton)
        try:
            torch.manual_seed(1)
            module.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            y = module(xx)
            (y * torch.linspace(-1, 1, y.numel(), device=DEVICE).view_as(y)).sum().backward()
            return [y, xx.grad] + [p.grad for _, p in sorted(module.named_parameters())
                                   if p.grad is not None]
        finally:
            triton_cvmm.set_triton_enabled(True)

    native.set_native_enabled(False)
    try:
        want = step(copy.deepcopy(layer), False)
    finally:
        native.set_native_enabled(True)
    assert not calls
    got = step(layer, True)
    assert {"cvmm_rows", "expert_weight_grad"} <= set(calls), "the kernels were not used"
    assert len(got) == len(want)
    for a, b in zip(got, want):
        close(a, b, torch.float32)
