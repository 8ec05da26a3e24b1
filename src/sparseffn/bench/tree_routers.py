"""``sparseffn bench routers``: Chaunin & Mikhailovskiy §4's router speed benchmark (Table 2,
Figure 3), and ours next to it.

The time to compute the routing probabilities ``R [batch, 2^d]`` from ``x [batch, 1024]``,
depths 1..13, fp32, forward and forward+backward (into x and the router weights). Methods,
all with ``(2^d - 1)·dim`` node weights (MoE: ``2^d·dim``), no biases:

- ``moe``: ``softmax(W x)``, one GEMM (Chaunin & Mikhailovskiy: T = S = I, a = identity);
- ``orig``: the original FFF training forward (Belcak & Wattenhofer's code): a GEMM per level
  and the full [batch, 2^d] mixture multiplied by each level's sigmoids;
- ``logs``: the same in log space, exponentiated at the end (Eq. 7);
- ``matrix``: Eq. 9 with dense T and S (three GEMMs); skipped above ``--max-matrix-depth``;
- ``hard``: greedy descent, one node per level per token (inference: forward only);
- ours: ``levelwise`` (the O(2^d) level expansion on node logits), ``matrix_sparse`` (Eq. 9
  with S as an interleave and T in CSR), ``auto`` (the ``TreeRouter`` as layers use it).

Table 2 is the harmonic mean over depths of ``time(orig) / time(method)``, up to depth 8 and
up to 13 (Chaunin & Mikhailovskiy reports CPU: MoE 7.27 / 4.55, T,S 3.55 / 0.88, inference 0.90 /
1.09, logs 1.27 / 1.07; GPU: MoE 45.63 / 57.84, T,S 11.89 / 8.93, inference 4.22 / 4.52, logs
2.58 / 3.22). At each depth all methods run in rotation, so ratios compare runs adjacent in
time. ``--device cuda`` runs it on a GPU (CUDA events) and sets the paper's GPU column beside.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch

from ..ops import fff
from ..router_config import TreeRouterConfig
from ..routers.tree import TreeRouter
from .measure import (InterruptibleLoop, describe_device, graph_call_times, interleaved_times,
                      paired_ratio, verdict, write_json)

METHODS = ("moe", "matrix", "hard", "logs", "orig", "levelwise", "matrix_sparse", "auto")
PAPER_NAMES = {"moe": "MoE", "matrix": "FFF T,S", "hard": "FFF Inference", "logs": "FFF Logs",
               "orig": "FFF Orig"}
# Chaunin & Mikhailovskiy Table 2, CPU: harmonic mean of time(orig)/time(method), depths up to 8 / up to 13.
PAPER_CPU = {"moe": (7.27, 4.55), "matrix": (3.55, 0.88), "hard": (0.90, 1.09),
             "logs": (1.27, 1.07), "orig": (1.0, 1.0)}
# ... and GPU (the same table's GPU columns)
PAPER_GPU = {"moe": (45.63, 57.84), "matrix": (11.89, 8.93), "hard": (4.22, 4.52),
             "logs": (2.58, 3.22), "orig": (1.0, 1.0)}
PASSES = ("forward", "forward_backward")
FORWARD_ONLY = {"hard"}


def _orig(x: torch.Tensor, weight: torch.Tensor, depth: int) -> torch.Tensor:
    """Belcak & Wattenhofer's training forward: per level a GEMM, then Eq. 3-6 on the mixture."""
    mixture = x.new_ones(x.shape[0], 1 << depth)
    for level in range(depth):
        mixture = fff.orig_level(mixture, x @ weight[fff.level_slice(level)].T, "logsigmoid")
    return mixture


def _logs(x: torch.Tensor, weight: torch.Tensor, depth: int) -> torch.Tensor:
    """The same in log space (Eq. 7), one exponentiation at the end."""
    log_mixture = x.new_zeros(x.shape[0], 1 << depth)
    for level in range(depth):
        log_mixture = fff.logs_level(log_mixture, x @ weight[fff.level_slice(level)].T, "logsigmoid")
    return log_mixture.exp()


