"""``sparseffn bench fig2``: one σ-MoE layer at the shapes of Fig. 2 of Csordás et al. 2023
(arXiv:2310.10837), beside its dense baselines and other MoE kernels, on any device.

Shapes: ``tokens`` tokens (32,768 by default), expert size 128, k = 4, d_ff = 4·d_model
split into d_ff / 128 experts. Contenders, timed forward+backward in rotation:

- ``sparseffn``: :class:`~sparseffn.layers.SigmaMoE` (its default kernels: Triton on CUDA);
- ``sparseffn_torch`` (CUDA only): the same layer on the PyTorch implementation of the
  operators (``torch._grouped_mm``, no Triton), to show what the kernels add;
- ``dense_param``: the dense MLP with the σ-MoE's parameters (d_ff = 4·d_model);
- ``dense_active``: the dense MLP of the active width (d_ff = k · 128), what a perfect
  dispatch would cost;
- with ``--peers``, on any device: ``torch._grouped_mm`` used plainly behind the same
  sigmoid top-k router (``grouped_mm``) and the per-expert loop of Hugging Face's Mixtral
  block (``mixtral_loop``: softmax router, a host read per expert; always timed eagerly),
  both from :mod:`sparseffn.bench.peers`;
- with ``--peers`` on CUDA: the σ-MoE of the authors' Triton CVMM (``moe_layer``) and
  ScatterMoE (Tan et al. 2024, arXiv:2403.08245) behind the same sigmoid top-k router, from
  a folder holding their sources (``--peers-dir``; neither is on PyPI); and Liger-Kernel's
  Triton ``fused_moe`` (PyPI ``liger-kernel``, where it imports), whose experts are SwiGLU
  only, so its intermediate size is ``LIGER_INTERMEDIATE`` = 88: 3·88 = 264 weights per
  d_model against the σ-MoE expert's 2·128 = 256, the same parameters and FLOPs to 3%.

Every peer is built in the benchmark's dtype and given its input in it (pure bf16 training
under bf16: ScatterMoE's, Liger's and ``torch._grouped_mm``'s kernels take one dtype
throughout and do not follow autocast).

The σ-MoE's router computes its selection product in the router ``precision`` given
(``"autocast"`` by default here: in bf16 under bf16 autocast, as the peers' routers and
Csordás et al.'s own code do; the library's default, ``"float32"``, is Switch's selective
precision and costs a few fp32 GEMMs more).

``compile``: ``"none"`` times every contender eagerly; ``"default"`` wraps every module in
``torch.compile``; ``"reduce-overhead"`` in ``torch.compile(mode="reduce-overhead")``, whose
CUDA graphs remove the per-launch host cost (a σ-MoE step launches about a hundred kernels; a
dense one a handful). A contender that does not compile runs eagerly and is marked so.

Times are medians over rounds (CUDA events on a GPU); ratios are medians of per-round ratios
(runs adjacent in time). Peak MiB is the allocator's peak during one forward+backward above
what was allocated before it (CUDA only).
"""

from __future__ import annotations

import os
import statistics
import sys
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..auxiliary import aux_loss
from ..layers import DenseMLP, SigmaMoE
from ..layers.dense import DenseMLPConfig
from ..layers.sigma_moe import SigmaMoEConfig
from ..routers.sigma import SigmaRouterConfig
from ..ops import triton_cvmm
from ..runtime import check_compile_mode, compiled, compiling_many, deterministic_algorithms
from .measure import (InterruptibleLoop, autocast_dtype_of, describe_device, dtype_name,
                      error_summary, first_call_or_eager, forward_backward_fn,
                      keeping_swallowed_interrupts, new_graph_step, paired_ratio, peak_mib,
                      raise_if_interrupted, raise_swallowed_interrupt, times_kept_on_interrupt,
                      verdict, write_json)
from .peers import GroupedMMMoE, MixtralStyleMoE, grouped_mm_missing_on

