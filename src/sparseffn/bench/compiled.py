"""``sparseffn bench compile``: every layer under ``torch.compile``.

For each layer (the MoE layer with every router, FFF, PKM, PEER, the top-K and dense MLPs):
the number of graphs and graph breaks ``torch._dynamo.explain`` finds, whether
``fullgraph=True`` compiles, and the forward+backward time compiled and eager, timed in
rotation in one run (the ratio is what to read; the machine's drift cancels in it), and how
many operators one eager forward+backward dispatches (all of them, and those that compute: see
:mod:`.op_count`) and how many MiB the computing ones read and write at their boundaries (a
device-independent proxy for the memory traffic of a step; ``--bf16`` for the autocast
step's). On CUDA it also says whether a forward+backward makes any host
synchronisation (``torch.cuda.set_sync_debug_mode("error")``).
"""

from __future__ import annotations

import statistics
import warnings
from typing import Callable

import torch

from ..auxiliary import aux_loss
from ..config import (DenseMLPConfig, FFFConfig, MoEConfig, PEERConfig, PKMConfig,
                      TopKMLPConfig)
from ..router_config import (GShardRouterConfig, NoisyTopKRouterConfig, SBaseRouterConfig,
                             SigmaRouterConfig, SoftmaxRouterConfig, SwitchRouterConfig,
                             TreeRouterConfig)
from .measure import (InterruptibleLoop, error_summary, forward_backward_fn, host_sync_in,
                      interleaved_times, paired_ratio, raise_if_interrupted, write_json)
from .op_count import count_ops


def layer_configs(d_model: int) -> dict[str, object]:
    """The layers timed, at width ``d_model``: MoE layers of 16 experts of 128 units (k = 4;
    Switch k = 1, GShard k = 2), an FFF of depth 4, PKM and PEER with 4 heads."""
    def moe(router, k=4):
        return MoEConfig(d_model=d_model, num_experts=16, expert_size=128, k=k, router=router)
    return {
        "sigma_moe": moe(SigmaRouterConfig()),
        "softmax": moe(SoftmaxRouterConfig()),
        "noisy_topk": moe(NoisyTopKRouterConfig()),
        "sbase": moe(SBaseRouterConfig()),
        "tree": moe(TreeRouterConfig()),
        "switch": moe(SwitchRouterConfig(), k=1),
        "gshard": moe(GShardRouterConfig(), k=2),
        "fff_soft": FFFConfig(d_model=d_model, depth=4, leaf_width=128),
        "fff_sparse": FFFConfig(d_model=d_model, depth=4, leaf_width=128, train_mode="sparse",
                                k=2),
        "pkm": PKMConfig(d_model=d_model, num_subkeys=64, heads=4, k=16, query="linear",
                         key_dim=64),
        "peer": PEERConfig(d_model=d_model, num_experts=64 * 64, heads=4, k=16, key_dim=64),
        "topk_mlp": TopKMLPConfig(d_model=d_model, d_ff=2048, k=128),
        "dense": DenseMLPConfig(d_model=d_model, d_ff=2048),
    }


# the layers' names, for the command line (the configs themselves depend on d_model)
LAYER_NAMES = tuple(layer_configs(256))


def _host_syncs(step: Callable[[], object], device: torch.device) -> str:
    """"none", or where and what the first synchronising call was (:func:`host_sync_in`)."""
    if device.type != "cuda":
        return "n/a"
    return host_sync_in(step, device) or "none"


def run(tokens: int = 4096, d_model: int = 256, repeats: int = 5, device: str = "cpu",
        bf16: bool = False, names: list[str] | None = None, json_path: str | None = None
        ) -> list[dict]:
    """Each layer of :func:`layer_configs`, eager and compiled (``fullgraph=True``): graphs and
    breaks, host syncs, operators per eager step, time; one row printed per layer as it is
    measured, the records written to ``json_path``. Ctrl-C (or ``timeout -s INT``) after the
    first layer writes the layers measured and names the others."""
    dev = torch.device(device)
    autocast_dtype = torch.bfloat16 if bf16 else None
    configs = layer_configs(d_model)
    names = names or list(configs)
    print(f"sparseffn bench compile: {tokens} tokens, d_model {d_model}, {device}, "
          f"{'bf16 autocast' if bf16 else 'fp32'}, torch {torch.__version__}")
    header = (f"{'layer':12s} {'graphs':>6s} {'breaks':>6s} {'fullgraph':>9s} "
              f"{'eager ms':>9s} {'compiled ms':>11s} {'compiled/eager':>14s} {'ops':>5s} "
              f"{'compute':>7s} {'MiB moved':>9s}  host syncs")
    print(header)
    records = []
    try:
        with InterruptibleLoop(names) as loop:
            for name in loop:
                records.append(_measure_layer(name, configs[name], tokens, repeats, dev,
                                              autocast_dtype))
    finally:
        torch._dynamo.reset()
    if loop.left:
        print(f"bench compile: interrupted: not measured: {', '.join(loop.left)}", flush=True)
    if json_path:
        write_json(records, json_path)
    return records


def _measure_layer(name: str, config, tokens: int, repeats: int, dev: torch.device,
                   autocast_dtype: torch.dtype | None) -> dict:
    """One layer's record (see :func:`run`), its row printed."""
    from .. import build_layer
    torch.manual_seed(0)
    layer = build_layer(config).to(dev).train()
    x = torch.randn(tokens, config.d_model, device=dev)
    eager = forward_backward_fn(layer, x, aux_loss, autocast_dtype)
    syncs = _host_syncs(eager, dev)
    ops = count_ops(eager)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        explained = torch._dynamo.explain(layer)(x)
    torch._dynamo.reset()
    compiled_layer = torch.compile(layer, fullgraph=True)
    try:
        compiled = forward_backward_fn(compiled_layer, x, aux_loss, autocast_dtype)
        compiled()
        fullgraph = "yes"
    except Exception as error:   # reported, not fatal: the table says which layer failed
        raise_if_interrupted(error)   # (2.9's Dynamo turns a Ctrl-C into an error)
        fullgraph = "no"
        print(f"  {name}: fullgraph compile failed: {error_summary(error)}")
    times = interleaved_times({"eager": eager} | (
        {"compiled": compiled} if fullgraph == "yes" else {}), repeats, device=dev)
    eager_ms = statistics.median(times["eager"])
    compiled_ms = statistics.median(times["compiled"]) if "compiled" in times else None
    ratio = paired_ratio(times["compiled"], times["eager"]) if compiled_ms else None
    print(f"{name:12s} {explained.graph_count:6d} {explained.graph_break_count:6d} "
          f"{fullgraph:>9s} {eager_ms:9.2f} "
          f"{'-' if compiled_ms is None else f'{compiled_ms:.2f}':>11s} "
          f"{'-' if ratio is None else f'{ratio:.2f}':>14s} {ops.total:5d} "
          f"{ops.compute:7d} {ops.moved_bytes / 2**20:9.1f}  {syncs}", flush=True)
    torch._dynamo.reset()
    return {"layer": name, "tokens": tokens, "d_model": config.d_model, "device": str(dev),
            "bf16": autocast_dtype is not None, "graphs": explained.graph_count,
            "graph_breaks": explained.graph_break_count, "fullgraph": fullgraph == "yes",
            "eager_ms": eager_ms, "compiled_ms": compiled_ms, "compiled_over_eager": ratio,
            "eager_ops": ops.total, "eager_compute_ops": ops.compute,
            "eager_moved_bytes": ops.moved_bytes, "host_syncs": syncs}