def router_fns(depth: int, x: torch.Tensor, seed: int = 0) -> dict[str, Callable]:
    """``method -> f(x, weight) -> R`` and each method's weight, for one depth."""
    gen = torch.Generator().manual_seed(seed + depth)
    dim = x.shape[1]
    nodes = (1 << depth) - 1
    tree_weight = (torch.randn(nodes, dim, generator=gen) / dim ** 0.5).to(x.device)
    moe_weight = (torch.randn(nodes + 1, dim, generator=gen) / dim ** 0.5).to(x.device)
    router = TreeRouter(TreeRouterConfig(bias=False), dim, nodes + 1, 1).to(x.device)
    with torch.no_grad():
        router.weight.copy_(tree_weight)
    return {
        "moe": (lambda x, w: torch.softmax(x @ w.T, dim=-1), moe_weight),
        "matrix": (lambda x, w: fff.leaf_probs_matrix(x @ w.T), tree_weight),
        "hard": (lambda x, w: fff.descend(x, w), tree_weight),
        "logs": (lambda x, w: _logs(x, w, depth), tree_weight),
        "orig": (lambda x, w: _orig(x, w, depth), tree_weight),
        "levelwise": (lambda x, w: fff.leaf_probs_levelwise(x @ w.T), tree_weight),
        "matrix_sparse": (lambda x, w: fff.leaf_probs_matrix_sparse(x @ w.T), tree_weight),
        "auto": (lambda x, w: router.leaf_probs(x), router.weight),
    }


def _timed(fn: Callable, weight: torch.Tensor, x: torch.Tensor, backward: bool) -> Callable:
    if not backward:
        def run():
            with torch.no_grad():
                fn(x, weight)
        return run
    x = x.detach().requires_grad_(True)
    if not weight.requires_grad:       # the router's own parameter already is one
        weight = weight.detach().requires_grad_(True)

    def run_backward():
        x.grad = weight.grad = None
        probs = fn(x, weight)
        # a loss touching every probability (the expert mixture's gradient in a layer)
        probs.backward(torch.ones_like(probs) / probs.shape[-1])
    return run_backward


# Under ``graphs=True``: each method's calls captured in one CUDA graph, as many as fit in
# about this much device time (judged from its first, eager call), at most GRAPH_CALLS.
GRAPH_CALLS = 20
GRAPH_BUDGET_MS = 50.0


def bench_tree_routers(depths: list[int], batch: int = 2048, dim: int = 1024, repeats: int = 5,
                       max_matrix_depth: int = 13, methods: tuple[str, ...] = METHODS,
                       passes: tuple[str, ...] = PASSES, seed: int = 0,
                       progress: Callable[[str], None] | None = None,
                       device: torch.device | str = "cpu", graphs: bool = False) -> list[dict]:
    """One record per (method, depth, pass): ``ms`` is the median over ``repeats`` rounds
    (fewer for a method slower than a second per call), on ``device``.

    ``graphs=True`` (CUDA only) times each method's calls replayed from one CUDA graph
    (:func:`~sparseffn.bench.measure.graph_call_times`): the device's time per call without
    the host's launch cost, which at these sizes is most of an eager call on a GPU (see
    docs/performance.md). Records then say ``"timing": "cuda_graph"`` and how many ``calls``
    the graph holds; a method that cannot be captured is reported and left out."""
    device = torch.device(device)
    if graphs and device.type != "cuda":
        raise ValueError(f"graphs=True times CUDA graphs and needs a CUDA device, got {device}")

    torch.manual_seed(seed)
    x = torch.randn(batch, dim).to(device)
    records: list[dict] = []
    with InterruptibleLoop(depths) as loop:
        for depth in loop:
            records += _bench_depth(depth, x, repeats, max_matrix_depth, methods, passes, seed,
                                    progress, device, graphs)
    if loop.left:                 # records holds the whole depths: a cut one returned nothing
        raise DepthsInterrupted(records, loop.left)
    return records