EXPERT_SIZE = 128
K = 4
# A SwiGLU expert of intermediate size I holds 3·I·d_model weights: I = 88 ≈ 2·128 / 3.
LIGER_INTERMEDIATE = 88
# Timed eagerly under every --compile: the loop's shapes depend on the routing (a host read
# and a recompilation per expert and batch), so compiling it only measures the compiler; the
# Liger fused MoE reads its tile count on the host (``.item()``), so a graph breaks there and
# cannot be captured, and on an H100 compiling it under reduce-overhead took minutes a width.
EAGER_PEERS = frozenset({"mixtral_loop", "liger_fused_moe"})


def timed_step(module: nn.Module, x: torch.Tensor, extra_loss, dtype: torch.dtype | None,
               compile: str, name: str | None = None) -> tuple[Callable[[], None], bool]:
    """A forward+backward of ``module`` (compiled as ``compile`` says) and whether it
    compiled: a module that fails to compile (at the first call) runs eagerly."""
    def eager():
        return forward_backward_fn(module, x, extra_loss, dtype)
    if compile == "none":
        return eager(), False
    run = forward_backward_fn(compiled(module, compile), x, extra_loss, dtype)

    def step():
        new_graph_step(compile)
        run()
    return first_call_or_eager(step, eager, name or type(module).__name__)


class _ScatterMoE(nn.Module):
    """ScatterMoE's MLP behind the σ-MoE's sigmoid top-k router (same parameters). Its
    kernels take one dtype throughout (they do not follow autocast), so under a reduced
    precision the module is built in that dtype and its input cast to it: pure bf16 training,
    a little cheaper than autocast's fp32 weights."""

    def __init__(self, mlp_cls, d_model: int, num_experts: int):
        super().__init__()
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.mlp = mlp_cls(input_size=d_model, hidden_size=EXPERT_SIZE, num_experts=num_experts,
                           top_k=K, activation=F.relu)

    def forward(self, x):
        x = x.to(self.router.weight.dtype)
        gates, experts = torch.sigmoid(self.router(x)).topk(K, dim=-1)
        return self.mlp(x, gates.to(x.dtype), experts)


class _LigerMoE(nn.Module):
    """Liger-Kernel's fused MoE (``LigerFusedMoEFunction``: the gather fused into the up
    projection's loads, SwiGLU, the down projection, a per-token gather-sum) behind the
    σ-MoE's sigmoid top-k router. ``fused_moe(x, gate_up [E, 2I, d], down [E, d, I], int32
    experts [T, k], gates [T, k]) -> [T, d]``, with the gate projection in rows ``[:I]`` of
    ``gate_up`` and the up projection in ``[I:]``. Its kernels take one dtype throughout, so
    the module is built in the benchmark's dtype, as :class:`_ScatterMoE` is."""

    def __init__(self, fused_moe, d_model: int, num_experts: int,
                 intermediate: int = LIGER_INTERMEDIATE):
        super().__init__()
        self.fused_moe = fused_moe
        self.router = nn.Linear(d_model, num_experts, bias=False)
        self.gate_up = nn.Parameter(torch.randn(num_experts, 2 * intermediate, d_model)
                                    / d_model ** 0.5)
        self.down = nn.Parameter(torch.randn(num_experts, d_model, intermediate)
                                 / intermediate ** 0.5)

    def forward(self, x):
        x = x.to(self.router.weight.dtype)
        gates, experts = torch.sigmoid(self.router(x)).topk(K, dim=-1)
        return self.fused_moe(x, self.gate_up, self.down, experts.to(torch.int32),
                              gates.to(x.dtype))


class _InDtype(nn.Module):
    """``inner`` given its input in its parameters' dtype (a peer built in the benchmark's
    dtype, see :class:`_ScatterMoE`)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x.to(next(self.inner.parameters()).dtype))


def portable_peer_builders(dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
                           ) -> dict[str, Callable[[int, int], nn.Module]]:
    """Builders ``(d_model, num_experts) -> module`` for the peers that run on every device:
    ``torch._grouped_mm`` used plainly (where this PyTorch has it for ``device``) and the
    Mixtral-style loop, at the σ-MoE's sizes, in ``dtype`` when one is given."""
    def build(peer_class):
        def builder(d_model: int, num_experts: int) -> nn.Module:
            cfg = SigmaMoEConfig(d_model=d_model, num_experts=num_experts,
                                 expert_size=EXPERT_SIZE, k=K)
            return _InDtype(peer_class(cfg).to(dtype or torch.float32))
        return builder
    builders = {}
    missing = grouped_mm_missing_on(device)
    if missing is None:
        builders["grouped_mm"] = build(GroupedMMMoE)
    else:
        print(f"  peer grouped_mm: skipped ({missing})")
    builders["mixtral_loop"] = build(MixtralStyleMoE)
    return builders


