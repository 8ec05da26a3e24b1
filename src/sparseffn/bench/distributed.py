"""``sparseffn bench distributed``: one expert-parallel σ-MoE layer on 1, 2 and 4 processes
(gloo on this machine) at a fixed global batch: step time, tokens per second and the share of
each step spent in the all-to-all exchanges. On a few CPU cores there is no speed-up to expect
(the processes share the cores); what it measures is the exchange's share. docs/distributed.md
turns the bytes and FLOPs per token into the same share for GPUs and their interconnects.

``compile="default"`` times the step (forward, loss and backward) under ``torch.compile``:
the fixed exchange then runs inside the graph, where its all-to-alls cannot be timed alone
(``all_to_all_ms`` is None); the exchange of sizes still runs eagerly between graphs.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

from .measure import InterruptibleLoop, write_json


def _timed_exchanges(totals: list[float]):
    """Wrap the expert exchange so that every all-to-all (forward and backward) adds its
    seconds to ``totals[0]``."""
    from ..distributed import exchange as module
    original = module._all_to_all_single

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[0] += time.perf_counter() - start
    module._all_to_all_single = timed


def _rank(rank: int, world: int, init_file: str, out_dir: str, settings: dict) -> None:
    import torch.distributed as dist

    from ..layers import MoE, MoEConfig
    from ..distributed import FixedExchange, shard_experts, sync_gradients
    from ..runtime import compiled
    torch.set_num_threads(max(1, settings["threads"] // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    tokens = settings["tokens"] // world
    factor = settings["capacity_factor"]
    exchanges = ["sized", "fixed"] if world > 1 and factor else ["sized" if world > 1 else "none"]
    layers, steps = {}, {}
    for exchange in exchanges:    # the same weights each
        torch.manual_seed(0)
        layer = MoE(MoEConfig(d_model=settings["d_model"], num_experts=settings["num_experts"],
                              expert_size=settings["expert_size"], k=settings["k"]))
        if world > 1:
            shard_experts(layer, fixed_exchange=FixedExchange(tokens, factor)
                          if exchange == "fixed" else None)
        layers[exchange] = layer
        steps[exchange] = compiled(lambda x, layer=layer: layer(x).square().mean(),
                                   settings["compile"])
    x = torch.randn(tokens, settings["d_model"],
                    generator=torch.Generator().manual_seed(rank)).requires_grad_()
    spent = [0.0]
    if settings["compile"] == "none":   # a compiled fixed exchange has no Python to time
        _timed_exchanges(spent)
    results = {exchange: {"steps": [], "exchanges": [], "dropped": []} for exchange in layers}
    for repeat in range(settings["warmup"] + settings["repeats"]):
        for exchange, layer in layers.items():     # interleaved rounds
            dist.barrier()
            spent[0] = 0.0
            start = time.perf_counter()
            steps[exchange](x).backward()
            if world > 1:
                sync_gradients(layer)
            elapsed = time.perf_counter() - start
            layer.zero_grad(set_to_none=True)
            x.grad = None
            if repeat >= settings["warmup"]:
                result = results[exchange]
                result["steps"].append(elapsed)
                result["exchanges"].append(spent[0])
                dropped = layer.routing_stats.get("exchange_dropped_fraction")
                result["dropped"].append(0.0 if dropped is None else float(dropped))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump(results, file)
    dist.barrier()
    os._exit(0)        # gloo's teardown can abort a finished process (tests/layers notes)


def spawn_ranks(fn, world: int, args: tuple) -> None:
    """Run ``fn(rank, *args)`` in ``world`` spawned processes and wait for them all. A
    KeyboardInterrupt or an error while waiting terminates the ranks still running, so that a
    benchmark stopped by Ctrl-C (or ``timeout -s INT``) leaves none behind: the ranks are not
    daemons, and the interpreter would wait for them at its exit."""
    import torch.multiprocessing as mp
    context = mp.spawn(fn, args=args, nprocs=world, join=False)
    try:
        while not context.join():
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
            process.join()


def run(processes: tuple[int, ...] = (1, 2, 4), tokens: int = 8192, d_model: int = 256,
        num_experts: int = 16, expert_size: int = 128, k: int = 4, repeats: int = 5,
        warmup: int = 2, capacity_factor: float | None = None, compile: str = "none",
        json_path: str | None = None) -> list[dict]:
    """``capacity_factor``: on several processes, also the fixed-size exchange
    (:class:`~sparseffn.distributed.FixedExchange`, blocks sized for each process's tokens),
    timed in the same processes as the exchange of sizes read on the host, in alternate
    steps. ``compile``: ``"none"`` or ``"default"`` (each step under ``torch.compile``; the
    warm-up steps compile). Ctrl-C (or ``timeout -s INT``) after the first process count keeps
    the counts measured: the rows printed and the JSON written, and a line names the others
    (their ranks are terminated)."""
    settings = {"tokens": tokens, "d_model": d_model, "num_experts": num_experts,
                "expert_size": expert_size, "k": k, "repeats": repeats, "warmup": warmup,
                "threads": torch.get_num_threads(), "capacity_factor": capacity_factor,
                "compile": compile}
    print(f"expert-parallel MoE layer, forward+backward: {tokens} tokens in all, d_model "
          f"{d_model}, {num_experts} experts of {expert_size}, k = {k}; gloo, "
          f"{settings['threads']} threads shared by the processes; compile: {compile}")
    print(f"{'processes':>9} {'exchange':>9} {'step ms':>8} {'tokens/s':>10} "
          f"{'all-to-all ms':>14} {'all-to-all share':>17} {'dropped':>8}")
    for world in processes:
        if num_experts % world:
            print(f"{world:>9}  skipped: {num_experts} experts do not split over {world}")
    records = []
    with InterruptibleLoop(w for w in processes if num_experts % w == 0) as loop:
        for world in loop:
            records += _bench_world(world, settings)
    if loop.left:
        print(f"bench distributed: interrupted: not timed: processes "
              f"{', '.join(map(str, loop.left))}", flush=True)
    if json_path:
        write_json(records, json_path)
    return records


def _bench_world(world: int, settings: dict) -> list[dict]:
    """The records of one process count (one per exchange), their rows printed."""
    with tempfile.TemporaryDirectory() as tmp:
        spawn_ranks(_rank, world, (world, os.path.join(tmp, "init"), tmp, settings))
        ranks = []
        for r in range(world):
            with open(os.path.join(tmp, f"rank{r}.json")) as file:
                ranks.append(json.load(file))
    repeats, compile = settings["repeats"], settings["compile"]
    records = []
    for exchange in ranks[0]:
        # a step lasts as long as its slowest rank
        steps = [max(r[exchange]["steps"][i] for r in ranks) for i in range(repeats)]
        spent = [max(r[exchange]["exchanges"][i] for r in ranks) for i in range(repeats)]
        dropped = statistics.mean(d for r in ranks for d in r[exchange]["dropped"])
        step_ms = statistics.median(steps) * 1e3
        # compiled, the exchanges run inside the graphs, untimed (the sized one's too:
        # its timer is not installed)
        exchange_ms = statistics.median(spent) * 1e3 if compile == "none" else None
        record = {"processes": world, "exchange": exchange, "tokens": settings["tokens"],
                  "d_model": settings["d_model"], "num_experts": settings["num_experts"],
                  "expert_size": settings["expert_size"], "k": settings["k"],
                  "capacity_factor": settings["capacity_factor"] if exchange == "fixed"
                  else None, "compile": compile,
                  "step_ms": step_ms, "tokens_per_s": settings["tokens"] / (step_ms / 1e3),
                  "all_to_all_ms": exchange_ms,
                  "all_to_all_share": None if exchange_ms is None else
                  exchange_ms / step_ms if step_ms else 0.0,
                  "dropped_fraction": dropped}
        records.append(record)
        timed = ("-", "-") if exchange_ms is None else \
            (f"{exchange_ms:.1f}", f"{record['all_to_all_share']:.1%}")
        print(f"{world:>9} {exchange:>9} {step_ms:>8.1f} {record['tokens_per_s']:>10.0f} "
              f"{timed[0]:>14} {timed[1]:>17} {dropped:>8.2%}", flush=True)
    return records