class DepthsInterrupted(KeyboardInterrupt):
    """Ctrl-C (or ``timeout -s INT``) in :func:`bench_tree_routers` after at least one whole
    depth: ``records`` holds the whole depths' records, ``left`` the depths not (wholly)
    timed. A KeyboardInterrupt, so that a caller that does not look for it stops as before."""

    def __init__(self, records: list[dict], left: list[int]) -> None:
        super().__init__(f"interrupted: not timed: depths {', '.join(map(str, left))}")
        self.records, self.left = records, left


def _bench_depth(depth: int, x: torch.Tensor, repeats: int, max_matrix_depth: int,
                 methods: tuple[str, ...], passes: tuple[str, ...], seed: int,
                 progress: Callable[[str], None] | None, device: torch.device, graphs: bool
                 ) -> list[dict]:
    """Time every method at one depth; returns its records (one per method and pass)."""
    batch, dim = x.shape
    records = []

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    fns = router_fns(depth, x, seed)
    for pass_name in passes:
        backward = pass_name == "forward_backward"
        runs = {m: _timed(*fns[m], x, backward=backward) for m in methods
                if not (backward and m in FORWARD_ONLY)
                and not (m == "matrix" and depth > max_matrix_depth)}
        start = time.perf_counter()
        first_ms = {}
        for name, run in runs.items():     # one untimed call each; find the slow ones
            sync()
            t0 = time.perf_counter()
            run()
            sync()
            first_ms[name] = (time.perf_counter() - t0) * 1e3
        extra: dict[str, dict] = {}
        if graphs:
            calls = {name: max(1, min(GRAPH_CALLS, int(GRAPH_BUDGET_MS / max(ms, 1e-3))))
                     for name, ms in first_ms.items()}
            times, failures = graph_call_times(runs, repeats, calls, device)
            for name, why in failures.items():
                print(f"  depth {depth} {pass_name} {name}: not captured in a CUDA graph "
                      f"({why}); left out", flush=True)
            extra = {name: {"timing": "cuda_graph", "calls": calls[name]} for name in times}
        else:
            slow = {name: runs.pop(name) for name in list(runs) if first_ms[name] > 1e3}
            times = interleaved_times(runs, repeats, warmup=1, device=device) if runs else {}
            times.update(interleaved_times(slow, 2, warmup=0, device=device) if slow else {})
        for name, ts in times.items():
            records.append({"method": name, "depth": depth, "pass": pass_name,
                            "ms": statistics.median(ts), "batch": batch, "dim": dim,
                            "device": str(device), "dtype": "float32", "round_ms": ts,
                            **extra.get(name, {"timing": "eager"})})
        if progress:
            progress(f"depth {depth:2d} {pass_name:16s} {time.perf_counter() - start:6.1f} s")
    return records


def _ms(records: list[dict]) -> dict[tuple[str, int, str], float]:
    return {(r["method"], r["depth"], r["pass"]): r["ms"] for r in records}


def _ratio(records: list[dict], method: str, baseline: str, depth: int, pass_name: str
           ) -> float | None:
    """time(method) / time(baseline): the median of per-round ratios when both ran in the
    same rounds (adjacent in time), else the ratio of medians; None if either is missing."""
    found = {r["method"]: r for r in records if r["depth"] == depth and r["pass"] == pass_name
             and r["method"] in (method, baseline)}
    if method not in found or baseline not in found:
        return None
    a, b = found[method].get("round_ms"), found[baseline].get("round_ms")
    if a and b and len(a) == len(b):
        return paired_ratio(a, b)
    return found[method]["ms"] / found[baseline]["ms"]


def harmonic_speedups(records: list[dict], pass_name: str, up_to: int) -> dict[str, float | None]:
    """Chaunin & Mikhailovskiy Table 2: the harmonic mean over depths 1..up_to of ``time(orig)/time(method)``
    (None when a method lacks a depth in range)."""
    ms = _ms(records)
    depths = sorted({r["depth"] for r in records if r["depth"] <= up_to})
    out: dict[str, float | None] = {}
    for method in METHODS:
        ratios = [ms[("orig", d, pass_name)] / ms[(method, d, pass_name)] for d in depths
                  if (method, d, pass_name) in ms and ("orig", d, pass_name) in ms]
        out[method] = len(ratios) / sum(1 / r for r in ratios) \
            if ratios and len(ratios) == len(depths) else None
    return out


