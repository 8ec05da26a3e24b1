"""``sparseffn bench fff``: the FastFeedForward layer in its modes, and with ``--peers`` the
authors' ``fastfeedforward`` package (0.2.1) at the same sizes and with the same weights.

Rows per depth: ours soft (training forward, every leaf), ours sparse top-1 (training through
CVMM), ours hard (inference); their ``training_forward`` and their ``eval_forward`` (a Python
loop over tokens). With the same weights (their node weights negated: their σ(z) goes to the
right child) the soft outputs agree; their ``eval_forward`` leaves out the leaf output bias
b2, so its outputs differ from their own training forward's and from our hard inference by
exactly ``b2[leaf]``.
"""

from __future__ import annotations

import statistics

import torch

from ..config import FFFConfig
from ..layers import FastFeedForward
from .measure import forward_backward_fn, forward_fn, interleaved_times, write_json


def _their_fff(ours: FastFeedForward):
    """fastfeedforward.FFF holding our layer's weights, or None when it is not installed."""
    try:
        from fastfeedforward import FFF
    except ImportError:
        return None
    cfg = ours.config
    theirs = FFF(input_width=cfg.d_model, leaf_width=cfg.leaf_width,
                 output_width=cfg.output_width, depth=cfg.depth)
    with torch.no_grad():
        theirs.node_weights.copy_(-ours.router.weight)
        theirs.node_biases.copy_(-ours.router.bias[:, None])
        theirs.w1s.copy_(ours.store.w1.transpose(1, 2))
        theirs.b1s.copy_(ours.store.b1)
        theirs.w2s.copy_(ours.store.w2)
        theirs.b2s.copy_(ours.store.b2)
    return theirs


def _eval_fn(module, x):
    def run():
        module.eval()
        with torch.no_grad():
            return module(x)
    return run


def _train_fn(module, x, backward: bool):
    fn = forward_backward_fn(module, x) if backward else forward_fn(module, x)

    def run():
        module.train()
        return fn()
    return run


def bench_depth(depth: int, batch: int, d_model: int, leaf_width: int, repeats: int,
                peers: bool) -> tuple[list[dict], list[str]]:
    torch.manual_seed(depth)
    x = torch.randn(batch, d_model)
    soft = FastFeedForward(FFFConfig(d_model=d_model, depth=depth, leaf_width=leaf_width,
                                     eval_mode="hard"))
    sparse = FastFeedForward(soft.config.replace(train_mode="sparse", k=1, eval_mode=None))
    fns = {("ours_soft", "forward"): _train_fn(soft, x, False),
           ("ours_soft", "forward_backward"): _train_fn(soft, x, True),
           ("ours_sparse_k1", "forward_backward"): _train_fn(sparse, x, True),
           ("ours_hard", "forward"): _eval_fn(soft, x)}
    notes = []
    theirs = _their_fff(soft) if peers else None
    if peers and theirs is None:
        notes.append("fastfeedforward is not installed: pip install 'sparseffn[peers]'")
    if theirs is not None:
        fns[("fastfeedforward_train", "forward")] = _train_fn(theirs, x, False)
        fns[("fastfeedforward_train", "forward_backward")] = _train_fn(theirs, x, True)
        fns[("fastfeedforward_eval", "forward")] = _eval_fn(theirs, x)
        with torch.no_grad():
            soft.train(), theirs.train()
            soft_diff = (soft(x) - theirs(x)).abs().max().item()
            soft.eval(), theirs.eval()
            hard, their_eval = soft(x), theirs(x)
            leaves = soft.router.hard_leaves(x)
            notes.append(f"depth {depth}: same weights, max |ours soft - their training_forward| "
                         f"= {soft_diff:.2e}; max |ours hard - their eval_forward| = "
                         f"{(hard - their_eval).abs().max().item():.2e}, and "
                         f"{(hard - their_eval - soft.store.b2[leaves]).abs().max().item():.2e} once "
                         f"their missing leaf bias b2 is added")
    keyed = {f"{m}|{p}": fn for (m, p), fn in fns.items()}
    times = interleaved_times(keyed, repeats, warmup=1)
    records = []
    for key, ts in times.items():
        method, pass_name = key.split("|")
        records.append({"case": "fff_layer", "method": method, "pass": pass_name,
                        "depth": depth, "batch": batch, "d_model": d_model,
                        "leaf_width": leaf_width, "ms": statistics.median(ts)})
    return records, notes


def format_table(records: list[dict]) -> str:
    lines = [f"{'depth':>5s}  {'method':24s}{'pass':>18s}{'ms':>11s}{'vs ours':>10s}"]
    ms = {(r["depth"], r["method"], r["pass"]): r["ms"] for r in records}
    ours_of = {"fastfeedforward_train": "ours_soft", "fastfeedforward_eval": "ours_hard"}
    for r in records:
        ref = ours_of.get(r["method"])
        ratio = ms.get((r["depth"], ref, r["pass"])) if ref else None
        cell = f"{r['ms'] / ratio:9.2f}x" if ratio else ""
        lines.append(f"{r['depth']:5d}  {r['method']:24s}{r['pass']:>18s}{r['ms']:11.2f}{cell:>10s}")
    return "\n".join(lines)


def run(depths: list[int], batch: int = 2048, d_model: int = 256, leaf_width: int = 16,
        repeats: int = 5, peers: bool = False, json_path: str | None = None) -> list[dict]:
    print(f"sparseffn bench fff: batch {batch}, d_model {d_model}, leaf_width {leaf_width}, "
          f"fp32, {torch.get_num_threads()} threads", flush=True)
    records, notes = [], []
    for depth in depths:
        recs, msgs = bench_depth(depth, batch, d_model, leaf_width, repeats, peers)
        records += recs
        notes += msgs
        print(f"depth {depth} done", flush=True)
    print(format_table(records))
    for note in notes:
        print(note)
    if json_path:
        write_json(records, json_path)
        print(f"wrote {json_path}")
    return records
