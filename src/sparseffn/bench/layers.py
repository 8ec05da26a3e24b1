"""``sparseffn bench layers``: σ-MoE against its parameter-equal and active-equal dense MLPs,
on the CPU (fp32, the default) or a GPU (``--device cuda``, usually with ``--dtype bfloat16``).

For each config, in one run: forward (no autograd) and forward+backward times of σ-MoE, of
the dense MLP with the same parameters (Csordás et al.'s fair baseline) and of the dense MLP with
``d_ff = k · expert_size`` (a perfect dispatch: the realised ideal), and the bytes each saves
for backward. Also timed: the expert matrix products alone on pre-sorted rows
(:mod:`.gemm_bound`), which splits the MoE's cost over the active-equal dense into what the
expert shapes cost in the BLAS and what the dispatch adds. The contenders run in rotation;
times are medians over rounds and each ratio is the median of the per-round ratios (runs
adjacent in time), which a noisy machine's drift disturbs least.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Callable

import torch

from ..auxiliary import aux_loss
from ..config import SigmaMoEConfig
from ..layers import DenseMLP, SigmaMoE
from ..matching import active_equal_dense, param_equal_dense
from ..ops import DispatchPlan, native
from .gemm_bound import ExpertGemms
from .measure import (InterruptibleLoop, autocast_dtype_of, describe_device, dtype_name,
                      forward_backward_fn, forward_fn, interleaved_times, paired_ratio, peak_mib,
                      saved_bytes, write_json)


@dataclass(frozen=True)
class BenchConfig:
    name: str
    moe: SigmaMoEConfig
    time_param_dense: bool   # the param-equal dense of (c) is slow: only with --full


def default_configs(d_model: int = 512) -> list[BenchConfig]:
    """The three configs of the foundation issue (fp32, 8192 tokens, d_model 512)."""
    def moe(num_experts: int, expert_size: int, k: int) -> SigmaMoEConfig:
        return SigmaMoEConfig(d_model=d_model, num_experts=num_experts,
                              expert_size=expert_size, k=k)
    return [
        BenchConfig("a", moe(16, 128, 4), True),
        BenchConfig("b", moe(64, 32, 16), True),
        BenchConfig("c", moe(256, 128, 4), False),
    ]


def _ratio(times: dict[str, list[float]], numerator: str, denominator: str) -> float | None:
    if numerator not in times or denominator not in times:
        return None
    return paired_ratio(times[numerator], times[denominator])


def _saved_ratio(a: int | None, b: int | None) -> float | None:
    return None if a is None or b is None else a / b


def bench_config(cfg: BenchConfig, tokens: int, repeats: int, full: bool,
                 peers: list[tuple[str, Callable[[SigmaMoEConfig], torch.nn.Module]]] = (),
                 seed: int = 0, device: torch.device | str = "cpu",
                 autocast_dtype: torch.dtype | None = None) -> list[dict]:
    """Time one config; returns one record per pass ("forward", "forward_backward")."""
    device = torch.device(device)
    torch.manual_seed(seed)
    x = torch.randn(tokens, cfg.moe.d_model).to(device)
    moe = SigmaMoE(cfg.moe).to(device).train()
    dense_param_cfg = param_equal_dense(cfg.moe)
    dense_active = DenseMLP(active_equal_dense(cfg.moe)).to(device).train()
    dense_param = (DenseMLP(dense_param_cfg).to(device).train()
                   if (cfg.time_param_dense or full) else None)

    peer_layers = []
    for peer_name, build in peers:
        try:
            peer_layers.append((peer_name, build(cfg.moe).to(device).train()))
        except Exception as error:  # a peer that cannot be built is reported, not fatal
            print(f"  peer {peer_name}: skipped ({type(error).__name__}: {error})")

    contenders = {"moe": (moe, aux_loss), "dense_param": (dense_param, None),
                  "dense_active": (dense_active, None)}
    for peer_name, layer in peer_layers:
        contenders["peer:" + peer_name] = (layer, getattr(layer, "bench_extra_loss", None))
    with torch.no_grad():
        counts = DispatchPlan.build(moe.router(x).indices, cfg.moe.num_experts).counts.tolist()
    records = []
    for pass_name in ("forward", "forward_backward"):
        fns = {name: (forward_fn(layer, x, autocast_dtype) if pass_name == "forward"
                      else forward_backward_fn(layer, x, extra_loss, autocast_dtype))
               for name, (layer, extra_loss) in contenders.items() if layer is not None}
        fns["expert_gemms"] = ExpertGemms(counts, cfg.moe.d_model, cfg.moe.expert_size,
                                          backward=pass_name == "forward_backward",
                                          device=device, dtype=autocast_dtype or torch.float32)
        times = interleaved_times(fns, repeats, device=device)
        ms = {name: statistics.median(ts) for name, ts in times.items()}
        record = {
            "config": cfg.name,
            "pass": pass_name,
            "device": str(device),
            "dtype": dtype_name(autocast_dtype),
            "tokens": tokens,
            "d_model": cfg.moe.d_model,
            "num_experts": cfg.moe.num_experts,
            "expert_size": cfg.moe.expert_size,
            "k": cfg.moe.k,
            "dense_param_d_ff": dense_param_cfg.d_ff,
            "dense_active_d_ff": dense_active.config.d_ff,
            "moe_ms": ms["moe"],
            "dense_param_ms": ms.get("dense_param"),
            "dense_active_ms": ms["dense_active"],
            "expert_gemms_ms": ms["expert_gemms"],
        }
        if device.type == "cuda":   # the allocator's peak during one call, above its start
            record["peak_mib"] = {name: peak_mib(fn, device) for name, fn in fns.items()}
        record["ratio_param"] = _ratio(times, "moe", "dense_param")
        record["ratio_active"] = _ratio(times, "moe", "dense_active")
        record["ratio_expert_gemms"] = _ratio(times, "moe", "expert_gemms")
        record["expert_gemms_over_active"] = _ratio(times, "expert_gemms", "dense_active")
        for peer_name, _ in peer_layers:
            peer_ms = ms["peer:" + peer_name]
            record.setdefault("peers", {})[peer_name] = {
                "ms": peer_ms, "moe_speedup": _ratio(times, "peer:" + peer_name, "moe")}
        records.append(record)

    moe_saved = saved_bytes(moe, x, aux_loss)
    dense_saved = saved_bytes(dense_param, x) if dense_param is not None else None
    for record in records:
        record["moe_saved_bytes"] = moe_saved
        record["dense_param_saved_bytes"] = dense_saved
        record["dense_active_saved_bytes"] = saved_bytes(dense_active, x)
        record["saved_ratio_param"] = _saved_ratio(moe_saved, dense_saved)
    return records


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def format_table(records: list[dict]) -> str:
    header = (f"{'cfg':<4}{'pass':<18}{'moe ms':>9}{'dense=param':>13}{'dense=active':>14}"
              f"{'moe/param':>11}{'moe/active':>12}{'gemms/active':>14}{'moe/gemms':>11}"
              f"{'saved MB moe/param':>21}")
    lines = [header, "-" * len(header)]
    for r in records:
        saved = (f"{r['moe_saved_bytes'] / 2**20:.1f}/"
                 f"{_fmt(r['dense_param_saved_bytes'] and r['dense_param_saved_bytes'] / 2**20, '.1f')}")
        lines.append(
            f"{r['config']:<4}{r['pass']:<18}{r['moe_ms']:>9.1f}{_fmt(r['dense_param_ms'], '.1f'):>13}"
            f"{r['dense_active_ms']:>14.1f}{_fmt(r['ratio_param'], '.3f'):>11}"
            f"{r['ratio_active']:>12.3f}{r['expert_gemms_over_active']:>14.3f}"
            f"{r['ratio_expert_gemms']:>11.3f}{saved:>21}")
        for peer_name, peer in r.get("peers", {}).items():
            lines.append(f"{'':<4}{'  vs ' + peer_name:<18}{_fmt(peer['ms'], '.1f'):>9}"
                         f"   σ-MoE is {_fmt(peer['moe_speedup'], '.2f')}x faster")
    lines.append("gemms: the expert matrix products alone, on rows pre-sorted by expert "
                 "(no routing, gather, scatter or activation)")
    return "\n".join(lines)


def run(tokens: int = 8192, repeats: int = 7, full: bool = False, peers: bool = False,
        json_path: str | None = None, configs: list[str] | None = None,
        routers: bool = True, device: str = "cpu", dtype: str = "float32") -> list[dict]:
    """Run the benchmark, print the table, and write the JSON list if asked.

    With ``routers`` (and config a selected) the list also holds one forward+backward record
    per router (``"router"`` field; see :mod:`.moe_routers`). On ``device`` "cuda" the times
    are CUDA events and each record also has the allocator's ``peak_mib``; ``dtype``
    "bfloat16"/"float16" runs every layer under autocast (the expert GEMMs in that dtype).

    Ctrl-C (or ``timeout -s INT``) after the first config keeps the configs measured: the
    table and JSON hold them, and a line says what was not timed (during the first config,
    nothing was measured and the interrupt goes through; during the routers, the configs'
    records are kept and the routers' dropped)."""
    dev = torch.device(device)
    autocast_dtype = autocast_dtype_of(dtype)
    selected = [c for c in default_configs() if configs is None or c.name in configs]
    peer_builders = []
    if peers:
        from .peers import available_peers
        peer_builders = available_peers()
    gemm = ""
    if dev.type == "cpu" and autocast_dtype == torch.bfloat16:
        gemm = f", the C kernels' bf16 GEMM: {native.bf16_gemm() or 'none'}"
    print(f"sparseffn bench layers: {tokens} tokens, {dtype}, {describe_device(dev)}, "
          f"torch {torch.__version__}{gemm}")
    records = []
    with InterruptibleLoop(selected) as loop:
        for cfg in loop:
            m = cfg.moe
            print(f"config {cfg.name}: {m.num_experts} experts x {m.expert_size}, k={m.k}, "
                  f"d_model={m.d_model} ...", flush=True)
            records += bench_config(cfg, tokens, repeats, full, peer_builders, device=dev,
                                    autocast_dtype=autocast_dtype)
    if loop.left:
        print(f"bench layers: interrupted: not timed: config "
              f"{', '.join(c.name for c in loop.left)}", flush=True)
    print(format_table(records))
    if routers and not loop.left and any(cfg.name == "a" for cfg in selected):
        from .moe_routers import bench_routers, format_router_table
        print("routers at config a ...", flush=True)
        try:
            router_records = bench_routers(tokens, repeats, device=dev,
                                           autocast_dtype=autocast_dtype)
        except KeyboardInterrupt:
            print("bench layers: interrupted: the routers not timed", flush=True)
        else:
            print(format_router_table(router_records))
            records += router_records
    if json_path:
        write_json(records, json_path)
        print(f"wrote {json_path}")
    return records
