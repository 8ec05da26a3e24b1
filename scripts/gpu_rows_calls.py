"""The product-key top-k and the PEER step at the LM's shapes, each timed against what it
replaced in the same rounds.

    python scripts/gpu_rows_calls.py [--tokens 16384] [--rounds 10]

The shapes are those of ``sparseffn bench lm`` (d_model 256, each FFN sized to a dense
d_ff 2048 MLP; a batch of 64 × 256 tokens): the ``pkm`` and ``peer`` presets.

- ``topk``: ``product_key_topk`` on [tokens·heads, n] score halves, per layer's shape:
  ``keyed`` (random scores: every block takes the top k of its (log2 K + 1)·K candidate
  keys), ``merge before`` (the kernel this replaced, kept here for the comparison: the
  halves' top k by k rounds of reductions, then a k-way merge of the candidate grid's rows),
  ``exact`` (integer scores, ties at the k-th: every block also takes the exact selection
  over the whole grid), and the PyTorch sort path.
- ``peer``: one PEER layer's forward and backward under bf16 autocast: ``one sort`` (the
  reverse index shared by both table gradients) against ``two sorts`` (each table gradient
  sorting the pairs itself, as before).
- ``gather_sum backward``: a PKM and a PEER layer's forward and backward under bf16
  autocast: ``fused`` (``scatter_rows_dot``: the table's and the weights' gradients of
  ``gather_sum`` from one pass over the pairs) against ``two kernels`` (``scatter_rows`` and
  ``gather_dot``, as before).

- ``rows or dense``: the gathered-row products of one PKM and one PEER layer against the
  same values computed densely, for a decision not yet taken. With S the [tokens, N] matrix
  that holds each token's pair weights at their rows (zero elsewhere), ``gather_sum`` is
  ``S · table`` and its gradients ``Sᵀ · dy`` (the table's) and ``dy · tableᵀ`` read at
  the pairs (the weights'); ``gather_dot`` is ``x · tableᵀ`` read at the pairs. At the LM's
  small tables (PKM 3,844 rows and 128 pairs a token, PEER 1,444 rows and 32 pairs) a dense
  product costs 2·N·d FLOPs a token, the rows m·d·2 bytes: on an H100 (about 600 bf16
  TFLOP/s on dense products, about 9 TB/s from L2) the dense form would win where N < ~67·m,
  if the row kernels run at L2's bandwidth. ``rows`` is the operators (forward and both gradients),
  ``dense`` the same three through ``ops/dense_products.py`` (S from ``spread_rows``), which a
  layer takes only after ``set_dense_products_enabled(True)`` (``lm-layers`` times that).

A tool for finding what to speed up; ``sparseffn bench lm`` times the whole step. With
``--device cpu`` (and ``TRITON_INTERPRET=1``) it runs the kernels in Triton's interpreter at
small sizes: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from sparseffn import build_layer
from sparseffn.bench.lm_step import lm_ffn
from sparseffn.bench.measure import kernel_script_device, per_call_times
from sparseffn.ops import dense_products, kernels, native, triton_cvmm, triton_rows
from sparseffn.stores import rows as row_stores


def _median_ms(fns: dict, rounds: int, calls: int, device: torch.device) -> dict[str, float]:
    """Median ms per call of each function (loops of ``calls`` calls, timed in rotation)."""
    return {name: statistics.median(times)
            for name, times in per_call_times(fns, rounds, calls, device).items()}


@contextlib.contextmanager
def _torch_path():
    triton_cvmm.set_triton_enabled(False)
    native.set_native_enabled(False)
    try:
        yield
    finally:
        triton_cvmm.set_triton_enabled(True)
        native.set_native_enabled(True)


@contextlib.contextmanager
def _two_kernels():
    """gather_sum's two gradients from scatter_rows and gather_dot, as before scatter_rows_dot."""
    fused = kernels.scatter_rows_dot
    kernels.scatter_rows_dot = kernels.scatter_rows_and_gather_dot
    try:
        yield
    finally:
        kernels.scatter_rows_dot = fused