def peer_builders(peers_dir: str, dtype: torch.dtype | None = None
                  ) -> dict[str, Callable[[int, int], nn.Module]]:
    """Builders ``(d_model, num_experts) -> module`` for the CUDA peers found under
    ``peers_dir`` and for Liger-Kernel's fused MoE where it imports (ScatterMoE's and Liger's
    in ``dtype`` when one is given, see :class:`_ScatterMoE`)."""
    builders = {}
    authors = os.path.join(peers_dir, "moe_layer", "triton_src")
    if os.path.isdir(authors):
        sys.path.insert(0, authors)
        try:
            from moe_layer.moe_layer_simple import MoE as AuthorsMoE
            builders["csordas_cvmm"] = lambda d, e: AuthorsMoE(d, e, EXPERT_SIZE, K,
                                                               selection_mode="sigmoid")
        except Exception as error:   # a peer that does not import is reported, not fatal
            print(f"  peer csordas_cvmm: skipped ({type(error).__name__}: {error})")
    scatter = os.path.join(peers_dir, "scattermoe")
    if os.path.isdir(scatter):
        sys.path.insert(0, scatter)
        try:
            from scattermoe.mlp import MLP as ScatterMLP
            builders["scattermoe"] = lambda d, e: _ScatterMoE(ScatterMLP, d, e).to(
                dtype or torch.float32)
        except Exception as error:
            print(f"  peer scattermoe: skipped ({type(error).__name__}: {error})")
    try:
        from liger_kernel.ops.fused_moe import LigerFusedMoEFunction
        builders["liger_fused_moe"] = lambda d, e: _LigerMoE(LigerFusedMoEFunction.apply, d,
                                                             e).to(dtype or torch.float32)
    except Exception as error:   # not installed: `pip install liger-kernel`
        print(f"  peer liger_fused_moe: skipped ({type(error).__name__}: {error})")
    return builders


def fig2_sigma_moe(d_model: int, router_precision: str = "autocast") -> SigmaMoE:
    """The σ-MoE of Fig. 2 at ``d_model``: d_ff = 4·d_model in experts of ``EXPERT_SIZE``,
    ``K`` of them per token."""
    return SigmaMoE(SigmaMoEConfig(
        d_model=d_model, num_experts=4 * d_model // EXPERT_SIZE, expert_size=EXPERT_SIZE, k=K,
        router=SigmaRouterConfig(precision=router_precision)))


def fig2_dense_widths(d_model: int) -> dict[str, int]:
    """The d_ff of the dense MLPs each σ-MoE is set beside: equal parameters (``dense_param``,
    4·d_model) and equal active hidden units (``dense_active``, K·EXPERT_SIZE)."""
    return {"dense_param": 4 * d_model, "dense_active": K * EXPERT_SIZE}


