"""The six CVMM kernel calls of one σ-MoE training step, each timed alone, beside the memory
and GEMM references that bound them.

    python scripts/gpu_cvmm_calls.py [--d-model 512 1024 2048] [--tokens 32768] [--rounds 10]
                                     [--lm-shapes] [--graphs]

At the Fig. 2 shapes of Csordás et al. 2023 (arXiv:2310.10837: expert size 128, k = 4,
d_ff = 4·d_model, experts = d_ff / 128; random top-k routing) in bf16, for each call:
milliseconds per call (median over rounds of a loop of calls), TF/s, and, for the two calls
whose inner size is the expert size, the row-tile kernel against the tile kernel in the same
rounds (``auto/tile``), and for the two weight gradients, the split-K the heuristic picks
against one range per expert (``auto/unsplit``). ``--lm-shapes`` adds the shapes of
``bench lm``'s σ-MoE (d_model 256, 8 experts of 256, k = 2, 64 × 256 tokens). Each loop of
calls is launched from Python (the host's launch cost included: on an H200 every call at the
LM's shapes took 0.11-0.18 ms, the host's time, not the kernels'), or with ``--graphs``
replayed from one CUDA graph (``measure.graph_call_times``: the device's time). The calls
(``ops/expert_mlp.py``):

- ``up``    hidden = relu(x[token] W1ᵀ)              m = d_model, n = expert size
- ``down``  y = Σ_slots g · hidden W2                m = expert size, n = d_model (+ k-slot sum)
- ``gpre``  dpre = g · dy[token] W2ᵀ ⊙ relu', dots   m = d_model, n = expert size
- ``gx``    dx = Σ_slots dpre W1                      m = expert size, n = d_model (+ k-slot sum)
- ``dw2``, ``dw1``: the weight gradients.

References: gathering x's rows (``index_select``), the k-slot sum alone, a plain matmul
(cuBLAS on a GPU) of all rows by one expert's matrix (no gather, no groups), and
``torch._grouped_mm`` on pre-gathered rows: the two forward products, and the two weight
gradients as grouped products over each expert's rows (alone, then with the gather of their
token rows and the gate scaling that they need, in the same call), to say whether the
weight gradients should take ``torch._grouped_mm`` where it runs (Hopper).

Then the routing's bookkeeping at each width's number of experts, each against what it
replaced, in the same rounds: the dispatch plan (the counting sort's two launches,
``ops/triton_plan.py``, against the stable sort and binary search for the expert blocks that
it replaced; built with the routing weights, as ``Routing.plan`` builds it, so the counting
sort also sums their mass), Switch's capacity positions (the same two launches, against the
sort and binary search), and the usage statistics (counts and mass from the plan, against the
mass summed by a float scatter-add of its own). With ``--lm-shapes`` the bookkeeping also runs
at the LM's 8 experts, k = 2.
A tool for finding what to speed up; ``sparseffn bench fig2`` times the whole layer.

With ``--device cpu`` (and ``TRITON_INTERPRET=1``) it runs the kernels in Triton's
interpreter at small sizes: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from sparseffn.bench.measure import graph_call_times, kernel_script_device, per_call_times
from sparseffn.ops import triton_cvmm
from sparseffn.ops.assignment import positions_in_expert
from sparseffn.ops.cvmm import DispatchPlan, _expert_order_torch
from sparseffn.routing import expert_usage

EXPERT_SIZE, K = 128, 4
# bench lm's σ-MoE (models/presets.py, d_ff 2048): d_model, experts, expert size, k, tokens
LM_SHAPE = (256, 8, 256, 2, 64 * 256)


def call_times(fns, rounds: int, calls: int, device: torch.device) -> dict[str, list[float]]:
    """Per-round ms per call of each function: ``per_call_times``, or (``--graphs``) the
    calls replayed from a CUDA graph, a function that cannot be captured reported and left
    out."""
    if not GRAPHS:
        return per_call_times(fns, rounds, calls, device)
    times, failures = graph_call_times(fns, rounds, {name: calls for name in fns}, device)
    for name, why in failures.items():
        print(f"  {name}: not captured ({why})", flush=True)
    return times


GRAPHS = False   # set by --graphs


def _with(name: str, value, fn):
    """``fn`` with ``triton_cvmm.<name>`` set to ``value`` for its calls: ``ROW_TILE_MAX_K``
    0 runs every call on the tile kernel (no row-tile kernel); ``WEIGHT_GRAD_SPLITS`` 1 sums
    each expert's weight gradient in one range (no split-K); ``ADD_PARTS_IN_KERNEL`` False
    adds split parts (the weight gradient's ranges, the dots' column tiles) in a second
    launch."""
    def run():
        saved = getattr(triton_cvmm, name)
        setattr(triton_cvmm, name, value)
        try:
            return fn()
        finally:
            setattr(triton_cvmm, name, saved)
    return run


def bench_width(d_model: int, tokens: int, rounds: int, calls: int, device: torch.device,
                dtype: torch.dtype, experts: int | None = None, expert_size: int = EXPERT_SIZE,
                k: int = K) -> None:
    """The six calls at ``d_model`` (``experts`` of ``expert_size``, default Fig. 2's
    4·d_model / ``EXPERT_SIZE``; ``k`` per token)."""
    experts = experts or 4 * d_model // expert_size
    gen = torch.Generator(device=device).manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device=device, generator=gen)   # noqa: E731
    x = randn(tokens, d_model).to(dtype)
    indices = torch.rand(tokens, experts, device=device, generator=gen).topk(k, dim=1).indices
    plan = DispatchPlan.build(indices, experts)
    rows, counts, order, token_of = plan.num_rows, plan.counts, plan.order, plan.token_of_row
    w1 = (randn(experts, expert_size, d_model) * d_model ** -0.5).to(dtype)
    w2 = (randn(experts, expert_size, d_model) * expert_size ** -0.5).to(dtype)
    gates = torch.rand(rows, device=device, generator=gen).to(dtype)
    grad_y = randn(tokens, d_model).to(dtype)
    cvmm, weight_grad = triton_cvmm.cvmm_rows, triton_cvmm.expert_weight_grad
    hidden, _ = cvmm(x, w1.transpose(1, 2), counts, token_of, None, None, rows, 1, True, None, None)
    grad_pre, _ = cvmm(grad_y, w2.transpose(1, 2), counts, token_of, None, gates, rows, 1, False,
                       hidden, hidden)
    steps = {
        "up": lambda: cvmm(x, w1.transpose(1, 2), counts, token_of, None, None, rows, 1, True,
                           None, None),
        "down": lambda: cvmm(hidden, w2, counts, None, order, gates, tokens, k, False, None, None),
        "gpre": lambda: cvmm(grad_y, w2.transpose(1, 2), counts, token_of, None, gates, rows, 1,
                             False, hidden, hidden),
        "gx": lambda: cvmm(grad_pre, w1, counts, None, order, None, tokens, k, False, None, None),
        "dw2": lambda: weight_grad(hidden, grad_y, counts, None, token_of, gates),
        "dw1": lambda: weight_grad(grad_pre, x, counts, None, token_of, None),
    }
    flop = 2 * rows * d_model * expert_size
    print(f"d_model {d_model}: {experts} experts of {expert_size}, k {k}, {rows} rows, "
          f"{flop / 1e9:.1f} GFLOP a call", flush=True)
    total = 0.0
    for name, fn in steps.items():
        contenders = {"auto": fn}
        if name in ("down", "gx"):   # inner size = expert size: the row-tile kernel's calls
            contenders["tile"] = _with("ROW_TILE_MAX_K", 0, fn)
        if name in ("dw2", "dw1"):
            contenders["unsplit"] = _with("WEIGHT_GRAD_SPLITS", 1, fn)
        if name in ("gpre", "dw2", "dw1"):   # the calls with parts to add
            contenders["2nd launch"] = _with("ADD_PARTS_IN_KERNEL", False, fn)
        times = call_times(contenders, rounds, calls, device)
        if "auto" not in times:
            continue
        ms = statistics.median(times["auto"])
        total += ms
        line = f"  {name:5s} {ms:8.3f} ms  {flop / ms / 1e9:6.0f} TF/s"
        if "tile" in times:
            ratio = statistics.median(a / b for a, b in zip(times["auto"], times["tile"]))
            line += f"   tile kernel {statistics.median(times['tile']):.3f} ms, auto/tile {ratio:.3f}"
        if "unsplit" in times:
            splits = triton_cvmm.weight_grad_splits(rows, experts, d_model, expert_size, device)
            ratio = statistics.median(a / b for a, b in zip(times["auto"], times["unsplit"]))
            line += (f"   {splits} splits; unsplit {statistics.median(times['unsplit']):.3f} ms, "
                     f"auto/unsplit {ratio:.3f}")
        if "2nd launch" in times:
            ratio = statistics.median(a / b for a, b in zip(times["auto"], times["2nd launch"]))
            line += f"   parts in a 2nd launch: auto/that {ratio:.3f}"
        print(line, flush=True)
    print(f"  the six calls: {total:.3f} ms", flush=True)
    gathered = x.index_select(0, token_of)
    slots = torch.empty(rows, d_model, device=device, dtype=dtype)
    references = {
        f"gather x's rows [{rows}, {d_model}]": lambda: x.index_select(0, token_of),
        f"k-slot sum [{tokens}, {k}, {d_model}]": lambda: slots.view(tokens, k, d_model).sum(1),
        f"matmul [{rows}, {d_model}] x [{d_model}, {expert_size}]": lambda: gathered @ w1[0].t(),
        f"matmul [{rows}, {expert_size}] x [{expert_size}, {d_model}]": lambda: hidden @ w2[0],
    }
    if hasattr(torch, "_grouped_mm"):   # (on a CPU: a check that the calls run)
        offsets = plan.offsets.to(torch.int32)
        references["_grouped_mm up (pre-gathered)"] = lambda: torch._grouped_mm(
            gathered, w1.transpose(1, 2), offs=offsets)
        references["_grouped_mm down"] = lambda: torch._grouped_mm(hidden, w2, offs=offsets)
        # the weight gradients as grouped products over K (each expert's rows), on rows
        # gathered (and gate-scaled) beforehand, and with those copies in the same call
        grad_y_rows = grad_y.index_select(0, token_of)
        scaled = hidden * gates.unsqueeze(1)
        references["_grouped_mm dw2 (pre-gathered)"] = lambda: torch._grouped_mm(
            scaled.t(), grad_y_rows, offs=offsets)
        references["_grouped_mm dw1 (pre-gathered)"] = lambda: torch._grouped_mm(
            grad_pre.t(), gathered, offs=offsets)
        references["_grouped_mm dw2 with its gather and scaling"] = lambda: torch._grouped_mm(
            (hidden * gates.unsqueeze(1)).t(), grad_y.index_select(0, token_of), offs=offsets)
        references["_grouped_mm dw1 with its gather"] = lambda: torch._grouped_mm(
            grad_pre.t(), x.index_select(0, token_of), offs=offsets)
    for name, fn in references.items():
        try:
            ms = statistics.median(call_times({name: fn}, rounds, calls, device)[name])
            print(f"  reference: {name}: {ms:.3f} ms", flush=True)
        except Exception as error:   # e.g. _grouped_mm not built for this GPU
            print(f"  reference: {name}: failed ({type(error).__name__})", flush=True)


def _plan_before(indices: torch.Tensor, num_experts: int):
    """The dispatch plan's sort and counts as built before the counting sort: a stable sort
    of narrow keys, a binary search of the experts' boundaries, each row's token."""
    return _expert_order_torch(indices.reshape(-1), num_experts, indices.shape[-1])


def _positions_before(experts: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Capacity positions as computed before the counting sort: a stable sort of narrow keys
    and a binary search (the path of grouped positions, here with one group)."""
    return positions_in_expert(experts, num_experts, torch.zeros_like(experts), 1)


