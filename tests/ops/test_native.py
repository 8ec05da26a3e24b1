"""The fused CPU kernels (ops/native) against plain gather / matmul / scatter references."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import require_native, torch_threads
from tests.ops.reference import cvmm_reference
from sparseffn.ops import DispatchPlan, cvmm, expert_mlp, native


@pytest.fixture(autouse=True)
def _native():
    require_native()


def _sorted_problem(E, counts, m, n):
    counts = torch.tensor(counts, dtype=torch.int64)
    P = int(counts.sum())
    expert_of_row = torch.repeat_interleave(torch.arange(E), counts)
    return counts, P, expert_of_row, torch.randn(E, m, n)


def _rows_reference(src, weight, expert_of_row, in_idx, out_idx, scale, out_rows, group=1):
    """The rows y_r in float64; with out_idx (slots), out[i] = Σ of the rows whose slot // group
    is i, added in slot order."""
    rows = (src if in_idx is None else src[in_idx]).double()
    y = torch.einsum("pm,pmn->pn", rows, weight[expert_of_row].double())
    if scale is not None:
        y = y * scale[:, None].double()
    if out_idx is None:
        return y.to(src.dtype)
    out = y.new_zeros(out_rows, y.shape[1])
    for r in out_idx.argsort().tolist():
        out[out_idx[r] // group] += y[r]
    return out.to(src.dtype)


def _slots(P, out_rows, group, generator=None):
    """P distinct slots below out_rows · group: the token and slot of each sorted row."""
    return torch.randperm(out_rows * group, generator=generator)[:P]


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("transposed_weight", [False, True])
def test_cvmm_rows_matches_reference(gather, scatter, scaled, transposed_weight):
    # 700-wide rows make chunks of 93 rows, so experts with 150 and 301 rows span several.
    E, m, n, R = 5, 700, 37, 40
    counts, P, expert_of_row, weight = _sorted_problem(E, [150, 0, 301, 7, 1], m, n)
    if transposed_weight:
        weight = weight.transpose(1, 2).contiguous().transpose(1, 2)
        assert weight.stride(2) != 1
    src = torch.randn(R if gather else P, m)
    in_idx = torch.randint(0, R, (P,)) if gather else None
    # 12 slots per output row and 459 rows: most of the R outputs get several rows, and the
    # last 3 output rows get none (they must come back zero, not garbage)
    out_idx = _slots(P, R, 12) if scatter else None
    scale = torch.rand(P) if scaled else None
    got = native.cvmm_rows(src, weight, counts, in_idx=in_idx, out_idx=out_idx, scale=scale,
                           out_rows=R + 3, group=12)
    want = _rows_reference(src, weight, expert_of_row, in_idx, out_idx, scale, R + 3, 12)
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    if scatter:
        assert torch.all(got[R:] == 0)


@pytest.mark.parametrize("scatter", [False, True])
def test_cvmm_rows_dots_with_unscaled_rows(scatter):
    E, m, n, R = 3, 24, 10, 12
    counts, P, expert_of_row, weight = _sorted_problem(E, [20, 0, 9], m, n)
    src, in_idx = torch.randn(R, m), torch.randint(0, R, (P,))
    out_idx = _slots(P, R, 3) if scatter else None
    scale, other = torch.rand(P), torch.randn(P, n)
    got, dots = native.cvmm_rows(src, weight, counts, in_idx=in_idx, out_idx=out_idx,
                                 scale=scale, out_rows=R, group=3, dot_with=other)
    unscaled = _rows_reference(src, weight, expert_of_row, in_idx, None, None, R)
    torch.testing.assert_close(dots, (unscaled * other).sum(1))
    torch.testing.assert_close(
        got, _rows_reference(src, weight, expert_of_row, in_idx, out_idx, scale, R, 3))


def _with_threads(n, fn):
    with torch_threads(n):
        return fn()


def test_cvmm_rows_reads_strided_rows_and_any_thread_count():
    E, m, n = 3, 20, 24
    counts, P, expert_of_row, weight = _sorted_problem(E, [9, 30, 2], m, n)
    src = torch.randn(P, 2 * m)[:, ::2]              # row stride 2m, column stride 2
    padded = torch.randn(P, m + 3)[:, :m]            # row stride m + 3, unit column stride
    want = _rows_reference(src.contiguous(), weight, expert_of_row, None, None, None, P)
    for t in (1, 3, 8):
        torch.testing.assert_close(
            _with_threads(t, lambda: native.cvmm_rows(src, weight, counts)), want)
    torch.testing.assert_close(
        _with_threads(8, lambda: native.cvmm_rows(padded, weight, counts)),
        _rows_reference(padded.contiguous(), weight, expert_of_row, None, None, None, P))


@pytest.mark.parametrize("a_gather", [False, True])
@pytest.mark.parametrize("b_gather", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_weight_grad_matches_reference(a_gather, b_gather, scaled, threads):
    # 2000-wide B rows make 64-row chunks; with 1 thread a slab is 4 chunks, so the 700-row
    # expert is summed over several multi-chunk slabs and the 200-row one in a single slab.
    E, ma, nb, R = 5, 33, 2000, 50
    counts, P, expert_of_row, _ = _sorted_problem(E, [0, 700, 3, 200, 90], 1, 1)
    a_src, b_src = torch.randn(R if a_gather else P, ma), torch.randn(R if b_gather else P, nb)
    a_idx = torch.randint(0, R, (P,)) if a_gather else None
    b_idx = torch.randint(0, R, (P,)) if b_gather else None
    scale = torch.rand(P) if scaled else None
    got = _with_threads(threads, lambda: native.weight_grad(a_src, b_src, counts, a_idx=a_idx,
                                                            b_idx=b_idx, scale=scale))
    a = a_src if a_idx is None else a_src[a_idx]
    b = b_src if b_idx is None else b_src[b_idx]
    if scale is not None:
        a = a * scale[:, None]
    want = torch.stack([a[expert_of_row == e].T @ b[expert_of_row == e] for e in range(E)])
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-4)
    assert torch.all(got[0] == 0)   # an expert without rows: exactly zero


def test_cvmm_takes_the_fused_path_for_float32_cpu(monkeypatch):
    calls = []
    original = native.cvmm_rows

    def counting(*args, **kwargs):
        calls.append(kwargs.get("out_idx") is not None)
        return original(*args, **kwargs)

    monkeypatch.setattr(native, "cvmm_rows", counting)
    indices = torch.randint(0, 4, (9, 2))
    x = torch.randn(9, 6, requires_grad=True)
    weight = torch.randn(4, 6, 5, requires_grad=True)
    out = cvmm(x, DispatchPlan.build(indices, 4), weight)
    out.sum().backward()
    assert calls == [True, True]   # forward scatters per slot; backward scatters to tokens
    torch.testing.assert_close(out, cvmm_reference(x.detach(), indices, weight.detach()))


def _mixture_step(threads: int, deterministic: bool):
    """Outputs and every gradient of a ReLU expert mixture step on the fused kernels."""
    torch.use_deterministic_algorithms(deterministic)
    try:
        with torch_threads(threads):
            gen = torch.Generator().manual_seed(0)
            T, k, E, d, G = 300, 4, 5, 24, 16
            indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
            x = torch.randn(T, d, generator=gen, requires_grad=True)
            w1 = torch.randn(E, G, d, generator=gen, requires_grad=True)
            w2 = torch.randn(E, G, d, generator=gen, requires_grad=True)
            gates = torch.rand(T, k, generator=gen, requires_grad=True)
            y = expert_mlp(x, DispatchPlan.build(indices, E), w1, w2, gates)
            y.backward(torch.randn(y.shape, generator=gen))
            return [y.detach()] + [t.grad for t in (x, w1, w2, gates)]
    finally:
        torch.use_deterministic_algorithms(False)


def test_fused_kernels_give_the_same_bits_in_every_mode_and_thread_count(monkeypatch):
    """The k rows of a token are added in slot order, one slot per pass: the same bits with
    or without deterministic algorithms, at any thread count."""
    require_native()
    calls = []
    original = native.cvmm_rows

    def counting(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)
    monkeypatch.setattr(native, "cvmm_rows", counting)
    runs = [_mixture_step(threads, deterministic)
            for threads, deterministic in [(1, True), (2, True), (2, True), (1, False),
                                           (2, False), (3, False), (8, False)]]
    assert len(calls) == 4 * len(runs), "a mode left the fused kernels"
    for results in runs[1:]:
        for a, b in zip(runs[0], results):
            assert torch.equal(a, b)


def test_weight_gradient_is_the_same_for_any_thread_count():
    require_native()
    gen = torch.Generator().manual_seed(1)
    counts = torch.tensor([700, 0, 50, 1300, 3])
    a = torch.randn(int(counts.sum()), 33, generator=gen)
    b = torch.randn(int(counts.sum()), 17, generator=gen)
    scale = torch.rand(int(counts.sum()), generator=gen)
    results = []
    for threads in (1, 2, 3):
        with torch_threads(threads):
            results.append(native.weight_grad(a, b, counts, scale=scale))
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])


def test_bad_arguments_raise_clear_errors():
    counts = torch.tensor([2, 1])
    weight = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match="float32"):
        native.cvmm_rows(torch.randn(3, 4, dtype=torch.float64), weight, counts)
    with pytest.raises(ValueError, match="out_rows"):
        native.cvmm_rows(torch.randn(3, 4), weight, counts, out_idx=torch.tensor([0, 1, 0]))


def test_blas_thread_setting_of_the_caller_is_restored():
    """The kernels make each thread's BLAS single-threaded while they run; afterwards the
    calling thread's BLAS must be back to using every thread (or dense matmuls slow down)."""
    import ctypes

    lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    if not hasattr(lib, "mkl_get_max_threads"):
        pytest.skip("PyTorch is not built with MKL: no per-thread BLAS setting to restore")
    before = lib.mkl_get_max_threads()
    counts, P, _, weight = _sorted_problem(3, [40, 0, 25], 16, 8)
    native.cvmm_rows(torch.randn(P, 16), weight, counts)
    native.weight_grad(torch.randn(P, 16), torch.randn(P, 8), counts)
    assert lib.mkl_get_max_threads() == before