def _prepare_contenders(contenders: dict[str, Callable[[], None]], is_compiled: dict[str, bool],
                        sigma_moe: Callable[[], SigmaMoE], x: torch.Tensor, d_model: int,
                        num_experts: int, device: torch.device, dtype: torch.dtype | None,
                        peers: dict[str, Callable[[int, int], nn.Module]], compile: str) -> None:
    """Fill ``contenders`` (name: a forward+backward to time) and ``is_compiled`` in the
    order σ-MoE, the dense MLPs, σ-MoE's PyTorch path (CUDA), the peers, so that what an
    interrupt leaves ready starts with what the targets compare. A Ctrl-C that Python dropped
    while one compiled is raised before the next."""
    contenders["sparseffn"], is_compiled["sparseffn"] = timed_step(sigma_moe(), x, aux_loss,
                                                                   dtype, compile)
    for name, d_ff in fig2_dense_widths(d_model).items():
        raise_swallowed_interrupt()
        dense = DenseMLP(DenseMLPConfig(d_model=d_model, d_ff=d_ff)).to(device).train()
        contenders[name], is_compiled[name] = timed_step(dense, x, None, dtype, compile)
    raise_swallowed_interrupt()
    if device.type == "cuda" and triton_cvmm.triton_enabled():
        triton_cvmm.set_triton_enabled(False)   # the choice is made inside the operators
        try:
            torch_layer = sigma_moe()
            if compile != "none":
                # On an H100 this step failed CUDA-graph capture at every width, while alone
                # it captured: it likely reuses the graph compiled for the first layer (same
                # class), so that its first call is a capture with no eager warm-up, and the
                # PyTorch path's one-time check of torch._grouped_mm (a copy from host memory
                # and a host read) ran inside it. One eager step first makes that check.
                forward_backward_fn(torch_layer, x, aux_loss, dtype)()
            torch_run, is_compiled["sparseffn_torch"] = timed_step(torch_layer, x, aux_loss,
                                                                   dtype, compile)
        finally:
            triton_cvmm.set_triton_enabled(True)

        def torch_path(run=torch_run):
            triton_cvmm.set_triton_enabled(False)
            try:
                run()
            finally:
                triton_cvmm.set_triton_enabled(True)
        contenders["sparseffn_torch"] = torch_path
    for name, build in peers.items():
        raise_swallowed_interrupt()
        try:
            contenders[name], is_compiled[name] = timed_step(
                build(d_model, num_experts).to(device).train(), x, None, dtype,
                "none" if name in EAGER_PEERS else compile, name)
            contenders[name]()
        except Exception as error:
            contenders.pop(name, None)
            is_compiled.pop(name, None)
            raise_if_interrupted(error)
            print(f"  peer {name}: skipped at d_model {d_model} ({error_summary(error)})")


def bench_width(d_model: int, tokens: int, repeats: int, device: torch.device,
                dtype: torch.dtype | None, peers: dict[str, Callable[[int, int], nn.Module]],
                compile: str = "none", router_precision: str = "autocast") -> dict:
    """One d_model: every contender's forward+backward ms and peak MiB."""
    torch.manual_seed(0)
    num_experts = 4 * d_model // EXPERT_SIZE
    x = torch.randn(tokens, d_model, device=device)

    def sigma_moe():
        return fig2_sigma_moe(d_model, router_precision).to(device).train()
    contenders: dict[str, Callable[[], None]] = {}
    is_compiled: dict[str, bool] = {}
    stopped = ""
    try:
        _prepare_contenders(contenders, is_compiled, sigma_moe, x, d_model, num_experts,
                            device, dtype, peers, compile)
    except KeyboardInterrupt:
        if not {"sparseffn", "dense_param"} <= contenders.keys():
            raise
        stopped = f"interrupted while preparing d_model {d_model}'s contenders"
        print(f"  {stopped}; timing the {len(contenders)} ready", flush=True)
    # three warm-up rounds: compilation, autotuning, the allocator
    times, stopped = times_kept_on_interrupt(contenders, repeats, 3, device, stopped)
    record = {"d_model": d_model, "tokens": tokens, "num_experts": num_experts,
              "expert_size": EXPERT_SIZE, "k": K, "device": str(device),
              "dtype": dtype_name(dtype), "compile": compile,
              "router_precision": router_precision, "compiled": is_compiled,
              "ms": {name: statistics.median(ts) for name, ts in times.items()},
              "peak_mib": {name: peak_mib(run, device) for name, run in contenders.items()},
              "over_dense_param": {name: paired_ratio(ts, times["dense_param"])
                                   for name, ts in times.items()},
              "rounds": len(times["sparseffn"])}
    if stopped:
        record["interrupted"] = stopped
    speedups = {name: paired_ratio(times[name], times["sparseffn"])
                for name in peers if name in times}
    record["speedup_over"] = speedups
    if speedups:
        best = min(speedups, key=lambda n: record["ms"][n])
        record["best_peer"] = best
        record["best_peer_over_sparseffn"] = speedups[best]
    return record


