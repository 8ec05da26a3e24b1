"""``sparseffn bench distributed``: one expert-parallel σ-MoE layer on 1, 2 and 4 processes
(gloo on this machine) at a fixed global batch: step time, tokens per second and the share of
each step spent in the all-to-all exchanges. On a few CPU cores there is no speed-up to expect
(the processes share the cores); what it measures is the exchange's share. docs/distributed.md
turns the bytes and FLOPs per token into the same share for GPUs and their interconnects.
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch

from .measure import write_json


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
    from ..distributed import shard_experts, sync_gradients
    torch.set_num_threads(max(1, settings["threads"] // world))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    layer = MoE(MoEConfig(d_model=settings["d_model"], num_experts=settings["num_experts"],
                          expert_size=settings["expert_size"], k=settings["k"]))
    if world > 1:
        shard_experts(layer)
    tokens = settings["tokens"] // world
    x = torch.randn(tokens, settings["d_model"],
                    generator=torch.Generator().manual_seed(rank)).requires_grad_()
    exchange = [0.0]
    _timed_exchanges(exchange)
    steps, exchanges = [], []
    for repeat in range(settings["warmup"] + settings["repeats"]):
        dist.barrier()
        exchange[0] = 0.0
        start = time.perf_counter()
        layer(x).square().mean().backward()
        if world > 1:
            sync_gradients(layer)
        elapsed = time.perf_counter() - start
        layer.zero_grad(set_to_none=True)
        x.grad = None
        if repeat >= settings["warmup"]:
            steps.append(elapsed)
            exchanges.append(exchange[0])
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as file:
        json.dump({"steps": steps, "exchanges": exchanges}, file)
    dist.barrier()
    os._exit(0)        # gloo's teardown can abort a finished process (tests/layers notes)


def run(processes: tuple[int, ...] = (1, 2, 4), tokens: int = 8192, d_model: int = 256,
        num_experts: int = 16, expert_size: int = 128, k: int = 4, repeats: int = 5,
        warmup: int = 2, json_path: str | None = None) -> list[dict]:
    import torch.multiprocessing as mp
    settings = {"tokens": tokens, "d_model": d_model, "num_experts": num_experts,
                "expert_size": expert_size, "k": k, "repeats": repeats, "warmup": warmup,
                "threads": torch.get_num_threads()}
    print(f"expert-parallel σ-MoE layer, forward+backward: {tokens} tokens in all, d_model "
          f"{d_model}, {num_experts} experts of {expert_size}, k = {k}; gloo, "
          f"{settings['threads']} threads shared by the processes")
    print(f"{'processes':>9} {'step ms':>8} {'tokens/s':>10} {'all-to-all ms':>14} "
          f"{'all-to-all share':>17}")
    records = []
    for world in processes:
        if num_experts % world:
            print(f"{world:>9}  skipped: {num_experts} experts do not split over {world}")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_rank, args=(world, os.path.join(tmp, "init"), tmp, settings),
                     nprocs=world, join=True)
            ranks = []
            for r in range(world):
                with open(os.path.join(tmp, f"rank{r}.json")) as file:
                    ranks.append(json.load(file))
        # a step lasts as long as its slowest rank
        steps = [max(r["steps"][i] for r in ranks) for i in range(repeats)]
        exchanges = [max(r["exchanges"][i] for r in ranks) for i in range(repeats)]
        step_ms = statistics.median(steps) * 1e3
        exchange_ms = statistics.median(exchanges) * 1e3
        record = {"processes": world, "tokens": tokens, "d_model": d_model,
                  "num_experts": num_experts, "expert_size": expert_size, "k": k,
                  "step_ms": step_ms, "tokens_per_s": tokens / (step_ms / 1e3),
                  "all_to_all_ms": exchange_ms,
                  "all_to_all_share": exchange_ms / step_ms if step_ms else 0.0}
        records.append(record)
        print(f"{world:>9} {step_ms:>8.1f} {record['tokens_per_s']:>10.0f} {exchange_ms:>14.1f} "
              f"{record['all_to_all_share']:>16.1%}")
    if json_path:
        write_json(records, json_path)
    return records