def test_without_a_working_compiler_the_pytorch_path_runs(tmp_path):
    """A failed build warns once, says why, and leaves every layer working."""
    script = (
        "import warnings, torch, sparseffn\n"
        "from sparseffn.ops import native\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    layer = sparseffn.SigmaMoE(d_model=8, num_experts=4, expert_size=3, k=2)\n"
        "    layer(torch.randn(5, 8)).sum().backward()\n"
        "assert not native.available()\n"
        "assert 'failed' in native.unavailable_reason(), native.unavailable_reason()\n"
        "assert any('fused CPU kernels unavailable' in str(w.message) for w in caught)\n"
        "print('ok')\n")
    env = {**os.environ, "CC": "false", "SPARSEFFN_CACHE_DIR": str(tmp_path)}
    env.pop("SPARSEFFN_NO_NATIVE", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-2000:]


def _copying_compiler(tmp_path, before_copy=""):
    """A ``$CC`` that logs each call to ``calls.log``, runs the shell line ``before_copy``,
    then writes the library this process loaded to its output (the last argument), so a
    test of the build's bookkeeping spends no time compiling."""
    require_native()
    fake = tmp_path / "cc"
    fake.write_text(f"#!/bin/sh\necho called >> {tmp_path / 'calls.log'}\n{before_copy}\n"
                    f"for out; do :; done\ncp {native.build._lib._name} \"$out\"\n")
    fake.chmod(0o755)
    return fake