def bench_bookkeeping(num_experts: int, k: int, tokens: int, rounds: int, calls: int,
                      device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(0)
    indices = torch.rand(tokens, num_experts, device=device, generator=gen).topk(k).indices
    weights = torch.rand(tokens, k, device=device, generator=gen)
    top1 = indices[:, 0].contiguous()
    # as Routing.plan builds it: with the weights, whose per-expert mass the counting sort sums
    plan = DispatchPlan.build(indices, num_experts, weights=weights)
    pairs = {
        "plan": (lambda: DispatchPlan.build(indices, num_experts, weights=weights),
                 lambda: _plan_before(indices, num_experts)),
        "positions": (lambda: positions_in_expert(top1, num_experts),
                      lambda: _positions_before(top1, num_experts)),
        "usage": (lambda: expert_usage(indices, weights, num_experts, counts=plan.counts,
                                       mass=plan.mass),
                  lambda: expert_usage(indices, weights, num_experts, counts=plan.counts)),
    }
    print(f"routing bookkeeping: {num_experts} experts, {tokens} tokens, k {k}", flush=True)
    for name, (now, before) in pairs.items():
        times = call_times({"now": now, "before": before}, rounds, calls, device)
        if len(times) < 2:
            continue
        t_now, t_before = (statistics.median(times[key]) for key in ("now", "before"))
        print(f"  {name:10s} {t_now:8.3f} ms   before {t_before:8.3f} ms   "
              f"now/before {t_now / t_before:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d-model", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10, help="calls per timed loop")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--lm-shapes", action="store_true",
                        help="also the six calls at bench lm's σ-MoE shapes (LM_SHAPE)")
    parser.add_argument("--graphs", action="store_true",
                        help="time the calls replayed from CUDA graphs: the device's time, "
                             "not the host's (CUDA only)")
    args = parser.parse_args()
    device, where = kernel_script_device(parser, args.device)
    if args.graphs and device.type != "cuda":
        parser.error("--graphs needs a CUDA device")
    global GRAPHS
    GRAPHS = args.graphs
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32   # interpreter: no bf16
    if min(args.d_model) < EXPERT_SIZE:
        parser.error(f"--d-model must be at least {EXPERT_SIZE} (4·d_model / {EXPERT_SIZE} "
                     f"experts, at least k = {K})")
    print(f"CVMM calls of a σ-MoE step: {where}, {dtype}, {args.tokens} tokens, "
          f"expert size {EXPERT_SIZE}, k={K}"
          + (", replayed from CUDA graphs" if GRAPHS else ""), flush=True)
    for d_model in args.d_model:
        bench_width(d_model, args.tokens, args.rounds, args.calls, device, dtype)
    if args.lm_shapes:
        d_model, experts, expert_size, k, tokens = LM_SHAPE
        if device.type != "cuda":     # the interpreter: a check that it runs, at a small size
            tokens = args.tokens
        bench_width(d_model, tokens, args.rounds, args.calls, device, dtype, experts,
                    expert_size, k)
    for d_model in args.d_model:
        bench_bookkeeping(4 * d_model // EXPERT_SIZE, K, args.tokens, args.rounds, args.calls,
                          device)
    if args.lm_shapes:
        _, experts, _, k, tokens = LM_SHAPE
        bench_bookkeeping(experts, k, tokens if device.type == "cuda" else args.tokens,
                          args.rounds, args.calls, device)


if __name__ == "__main__":
    main()