def format_table(records: list[dict]) -> str:
    """Per-depth milliseconds, then Table 2 next to the paper's CPU numbers."""
    lines = []
    methods = [m for m in METHODS if any(r["method"] == m for r in records)]
    depths = sorted({r["depth"] for r in records})
    ms = _ms(records)
    graphed = any(r.get("timing") == "cuda_graph" for r in records)
    unit = "ms per call of the device's time, replayed from CUDA graphs" if graphed else "ms"
    for pass_name in PASSES:
        if not any(r["pass"] == pass_name for r in records):
            continue
        lines.append(f"\n{pass_name} ({unit}):")
        lines.append("depth " + "".join(f"{m:>14s}" for m in methods))
        for d in depths:
            cells = "".join(f"{ms[(m, d, pass_name)]:14.2f}" if (m, d, pass_name) in ms else f"{'-':>14s}"
                            for m in methods)
            lines.append(f"{d:5d} " + cells)
    top = max(depths)
    low = min(8, top)
    lines.append(f"\nTable 2: harmonic mean of time(orig)/time(method), depths {min(depths)}..{low} "
                 f"and {min(depths)}..{top}")
    on_gpu = any(r.get("device", "cpu").startswith("cuda") for r in records)
    paper_table = PAPER_GPU if on_gpu else PAPER_CPU
    header = f"{'method':16s}{'fwd <=' + str(low):>12s}{'fwd <=' + str(top):>12s}" \
             f"{'f+b <=' + str(low):>12s}{'f+b <=' + str(top):>12s}   paper " \
             f"{'GPU' if on_gpu else 'CPU'} <=8 / <=13"
    lines.append(header)
    fwd_low, fwd_top = harmonic_speedups(records, "forward", low), harmonic_speedups(records, "forward", top)
    fb_low = harmonic_speedups(records, "forward_backward", low)
    fb_top = harmonic_speedups(records, "forward_backward", top)
    for m in methods:
        cells = "".join(f"{v:12.2f}" if v is not None else f"{'-':>12s}"
                        for v in (fwd_low[m], fwd_top[m], fb_low[m], fb_top[m]))
        paper = paper_table.get(m)
        name = f"{m} ({PAPER_NAMES[m]})" if m in PAPER_NAMES else m
        lines.append(f"{name:16.16s}{cells}   " + (f"{paper[0]:.2f} / {paper[1]:.2f}" if paper else "(ours)"))
    lines.append("\n" + "\n".join(check_targets(records)))
    return "\n".join(lines)


# The router layers use is ``auto``; ``levelwise`` times the expansion on unpadded logits
# alone, which the router pads on the CPU (``routers/tree.py``), so its line is a reference.
_TARGET_NAMES = {"levelwise": "levelwise (the expansion alone; the router is auto)",
                 "auto": "auto"}