# The GPU issue's targets at Fig. 2's shapes (H100, bf16, forward+backward): σ-MoE's time over
# the parameter-equal dense MLP's at most this at each d_model, ...
TARGET_OVER_DENSE = {512: 1.0, 1024: 0.5, 2048: 0.2}
# ... at least this many times as fast as the faster of these two peers ...
TARGET_SPEEDUP = 2.0
REFERENCE_PEERS = ("csordas_cvmm", "scattermoe")
# ... faster than SonicMoE (arXiv:2512.14080) where it runs, and a peak no higher than
# ScatterMoE's.
SONIC_PEER = "sonic_moe"


def check_targets(records: list[dict]) -> list[str]:
    """The GPU issue's targets for these records, each as a line ending in ``ok`` or
    ``MISSED`` (``n/a`` with the reason where this run cannot tell). They are stated for an
    H100 in bf16 at 32,768 tokens; a run elsewhere is checked against them all the same, and
    the first line says so."""
    if not records:
        return []
    first = records[0]
    out = [f"targets of the GPU issue (H100, bf16, 32,768 tokens; this run: {first['device']}, "
           f"{first['dtype']}, {first['tokens']} tokens, compile {first['compile']}):"]

    def line(what: str, value: str, ok: bool | None, why: str = "") -> str:
        return f"target: {what}" + (f": {value}" if value else "") + f": {verdict(ok, why)}"

    for r in records:
        limit = TARGET_OVER_DENSE.get(r["d_model"])
        if limit is not None:
            ratio = r["over_dense_param"]["sparseffn"]
            out.append(line(f"sparseffn / dense_param <= {limit} at d_model {r['d_model']}",
                            f"{ratio:.2f}", ratio <= limit))
        speedups = r.get("speedup_over", {})
        timed = [p for p in REFERENCE_PEERS if p in speedups]
        what = (f"sparseffn >= {TARGET_SPEEDUP:g}x as fast as the faster of "
                f"{' and '.join(REFERENCE_PEERS)} at d_model {r['d_model']}")
        if timed:
            best = min(timed, key=lambda p: r["ms"][p])
            out.append(line(what, f"{best} {speedups[best]:.2f}x",
                            speedups[best] >= TARGET_SPEEDUP))
        else:
            out.append(line(what, "", None, "neither was timed"))
        if SONIC_PEER in speedups:
            out.append(line(f"sparseffn faster than {SONIC_PEER} at d_model {r['d_model']}",
                            f"{speedups[SONIC_PEER]:.2f}x", speedups[SONIC_PEER] > 1))
        mine, theirs = r["peak_mib"].get("sparseffn"), r["peak_mib"].get("scattermoe")
        what = f"sparseffn's peak MiB <= scattermoe's at d_model {r['d_model']}"
        if r["compile"] == "reduce-overhead":
            out.append(line(what, "", None, "CUDA graphs allocate at capture; time it eagerly"))
        elif mine is None or theirs is None:
            out.append(line(what, "", None, "no peak from the CUDA allocator"
                            if mine is None else "scattermoe was not timed"))
        else:
            out.append(line(what, f"{mine:.0f} against {theirs:.0f}", mine <= theirs))
    if not any(SONIC_PEER in r.get("speedup_over", {}) for r in records):
        out.append(line(f"sparseffn faster than {SONIC_PEER} where it runs", "", None,
                        "not among the peers timed"))
    return out


