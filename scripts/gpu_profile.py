"""Where a training step spends its device time: the top kernels by self time.

    python scripts/gpu_profile.py [--layers sigma_moe,pkm] [--tokens 16384] [--d-model 256]
                                  [--fp32] [--top 8] [--device cuda]
    python scripts/gpu_profile.py --lm dense,sigma_moe [--compile default] [--batch 64] ...
    python scripts/gpu_profile.py --fig2 512,2048 [--compile default] [--tokens 32768]

Layers (the default): for each layer of ``sparseffn bench compile`` (at ``--d-model``, bf16
autocast unless ``--fp32``), one warmed-up eager forward+backward is profiled with
``torch.profiler``.

``--lm``: the whole training step that ``sparseffn bench lm`` times (its LM with each named
FFN preset: forward, loss and auxiliary losses, backward, Adam), compiled as ``--compile``
says. ``default`` (the default here) runs the kernels that ``--compile reduce-overhead`` puts
in a CUDA graph, without the graph, so each shows up on its own; ``none`` is the eager step.
Read a preset's list beside dense's: the GPU issue asks for the MoE presets' steps to be no
slower than dense's.

``--fig2``: the σ-MoE step of ``sparseffn bench fig2`` at each d_model (its router in autocast,
experts of 128, k 4) beside the dense MLP of equal parameters, compiled as ``--compile`` says
(``--tokens`` defaults to Fig. 2's 32,768 there).

For each profiled step: its total device time, how many launches it made on the device
(kernels, and the copies and memsets the profiler lists beside them; at the LM's small sizes
a launch, even inside a CUDA graph, costs a few microseconds whatever it computes), and
the ``--top`` kernels by self device time, with their share and launches. On a GPU it also
says how long the host took to issue the step against the step's wall time (without the
profiler; an issue time near the wall time means the device waited on the host, as the
eager σ-MoE step of Fig. 2 seemed to on the H200: 4.4 ms at every d_model), and lists the
``--top`` operators by self CPU time, where each ``sparseffn::`` operator's row holds the
Python of its Triton launches (the driver's launch calls are rows of their own). On a CPU it
lists the operators by self CPU time. A tool for finding what to speed up, not a benchmark
(``sparseffn bench`` does the timing).
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import sparseffn
from sparseffn.bench.compiled import layer_configs
from sparseffn.bench.fig2 import fig2_dense_widths, fig2_sigma_moe, timed_step
from sparseffn.bench.lm_step import byte_tokens, lm_model, training_step_fn
from sparseffn.bench.measure import error_summary, forward_backward_fn
from sparseffn.models import PRESETS


def profile_step(name: str, step: Callable[[], object], device: torch.device, top: int) -> None:
    """Warm ``step`` up, profile one call, print its device time, launches and top kernels."""
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    cuda = device.type == "cuda"
    averages = prof.key_averages()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    # on a GPU, kernels only (no CPU-side operator rows)
    events, total = _longest_first(averages, attr,
                                   torch.autograd.DeviceType.CUDA if cuda else None)
    launches = sum(e.count for e in events)
    what = ("device launches (kernels, copies, memsets)" if cuda
            else "operator calls (nested ones included)")
    print(f"{name}: {total / 1e3:.2f} ms {'device' if cuda else 'CPU'} time, "
          f"{launches} {what} of {len(events)} kinds")
    _print_top(events, attr, total, top)
    if cuda:
        issue, wall = issue_and_wall_ms(step, device)
        print(f"  host: {issue:.2f} ms to issue the step, {wall:.2f} ms to its end on the "
              f"device ({issue / wall:.0%}; near 100%: the device waits on the host)")
        host, host_total = _longest_first(averages, "self_cpu_time_total",
                                          torch.autograd.DeviceType.CPU)
        print(f"  host operators (profiled, so slower): {host_total / 1e3:.2f} ms self CPU time")
        _print_top(host, "self_cpu_time_total", host_total, top)


def _longest_first(averages, attr: str, device_type=None) -> tuple[list, float]:
    """The profiler's rows with some ``attr`` time (of ``device_type`` when given), longest
    first, and their total time (1 when there are none)."""
    rows = [e for e in averages if getattr(e, attr, 0) > 0
            and (device_type is None or e.device_type == device_type)]
    rows.sort(key=lambda e: -getattr(e, attr))
    return rows, sum(getattr(e, attr) for e in rows) or 1.0


def _print_top(rows: list, attr: str, total: float, top: int) -> None:
    """The first ``top`` rows: share of ``total``, ms, calls, name."""
    for e in rows[:top]:
        print(f"   {getattr(e, attr) / total:6.1%} {getattr(e, attr) / 1e3:8.3f} ms  "
              f"x{e.count:<4d} {e.key[:90]}")


def issue_and_wall_ms(step: Callable[[], object], device: torch.device,
                      rounds: int = 5) -> tuple[float, float]:
    """Mean ms from a step's start until ``step`` returns on the host (it has issued its
    work) and until the device has finished it, over ``rounds`` calls, each after a
    synchronize (on a CPU the two are the same)."""
    def synchronize():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    issue = wall = 0.0
    for _ in range(rounds):
        synchronize()
        start = time.perf_counter()
        step()
        issued = time.perf_counter()
        synchronize()
        issue += issued - start
        wall += time.perf_counter() - start
    return issue / rounds * 1e3, wall / rounds * 1e3


def layer_step(config, tokens: int, device: torch.device, dtype: torch.dtype | None):
    """One eager forward+backward of the layer ``config`` on ``tokens`` random tokens."""
    torch.manual_seed(0)
    layer = sparseffn.build_layer(config).to(device).train()
    x = torch.randn(tokens, config.d_model, device=device)
    return forward_backward_fn(layer, x, sparseffn.aux_loss, dtype)


def lm_step(preset: str, args, device: torch.device, dtype: torch.dtype | None):
    """``sparseffn bench lm``'s training step of its LM with the FFN ``preset``."""
    model = lm_model(preset, args.d_model, args.n_layers, args.n_heads, args.context, args.d_ff,
                     device)
    return training_step_fn(model, byte_tokens(args.batch, args.context, device), dtype,
                            args.compile)