def _loading_processes(tmp_path, cc, cache_dir, n, before_load=""):
    """Run ``n`` Python processes at once that load the kernels; the paths they loaded."""
    script = ("import os, sys\n"
              "from sparseffn.ops import native\n"
              f"{before_load}\n"
              "assert native.available(), native.unavailable_reason()\n"
              "print('loaded', native.build._lib._name)\n")
    env = {**os.environ, "CC": str(cc), "SPARSEFFN_CACHE_DIR": str(cache_dir),
           "TMPDIR": str(tmp_path / "tmp")}
    env.pop("SPARSEFFN_NO_NATIVE", None)
    (tmp_path / "tmp").mkdir(exist_ok=True)
    procs = [subprocess.Popen([sys.executable, "-c", script, str(i)], env=env, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(n)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    return [out.split()[-1] for out, _ in outs]


def test_processes_that_need_the_kernels_at_once_build_them_once(tmp_path):
    """pytest-xdist workers and torchrun ranks on a fresh machine all load the kernels at
    once: one runs the compiler, the others wait for it and load what it built. The
    compiler waits until both processes are at the build, so a second call would be in
    its log."""
    started = tmp_path / "started"
    started.mkdir()
    cc = _copying_compiler(tmp_path, before_copy=(
        f"i=0; while [ $(ls {started} | wc -l) -lt 2 ] && [ $i -lt 600 ]; do "
        "sleep 0.1; i=$((i+1)); done\n"
        "sleep 1"))                          # the other process reaches the build meanwhile
    loaded = _loading_processes(tmp_path, cc, tmp_path / "cache", 2, before_load=(
        f"open(os.path.join({str(started)!r}, sys.argv[1]), 'w').close()"))
    assert (tmp_path / "calls.log").read_text().splitlines() == ["called"]
    assert len(set(loaded)) == 1 and Path(loaded[0]).parent == tmp_path / "cache"


def test_a_cache_folder_that_cannot_be_made_builds_into_the_temp_folder(tmp_path):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("a user's file")
    loaded = _loading_processes(tmp_path, _copying_compiler(tmp_path), not_a_folder / "cache",
                                1)
    assert Path(loaded[0]).parent.parent == tmp_path / "tmp"       # $TMPDIR/sparseffn-<uid>
    assert not_a_folder.read_text() == "a user's file"


# ---------------------------------------------------------------------------------------------
# bfloat16: a bf16 GEMM accumulating in float32 (the AVX-512 BF16 kernel of bf16_gemm.h where
# the build targets it, else MKL's), every epilogue in float32, one rounding.

@pytest.fixture
def _bf16():
    if not native.bf16_available():
        pytest.skip("PyTorch's BLAS is not MKL: no bf16 GEMM for the fused kernels")


def _bf16_problem(E, counts, m, n):
    counts, P, expert_of_row, weight = _sorted_problem(E, counts, m, n)
    return counts, P, expert_of_row, weight.bfloat16()


def _rounded_once(got, want):
    """``got`` (bf16) is ``want`` (float32 from the same bf16 inputs) rounded once: within
    half a bf16 step of it everywhere, and equal to its rounding almost everywhere (rounding
    twice, as a bf16 product then a bf16 scale or sum would, misses about a third)."""
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2 ** -8, atol=1e-6 * float(want.abs().max()))
    same = (got == want.to(torch.bfloat16)).float().mean().item()
    assert same > 0.99, f"only {same:.3f} of the elements are the float32 result rounded once"


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize("scatter", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("transposed_weight", [False, True])
def test_bf16_cvmm_rows_is_the_float32_product_rounded_once(_bf16, gather, scatter, scaled,
                                                            transposed_weight):
    E, m, n, R = 5, 700, 37, 40
    counts, P, expert_of_row, weight = _bf16_problem(E, [150, 0, 301, 7, 1], m, n)
    if transposed_weight:
        weight = weight.transpose(1, 2).contiguous().transpose(1, 2)
    src = torch.randn(R if gather else P, m).bfloat16()
    in_idx = torch.randint(0, R, (P,)) if gather else None
    out_idx = _slots(P, R, 12) if scatter else None
    scale = torch.rand(P) if scaled else None
    got = native.cvmm_rows(src, weight, counts, in_idx=in_idx, out_idx=out_idx, scale=scale,
                           out_rows=R + 3, group=12)
    want = _rows_reference(src.double(), weight.double(), expert_of_row, in_idx, out_idx,
                           None if scale is None else scale.double(), R + 3, 12).float()
    _rounded_once(got, want)
    if scatter:
        assert torch.all(got[R:] == 0)   # rows no pair lands on: written, as zeros


def test_bf16_epilogues_and_dots_are_applied_in_float32(_bf16):
    E, m, n = 3, 64, 48
    counts, P, expert_of_row, weight = _bf16_problem(E, [20, 0, 29], m, n)
    src, scale = torch.randn(P, m).bfloat16(), torch.rand(P)
    other, mask = torch.randn(P, n).bfloat16(), torch.randn(P, n).bfloat16()
    z = _rows_reference(src.double(), weight.double(), expert_of_row, None, None, None, P)
    got, dots = native.cvmm_rows(src, weight, counts, scale=scale, dot_with=other,
                                 mask_with=mask)
    _rounded_once(got, torch.where(mask > 0, z * scale.double()[:, None], 0).float())
    # the dots are of the unscaled float32 products, rounded once
    _rounded_once(dots, (z * other.double()).sum(1).float())
    _rounded_once(native.cvmm_rows(src, weight, counts, relu=True), z.relu().float())


def test_bf16_rounding_is_pytorchs(_bf16):
    """An identity weight makes the product exact, so the output is float32(src) · scale
    rounded to bf16 by the kernel: it must be PyTorch's rounding, to nearest even, bit for
    bit, through halfway cases, subnormal results, overflow to infinity and NaN. (Subnormal
    *inputs* are the GEMM's: MKL's on AMX reads them as zero, see ``native.cvmm_rows``.)"""
    n = 64
    counts = torch.tensor([n])
    weight = torch.eye(n).bfloat16().unsqueeze(0)
    src = torch.randn(n, n).bfloat16()
    src[0, :2] = torch.tensor([3e38, -3e38]).bfloat16()
    src[4, :3] = torch.tensor([1e-30, -3e-31, 7e-31]).bfloat16()
    scale = torch.rand(n) * 4
    scale[0] = 2.0                                   # 3e38 · 2 overflows to ±infinity
    scale[1:4] = torch.tensor([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 - 2 ** -9])  # ties
    scale[4] = 1e-9                                  # subnormal float32 products
    got = native.cvmm_rows(src, weight, counts, scale=scale)
    want = (src.float() * scale[:, None]).bfloat16()
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    nan_row = src.clone()
    nan_row[5, 7] = float("nan")
    got = native.cvmm_rows(nan_row, weight, counts, relu=True)
    assert torch.isnan(got[5]).all()                 # NaN · 0 = NaN across the row, kept
    assert torch.equal(torch.isnan(got).sum(1).nonzero().flatten(), torch.tensor([5]))


@pytest.mark.parametrize("a_gather", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_bf16_weight_grad_accumulates_in_float32(_bf16, a_gather, scaled):
    E, ma, nb, R = 5, 33, 2000, 50
    counts, P, expert_of_row, _ = _sorted_problem(E, [0, 700, 3, 200, 90], 1, 1)
    a_src = torch.randn(R if a_gather else P, ma).bfloat16()
    b_src = torch.randn(R, nb).bfloat16()
    a_idx = torch.randint(0, R, (P,)) if a_gather else None
    b_idx = torch.randint(0, R, (P,))
    scale = torch.rand(P) if scaled else None
    got = native.weight_grad(a_src, b_src, counts, a_idx=a_idx, b_idx=b_idx, scale=scale)
    a = (a_src if a_idx is None else a_src[a_idx]).float()
    if scale is not None:       # the kernel rounds each scaled row to bf16, as a bf16 product would
        a = (a * scale[:, None]).bfloat16().float()
    b = b_src[b_idx].double()
    want = torch.stack([a[expert_of_row == e].double().T @ b[expert_of_row == e]
                        for e in range(E)]).float()
    _rounded_once(got, want)
    assert torch.all(got[0] == 0)   # an expert without rows: exactly zero


@pytest.mark.parametrize("m, n", [(1, 1), (2, 16), (3, 33), (17, 300), (257, 32), (513, 65)])
@pytest.mark.parametrize("transposed_weight", [False, True])
def test_bf16_products_at_the_gemm_blocks_edges(_bf16, m, n, transposed_weight):
    """The bf16 GEMM's edges: K (m) odd (a last pair with one element), one K block and
    several (256 elements a block), columns short of a 32-wide tile and over 256 (two column
    blocks), experts of 8 rows (whole row tiles), fewer and more; both weight layouts; and
    the weight gradient, whose first operand is read transposed (8 rows of it at once where
    they are whole), over an odd number of rows."""
    counts, P, expert_of_row, weight = _bf16_problem(4, [8, 3, 0, 21], m, n)
    if transposed_weight:
        weight = weight.transpose(1, 2).contiguous().transpose(1, 2)
    src = torch.randn(P, m).bfloat16()
    got = native.cvmm_rows(src, weight, counts)
    want = _rows_reference(src.double(), weight.double(), expert_of_row, None, None, None, P)
    _rounded_once(got, want.float())
    b_src = torch.randn(P, n).bfloat16()
    got = native.weight_grad(src, b_src, counts)
    want = torch.stack([src[expert_of_row == e].double().T @ b_src[expert_of_row == e].double()
                        for e in range(4)]).float()
    _rounded_once(got, want)
    assert torch.all(got[2] == 0)
    # expert 1's 3 rows end in a pair with one row: the row after them (expert 3's first) is
    # not read, so a NaN there reaches expert 3's gradient only
    src[11, :] = float("nan")
    got = native.weight_grad(src, b_src, counts)
    assert not got[:3].isnan().any() and got[3].isnan().all()


@pytest.mark.parametrize("transposed_weight", [False, True])
def test_bf16_weights_packed_once_a_call_serve_every_chunk_and_no_later_call(_bf16,
                                                                            transposed_weight):
    """The own GEMM packs an expert's weight once a call and keeps it for the expert's next
    chunks of rows: 513-wide rows make chunks of about 127 rows, so experts of 700 and 450
    rows span several, over three K blocks (the last with half a pair) and two column blocks
    (the second partial). A weight changed in place between two calls (same address, same
    shape: a training step) is packed anew: a single expert and one thread, so each call's
    first product is the weight that thread packed last."""
    m, n = 513, 300
    counts, P, expert_of_row, weight = _bf16_problem(3, [700, 0, 450], m, n)
    if transposed_weight:
        weight = weight.transpose(1, 2).contiguous().transpose(1, 2)
    src = torch.randn(P, m).bfloat16()
    want = _rows_reference(src.double(), weight.double(), expert_of_row, None, None, None, P)
    _rounded_once(native.cvmm_rows(src, weight, counts), want.float())
    one = weight[2:].clone() if not transposed_weight else \
        weight[2:].transpose(1, 2).contiguous().transpose(1, 2)
    rows, threads = src[:450], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(2):
            got = native.cvmm_rows(rows, one, torch.tensor([450]))
            _rounded_once(got, (rows.double() @ one[0].double()).float())
            one.mul_(-0.5)            # exact in bf16: the next product is -0.5 times this one
    finally:
        torch.set_num_threads(threads)


def test_bf16_products_take_the_kernels_own_gemm_on_amd_cpus_with_avx512_bf16(_bf16):
    """MKL multiplies bf16 at its float32 speed on AMD CPUs: there (the build targets the CPU it
    runs on) the kernels take their own AVX-512 BF16 GEMM; elsewhere MKL's."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo to say which CPU this is")
    info = cpuinfo.read_text()
    amd = "AuthenticAMD" in info and " avx512_bf16" in info and " avx512bw" in info
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    macros = subprocess.run([compiler, "-march=native", "-dM", "-E", "-"], input="",
                            capture_output=True, text=True).stdout
    targeted = "__AVX512BF16__" in macros and "__AVX512BW__" in macros
    assert native.bf16_gemm() == ("avx512_bf16" if amd and targeted else "mkl")


def test_bf16_cvmm_takes_the_fused_path_and_mixed_dtypes_do_not(_bf16, monkeypatch):
    calls = []
    original = native.cvmm_rows
    monkeypatch.setattr(native, "cvmm_rows",
                        lambda *a, **kw: calls.append(a[0].dtype) or original(*a, **kw))
    indices = torch.randint(0, 4, (9, 2))
    plan = DispatchPlan.build(indices, 4)
    x = torch.randn(9, 6).bfloat16().requires_grad_(True)
    weight = torch.randn(4, 6, 5).bfloat16().requires_grad_(True)
    out = cvmm(x, plan, weight)
    out.float().sum().backward()
    assert calls == [torch.bfloat16, torch.bfloat16]
    want = cvmm_reference(x.detach().double(), indices, weight.detach().double()).float()
    _rounded_once(out, want)
    # mixed dtypes are promoted by the PyTorch path, never handed to the bf16 kernels
    assert not native.cvmm_usable(x, weight.float())
    assert not native.cvmm_usable(x, weight, scale=torch.ones(3, dtype=torch.int64))
    assert native.cvmm_usable(x, weight, scale=torch.ones(3))


def test_bf16_scatter_sums_in_float32_and_rounds_once(_bf16):
    """The k rows of a token are summed in float32, in slot order, so the result is rounded
    once and the same for any thread count and with or without deterministic algorithms."""
    gen = torch.Generator().manual_seed(0)
    T, k, E, m, n = 300, 3, 4, 96, 40
    indices = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    plan = DispatchPlan.build(indices, E)
    x = torch.randn(T, m, generator=gen).bfloat16()
    weight = torch.randn(E, m, n, generator=gen).bfloat16()
    gates = torch.rand(T, k, generator=gen).bfloat16()
    results = []
    for threads, deterministic in [(1, True), (2, True), (2, False)]:
        torch.use_deterministic_algorithms(deterministic)
        try:
            results.append(_with_threads(threads, lambda: cvmm(x, plan, weight, gates)))
        finally:
            torch.use_deterministic_algorithms(False)
    assert torch.equal(results[0], results[1]) and torch.equal(results[1], results[2])
    want = cvmm_reference(x.double(), indices, weight.double(), gates.double()).float()
    for got in results:
        _rounded_once(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_adds_a_tokens_rows_in_slot_order(dtype):
    """y_r = scale_r exactly (one-wide rows of ones, weights of ones); token 0's slots hold
    1, 1e8 and -1e8 and its rows sort in the reverse order (experts 2, 1, 0). In float32 the
    slot order gives (1 + 1e8) - 1e8 = 0, and the sorted-row order would give 1."""
    if dtype == torch.bfloat16 and not native.bf16_available():
        pytest.skip("PyTorch's BLAS is not MKL: no bf16 GEMM for the fused kernels")
    counts = torch.tensor([2, 2, 2])
    src, weight = torch.ones(6, 1, dtype=dtype), torch.ones(3, 1, 4, dtype=dtype)
    # sorted rows: expert 0 (token 0 slot 2, token 1 slot 0), expert 1 (slots 1 and 4),
    # expert 2 (token 0 slot 0, token 1 slot 2)
    slots = torch.tensor([2, 3, 1, 4, 0, 5])
    scale = torch.tensor([-1e8, 5.0, 1e8, 7.0, 1.0, 11.0])
    for threads in (1, 2):
        got = _with_threads(threads, lambda: native.cvmm_rows(
            src, weight, counts, out_idx=slots, scale=scale, out_rows=2, group=3))
        assert got.dtype == dtype
        assert torch.equal(got.float(), torch.tensor([[0.0] * 4, [23.0] * 4]))


def test_scatter_cuts_a_pass_of_an_expert_into_several_pieces():
    """8192-wide rows make 16-row chunks (32 in a pass), so each pass of the 150-row expert
    spans three pieces, shared out between threads: the same bits at 1, 2 and 3 threads."""
    gen = torch.Generator().manual_seed(2)
    E, m, n, T, group = 2, 8192, 5, 160, 2
    counts, P, expert_of_row, weight = _sorted_problem(E, [150, 3], m, n)
    src, scale = torch.randn(P, m, generator=gen), torch.rand(P, generator=gen)
    slots = _slots(P, T, group, generator=gen)
    results = [_with_threads(t, lambda: native.cvmm_rows(src, weight, counts, out_idx=slots,
                                                         scale=scale, out_rows=T, group=group))
               for t in (1, 2, 3)]
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])
    want = _rows_reference(src, weight, expert_of_row, None, slots, scale, T, group)
    torch.testing.assert_close(results[0], want, atol=1e-3, rtol=1e-4)


def test_scatter_refuses_slots_out_of_range():
    counts, P, _, weight = _sorted_problem(2, [2, 1], 4, 3)
    src = torch.randn(P, 4)
    # 2 output rows of 3 slots (slots 0-5), or of 1 slot (one pass: slots 0-1)
    for group, bad in [(3, [0, 1, 6]), (3, [0, -1, 2]), (1, [0, 1, 2]), (1, [1, -1, 0])]:
        with pytest.raises(IndexError, match="sf_cvmm.*out of range"):
            native.cvmm_rows(src, weight, counts, out_idx=torch.tensor(bad), out_rows=2,
                             group=group)
    with pytest.raises(ValueError, match="group must be at least 1"):
        native.cvmm_rows(src, weight, counts, out_idx=torch.tensor([0, 1, 2]), out_rows=3,
                         group=0)


@pytest.mark.unpoisoned   # reads PyTorch's own fill of fresh memory
def test_deterministic_mode_keeps_its_nan_fill_for_everything_but_kernel_outputs():
    """The kernels' outputs skip deterministic mode's NaN fill (they are written in full), and
    the setting is back on for every other allocation afterwards."""
    counts, P, expert_of_row, weight = _sorted_problem(3, [5, 0, 4], 8, 6)
    # four slots per output row: outputs 0, 2, 2, 5, 1, 0, 2, 2, 1
    src, out_idx = torch.randn(P, 8), torch.tensor([0, 8, 9, 20, 4, 1, 10, 11, 5])
    torch.use_deterministic_algorithms(True)
    try:
        got = native.cvmm_rows(src, weight, counts, out_idx=out_idx, out_rows=7, group=4)
        assert torch.utils.deterministic.fill_uninitialized_memory
        assert torch.isnan(torch.empty(3)).all()            # PyTorch's fill, still on
    finally:
        torch.use_deterministic_algorithms(False)
    want = _rows_reference(src, weight, expert_of_row, None, out_idx, None, 7, 4)
    torch.testing.assert_close(got, want)
    assert torch.all(got[[3, 4, 6]] == 0)                   # rows no pair lands on: zeros