@contextlib.contextmanager
def _two_sorts():
    """PEER as before the shared reverse index: each table gradient sorts the pairs."""
    shared = row_stores.shared_row_index
    row_stores.shared_row_index = lambda *args, **kwargs: None
    try:
        yield
    finally:
        row_stores.shared_row_index = shared


def _topk(preset: str, tokens: int, rounds: int, calls: int, device: torch.device) -> None:
    cfg = lm_ffn(preset)
    n = cfg.num_subkeys if preset == "pkm" else round(cfg.num_experts ** 0.5)
    rows = tokens * cfg.heads
    gen = torch.Generator(device=device).manual_seed(0)
    s_a, s_b = (torch.randn(rows, n, device=device, generator=gen) for _ in range(2))
    tied_a, tied_b = s_a.round(), s_b.round()

    def torch_sort():
        with _torch_path():
            return kernels.product_key_topk(s_a, s_b, cfg.k)

    fns = {"keyed": lambda: triton_rows.product_key_topk_indices(s_a, s_b, cfg.k),
           "merge before": lambda: _merge_topk_before(s_a, s_b, cfg.k),
           "exact": lambda: triton_rows.product_key_topk_indices(tied_a, tied_b, cfg.k),
           "torch sort": torch_sort}
    keyed, from_cells = triton_rows.product_key_topk_indices(s_a, s_b, cfg.k)
    if not torch.equal(keyed, _merge_topk_before(s_a, s_b, cfg.k)):
        raise AssertionError("the keyed top-k and the merge before it disagree")
    random = from_cells.float().mean().item()
    tied = triton_rows.product_key_topk_indices(tied_a, tied_b, cfg.k)[1].float().mean().item()
    ms = _median_ms(fns, rounds, calls, device)
    print(f"topk {preset}: [{rows}, {n}] halves, k {cfg.k} (rows from the candidate keys: "
          f"random {random:.0%}, integer {tied:.0%})", flush=True)
    for name, t in ms.items():
        print(f"  {name:12s} {t:8.3f} ms   / merge before {t / ms['merge before']:.2f}",
              flush=True)