def fig2_step(layer: str, d_model: int, tokens: int, device: torch.device,
              dtype: torch.dtype | None, compile: str) -> Callable[[], object]:
    """``bench fig2``'s step at ``d_model`` of its σ-MoE (``layer="sigma_moe"``) or of its
    dense MLP of equal parameters (``"dense_param"``)."""
    torch.manual_seed(0)
    x = torch.randn(tokens, d_model, device=device)
    if layer == "sigma_moe":
        return timed_step(fig2_sigma_moe(d_model).to(device).train(), x, sparseffn.aux_loss,
                          dtype, compile)[0]
    d_ff = fig2_dense_widths(d_model)["dense_param"]
    dense = sparseffn.DenseMLP(sparseffn.DenseMLPConfig(d_model=d_model, d_ff=d_ff))
    return timed_step(dense.to(device).train(), x, None, dtype, compile)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default=None, help="bench compile's layers (default: all)")
    parser.add_argument("--lm", default=None, help="profile the LM step instead, with these "
                        f"presets ({', '.join(PRESETS)})")
    parser.add_argument("--fig2", default=None,
                        help="profile bench fig2's σ-MoE and dense steps at these d_models")
    parser.add_argument("--tokens", type=int, default=None,
                        help="layers, --fig2: tokens per step (16,384; --fig2 32,768)")
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--compile", default="default", choices=("none", "default"),
                        help="--lm, --fig2: how the step is compiled")
    parser.add_argument("--batch", type=int, default=64, help="--lm: sequences per step")
    parser.add_argument("--context", type=int, default=256, help="--lm")
    parser.add_argument("--n-layers", type=int, default=6, help="--lm: blocks")
    parser.add_argument("--n-heads", type=int, default=4, help="--lm")
    parser.add_argument("--d-ff", type=int, default=2048, help="--lm: the dense FFN's width")
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = None if args.fp32 else torch.bfloat16
    if args.lm and args.fig2:
        parser.error("--lm and --fig2 profile different steps: give one")
    if args.fig2:
        tokens = args.tokens or 32768
        steps = {f"{layer} d_model {d}": (lambda layer=layer, d=d: fig2_step(
                     layer, d, tokens, device, dtype, args.compile))
                 for d in (int(d) for d in args.fig2.split(","))
                 for layer in ("sigma_moe", "dense_param")}
        print(f"bench fig2 steps: {tokens} tokens, compile {args.compile}, "
              f"{'fp32' if dtype is None else 'bf16 autocast'}")
    elif args.lm:
        unknown = [p for p in args.lm.split(",") if p not in PRESETS]
        if unknown:
            parser.error(f"unknown preset(s) {', '.join(unknown)}; presets are "
                         f"{', '.join(PRESETS)}")
        steps = {p: (lambda p=p: lm_step(p, args, device, dtype)) for p in args.lm.split(",")}
        print(f"LM steps: d_model {args.d_model}, {args.n_layers} blocks, batch {args.batch} x "
              f"{args.context}, FFNs sized to a dense d_ff {args.d_ff}, compile {args.compile}, "
              f"{'fp32' if dtype is None else 'bf16 autocast'}")
    else:
        configs = layer_configs(args.d_model)
        names = args.layers.split(",") if args.layers else list(configs)
        steps = {n: (lambda n=n: layer_step(configs[n], args.tokens or 16384, device, dtype))
                 for n in names}
    for name, make_step in steps.items():
        # each step is profiled alone: its compiled versions need not outlive it (the LM's
        # presets all compile TransformerLM.loss, whose ninth version would run eagerly)
        torch._dynamo.reset()
        try:
            profile_step(name, make_step(), device, args.top)
        except Exception as error:   # one failing step does not hide the others
            print(f"{name}: FAILED {error_summary(error)}")


if __name__ == "__main__":
    main()