def check_targets(records: list[dict]) -> list[str]:
    """The issue's targets, each as a line ending in ``ok`` or ``MISSED`` (or ``n/a``)."""
    ms = _ms(records)
    depths = sorted({r["depth"] for r in records})
    out = []

    fwd8 = harmonic_speedups(records, "forward", min(8, max(depths)))["matrix"]
    fwd13 = harmonic_speedups(records, "forward", max(depths))["matrix"]
    ok = None if fwd8 is None or fwd13 is None or max(depths) < 13 else (fwd8 > 1 and fwd13 < 1)
    out.append(f"target: matrix faster than orig up to depth 8 ({fwd8 and round(fwd8, 2)}), slower "
               f"by depth 13 ({fwd13 and round(fwd13, 2)}), as the paper: {verdict(ok)}")
    for method in ("levelwise", "auto"):
        for pass_name in PASSES:
            ratios = [r for r in (_ratio(records, method, "moe", d, pass_name) for d in depths)
                      if r is not None]
            if ratios:
                worst = max(ratios)
                out.append(f"target: {_TARGET_NAMES[method]} within 1.5x of moe at every "
                           f"depth, {pass_name}: worst {worst:.2f}x: {verdict(worst <= 1.5)}")
        if (method, 13, "forward") in ms and ("matrix", 13, "forward") in ms:
            speedup = ms[("matrix", 13, "forward")] / ms[(method, 13, "forward")]
            out.append(f"target: {method} >= 15x faster than matrix at depth 13 (forward): "
                       f"{speedup:.1f}x: {verdict(speedup >= 15)}")
    hard = [(d, 1 / r) for d in depths if d >= 8
            for r in [_ratio(records, "hard", "moe", d, "forward")] if r is not None]
    if hard:
        out.append("target: hard faster than moe from depth 8: "
                   + ", ".join(f"d{d} {s:.1f}x" for d, s in hard)
                   + f": {verdict(all(s > 1 for _, s in hard))}")
    if _ratio(records, "hard", "moe", 13, "forward") is not None:
        s = 1 / _ratio(records, "hard", "moe", 13, "forward")
        out.append(f"target: hard >= 20x faster than moe at depth 13: {s:.1f}x: {verdict(s >= 20)}")
    return out


def plot(records: list[dict], path: str) -> None:
    """Time against depth per method, log scale, one panel per pass (Chaunin & Mikhailovskiy
    Figure 3)."""
    from .plotting import pyplot
    plt = pyplot()
    passes = [p for p in PASSES if any(r["pass"] == p for r in records)]
    fig, axes = plt.subplots(1, len(passes), figsize=(6.5 * len(passes), 4.5), squeeze=False)
    for ax, pass_name in zip(axes[0], passes):
        for method in METHODS:
            pts = sorted((r["depth"], r["ms"]) for r in records
                         if r["method"] == method and r["pass"] == pass_name)
            if pts:
                ax.plot(*zip(*pts), marker="o", label=PAPER_NAMES.get(method, method + " (ours)"))
        ax.set_yscale("log")
        ax.set_xlabel("depth d (2^d experts)")
        ax.set_ylabel("ms per batch")
        ax.set_title(f"routing probabilities, {pass_name.replace('_', '+')}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(depths: list[int], batch: int = 2048, dim: int = 1024, repeats: int = 5,
        max_matrix_depth: int = 13, json_path: str | None = None, plot_path: str | None = None,
        forward_only: bool = False, device: str = "cpu", graphs: bool = False) -> list[dict]:
    """Run, print the per-depth times and Table 2, write JSON / PNG if asked (``graphs``: see
    :func:`bench_tree_routers`). Ctrl-C (or ``timeout -s INT``) after the first whole depth
    reports and writes the whole depths, and a line names the depths not timed."""
    dev = torch.device(device)
    if graphs and dev.type != "cuda":
        raise ValueError(f"--graphs times CUDA graphs and needs --device cuda, got {device}")
    if plot_path:
        from .plotting import pyplot
        pyplot()   # fail before the long run if matplotlib is missing
    print(f"sparseffn bench routers: batch {batch}, dim {dim}, depths {depths[0]}..{depths[-1]}, "
          f"fp32, {describe_device(dev)}, torch {torch.__version__}"
          + (", each method's calls replayed from one CUDA graph" if graphs else ""), flush=True)
    try:
        records = bench_tree_routers(depths, batch, dim, repeats, max_matrix_depth,
                                     passes=("forward",) if forward_only else PASSES,
                                     progress=lambda line: print(line, flush=True), device=dev,
                                     graphs=graphs)
    except DepthsInterrupted as cut:    # the whole depths are reported and written
        records = cut.records
        print(f"bench routers: {cut}", flush=True)
    print(format_table(records))
    if json_path:
        write_json(records, json_path)
        print(f"wrote {json_path}")
    if plot_path:
        plot(records, plot_path)
        print(f"wrote {plot_path}")
    return records