if triton_cvmm.triton is not None:
    tl, triton = triton_cvmm.tl, triton_cvmm.triton

    @triton.jit
    def _half_topk_before(ptr, rows64, r_ok, stride, n, kk, BLOCK_R: tl.constexpr,
                          N: tl.constexpr, K: tl.constexpr, BIG: tl.constexpr):
        cols = tl.arange(0, N)
        slots = tl.arange(0, K)
        s = tl.load(ptr + rows64[:, None] * stride + cols[None, :],
                    mask=r_ok[:, None] & (cols < n)[None, :], other=float("-inf"))
        s = tl.where((cols < n)[None, :], triton_rows._rank_key(s, BIG), float("-inf"))
        vals = tl.full((BLOCK_R, K), float("-inf"), tl.float32)
        ids = tl.zeros((BLOCK_R, K), tl.int32)
        for r in range(0, kk):
            best = tl.max(s, 1)
            at = tl.min(tl.where(s == best[:, None], cols[None, :], N), 1)
            vals = tl.where(slots[None, :] == r, best[:, None], vals)
            ids = tl.where(slots[None, :] == r, at[:, None], ids)
            s = tl.where(cols[None, :] == at[:, None], float("-inf"), s)
        return vals, ids

    @triton.jit
    def _merge_topk_before_kernel(a_ptr, b_ptr, idx_ptr, R, n_a, n_b, k, ka, kb, stride_a,
                                  stride_b, BLOCK_R: tl.constexpr, NA: tl.constexpr,
                                  NB: tl.constexpr, KA: tl.constexpr, KB: tl.constexpr,
                                  K: tl.constexpr, BIG: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = rows < R
        rows64 = rows.to(tl.int64)
        va, ia = _half_topk_before(a_ptr, rows64, r_ok, stride_a, n_a, ka, BLOCK_R, NA, KA,
                                   BIG)
        vb, ib = _half_topk_before(b_ptr, rows64, r_ok, stride_b, n_b, kb, BLOCK_R, NB, KB,
                                   BIG)
        no_index = n_a * n_b
        slots_b = tl.arange(0, KB)
        slots = tl.arange(0, K)
        first_b = tl.max(tl.where(slots_b[None, :] == 0, vb, float("-inf")), 1)
        first_ib = tl.sum(tl.where(slots_b[None, :] == 0, ib, 0), 1)
        head = va + first_b[:, None]
        head_full = tl.where(head == float("-inf"), no_index, ia + n_a * first_ib[:, None])
        col = tl.zeros((BLOCK_R, KA), tl.int32)
        out = tl.zeros((BLOCK_R, K), tl.int32)
        best = tl.full((BLOCK_R,), float("nan"), tl.float32)
        tie = tl.zeros((BLOCK_R,), tl.int1)
        for r in range(0, k):
            previous = best
            best = tl.max(head, 1)
            tie = tie | (best == previous)
            at = tl.min(tl.where(head == best[:, None], head_full, no_index), 1)
            out = tl.where(slots[None, :] == r, at[:, None], out)
            took = head_full == at[:, None]
            col = col + took.to(tl.int32)
            nxt = tl.sum(tl.where(took, col, 0), 1)
            nxt_b = tl.max(tl.where(slots_b[None, :] == nxt[:, None], vb, float("-inf")), 1)
            nxt_ib = tl.sum(tl.where(slots_b[None, :] == nxt[:, None], ib, 0), 1)
            row_a = tl.max(tl.where(took, va, float("-inf")), 1)
            row_ia = tl.sum(tl.where(took, ia, 0), 1)
            nxt_sum = row_a + nxt_b
            nxt_full = tl.where(nxt_sum == float("-inf"), no_index, row_ia + n_a * nxt_ib)
            head = tl.where(took, nxt_sum[:, None], head)
            head_full = tl.where(took, nxt_full[:, None], head_full)
        tie = tie | (tl.max((head == best[:, None]).to(tl.int32), 1) > 0)
        if tl.max((tie & r_ok).to(tl.int32), 0) > 0:
            out = triton_rows._exact_candidate_topk(va, ia, vb, ib, n_a, n_b, k, BLOCK_R, KA,
                                                    KB, K)
        taken = r_ok[:, None] & (slots < k)[None, :]
        tl.store(idx_ptr + rows64[:, None] * k + slots[None, :], out.to(tl.int64), mask=taken)


def _merge_topk_before(scores_a, scores_b, k: int) -> torch.Tensor:
    """The product-key top-k's indices as the kernel before the keyed one computed them
    (commit 4f24fd3): each half's top k by k rounds of (max, lowest index), then a k-way merge
    of the candidate grid's rows, with the exact selection for blocks with ties."""
    p2 = triton_cvmm.next_power_of_2
    rows, n_a = scores_a.shape
    n_b = scores_b.shape[1]
    idx = torch.empty(rows, k, dtype=torch.int64, device=scores_a.device)
    ka, kb = min(k, n_a), min(k, n_b)
    held = max(p2(ka) * p2(kb), p2(n_a), p2(n_b))
    block_r = max(1, min(8, 2048 // held))
    _merge_topk_before_kernel[(triton_cvmm.cdiv(rows, block_r),)](
        scores_a, scores_b, idx, rows, n_a, n_b, k, ka, kb, scores_a.stride(0),
        scores_b.stride(0), num_warps=max(1, held // 2048), BLOCK_R=block_r, NA=p2(n_a),
        NB=p2(n_b), KA=p2(ka), KB=p2(kb), K=p2(k), BIG=float(torch.finfo(torch.float32).max / 4))
    return idx


def _layer_step(preset: str, tokens: int, device: torch.device):
    """One forward+backward of the preset's layer (bf16 autocast on CUDA), and its config."""
    cfg = lm_ffn(preset)
    layer = build_layer(cfg).to(device).train()
    x = torch.randn(tokens, cfg.d_model, device=device, requires_grad=True)
    grad = torch.randn(tokens, cfg.d_model, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        layer.zero_grad(set_to_none=True)
        with autocast:
            y = layer(x)
        y.float().backward(grad)
    return step, cfg


def _peer(tokens: int, rounds: int, calls: int, device: torch.device) -> None:
    step, cfg = _layer_step("peer", tokens, device)

    def step_two_sorts():
        with _two_sorts():
            step()

    ms = _median_ms({"one sort": step, "two sorts": step_two_sorts}, rounds, calls, device)
    print(f"peer: {cfg.num_experts} experts, heads {cfg.heads}, k {cfg.k}, {tokens} tokens, "
          f"forward+backward", flush=True)
    for name, t in ms.items():
        print(f"  {name:10s} {t:8.3f} ms   / two sorts {t / ms['two sorts']:.2f}", flush=True)


def _gather_sum_backward(preset: str, tokens: int, rounds: int, calls: int,
                         device: torch.device) -> None:
    step, _ = _layer_step(preset, tokens, device)

    def step_two_kernels():
        with _two_kernels():
            step()

    ms = _median_ms({"fused": step, "two kernels": step_two_kernels}, rounds, calls, device)
    print(f"gather_sum backward, {preset}: {tokens} tokens, forward+backward", flush=True)
    for name, t in ms.items():
        print(f"  {name:11s} {t:8.3f} ms   / two kernels {t / ms['two kernels']:.2f}",
              flush=True)


def _rows_or_dense(preset: str, tokens: int, rounds: int, calls: int,
                   device: torch.device) -> None:
    """Forward and both gradients of the preset's ``gather_sum`` (and, for PEER, of its
    ``gather_dot``) by the row operators and by dense bf16 products, on random rows."""
    cfg = lm_ffn(preset)
    n = cfg.num_subkeys ** 2 if preset == "pkm" else cfg.num_experts
    m, d = cfg.heads * cfg.k, cfg.d_model
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    idx = torch.randint(0, n, (tokens, m), device=device, generator=gen)
    w = torch.rand(tokens, m, device=device, generator=gen)
    table = torch.randn(n, d, device=device, generator=gen).to(dtype)
    x, dy = (torch.randn(tokens, d, device=device, generator=gen).to(dtype) for _ in range(2))
    dh = torch.randn(tokens, m, device=device, generator=gen)

    def sum_rows():       # gather_sum forward, then its table and weight gradients
        kernels.gather_sum(idx, w, table)
        kernels.scatter_rows_dot(idx, w, dy, table)

    def sum_dense():
        dense_products.gather_sum(idx, w, table)
        dense_products.scatter_rows_dot(idx, w, dy, table)

    def dot_rows():       # gather_dot forward, then its x and table gradients
        kernels.gather_dot(x, table, idx)
        kernels.gather_sum(idx, dh, table)
        kernels.scatter_rows(idx, dh, x, n)

    def dot_dense():
        dense_products.gather_dot(x, table, idx)
        dense_products.gather_sum(idx, dh, table)
        dense_products.scatter_rows(idx, dh, x, n)

    fns = {"gather_sum rows": sum_rows, "gather_sum dense": sum_dense}
    if preset == "peer":
        fns.update({"gather_dot rows": dot_rows, "gather_dot dense": dot_dense})
    ms = _median_ms(fns, rounds, calls, device)
    print(f"rows or dense, {preset}: {n} rows of {d}, {m} pairs a token, {tokens} tokens, "
          f"forward and both gradients, {str(dtype).replace('torch.', '')}", flush=True)
    for name, t in ms.items():
        rows = ms[name.replace("dense", "rows")]
        print(f"  {name:17s} {t:8.3f} ms   / rows {t / rows:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per call (default 16384 on CUDA, 64 on the CPU)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10, help="calls per timed loop")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device, where = kernel_script_device(parser, args.device)
    tokens = args.tokens or (16384 if device.type == "cuda" else 64)
    print(f"gathered-row calls at the LM's shapes: {where}, {tokens} tokens", flush=True)
    for preset in ("pkm", "peer"):
        _topk(preset, tokens, args.rounds, args.calls, device)
    _peer(tokens, args.rounds, args.calls, device)
    for preset in ("pkm", "peer"):
        _gather_sum_backward(preset, tokens, args.rounds, args.calls, device)
    for preset in ("pkm", "peer"):
        _rows_or_dense(preset, tokens, args.rounds, args.calls, device)


if __name__ == "__main__":
    main()