def format_table(records: list[dict]) -> str:
    names = list(dict.fromkeys(n for r in records for n in r["ms"]))   # every width's, in order
    header = f"{'d_model':>8}" + "".join(f"{n:>22}" for n in names)
    lines = [header, "-" * len(header)]
    for r in records:
        cells = []
        for n in names:
            ms = r["ms"].get(n)
            peak = r["peak_mib"].get(n)
            cell = "-" if ms is None else f"{ms:.2f}" + (f" ({peak:.0f})" if peak is not None else "")
            cells.append(f"{cell:>22}")
        lines.append(f"{r['d_model']:>8}" + "".join(cells))
    lines.append("ms forward+backward (peak extra MiB); ratios to the parameter-equal dense:")
    for r in records:
        ratios = ", ".join(f"{n} {v:.2f}" for n, v in r["over_dense_param"].items())
        extra = ""
        if "best_peer" in r:
            extra = (f"; best peer {r['best_peer']} / sparseffn = "
                     f"{r['best_peer_over_sparseffn']:.2f}")
        lines.append(f"  d_model {r['d_model']}: {ratios}{extra}")
    lines += [f"  d_model {r['d_model']}: {r['interrupted']} (timed rounds: {r['rounds']})"
              for r in records if "interrupted" in r]
    return "\n".join(lines + check_targets(records))


def run(d_models: list[int], tokens: int = 32768, repeats: int = 20, device: str = "cuda",
        dtype: str = "bfloat16", peers: bool = False, peers_dir: str | None = None,
        json_path: str | None = None, compile: str = "none",
        router_precision: str = "autocast", deterministic: bool = False,
        time_limit: float | None = None) -> list[dict]:
    """Time each width's contenders (see the module's docstring), print the table and return
    one record per width. ``deterministic`` times them under
    ``torch.use_deterministic_algorithms(True)``, as ``sparseffn train`` runs by default.

    Ctrl-C (or ``timeout -s INT``) stops the run and reports what was measured: the widths
    done, and the cut-short one's contenders that were ready (once σ-MoE and the
    parameter-equal dense MLP are) over its whole rounds; that record's ``interrupted``
    says what was cut short, and ``rounds`` counts the rounds of every record.
    ``time_limit`` (seconds) stops the run between two widths, before one that would likely
    end past it (:class:`InterruptibleLoop`: a width's time estimated as proportional to
    it, at the slowest rate of the widths done)."""
    check_compile_mode(compile)
    dev = torch.device(device)
    autocast_dtype = autocast_dtype_of(dtype)
    builders = {}
    if peers:
        builders = portable_peer_builders(autocast_dtype, dev)
        if dev.type != "cuda":
            print("  peers: the CUDA kernels (Csordás CVMM, ScatterMoE, Liger) skipped on "
                  f"{dev.type}")
        else:
            builders.update(peer_builders(peers_dir or os.environ.get("SPARSEFFN_PEERS_DIR",
                                                                      "../shared/peers"),
                                          autocast_dtype))
    print(f"sparseffn bench fig2: {describe_device(dev)}, {dtype}, {tokens} tokens, "
          f"expert size {EXPERT_SIZE}, k={K}, router precision {router_precision}, "
          f"compile {compile}, torch {torch.__version__}"
          + (", deterministic algorithms" if deterministic else ""), flush=True)
    records = []
    with deterministic_algorithms(deterministic, dev), compiling_many(), \
            keeping_swallowed_interrupts():
        # a width's time taken as proportional to it: σ-MoE's FLOPs are (expert size and k
        # fixed), the dense MLP's grow faster, compiling and tuning do not grow
        with InterruptibleLoop(d_models, time_limit, cost=float) as loop:
            for d_model in loop:
                print(f"d_model {d_model} ...", flush=True)
                records.append(bench_width(d_model, tokens, repeats, dev, autocast_dtype,
                                           builders, compile, router_precision))
                records[-1]["deterministic"] = deterministic
                if "interrupted" in records[-1]:    # its rounds were cut: kept, and no more
                    break
    not_timed = d_models[len(records):]     # (after an interrupt, loop.left)
    if not_timed:
        where = "before" if loop.out_of_time else "at"
        cut = f" {loop.cause} {where} d_model {loop.left[0]}:" if loop.left else ""
        print(f"bench fig2:{cut} not timed: {', '.join(map(str, not_timed))}", flush=True)
    print(format_table(records))
    if json_path:
        write_json(records, json_path)
        print(f"wrote {json_path}")
    return records
