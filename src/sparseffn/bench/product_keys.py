"""``sparseffn bench productkeys``: product-key retrieval, PKM and PEER (Csordás et al. 2023 §3.2,
He 2024 §3).

1. ``scaling``: forward time per token of product-key retrieval against naive full scoring,
   N = 2^10 … 2^20 keys, d_model 256, h = 8 heads, k = 16. Product keys cost
   O((√N + k²)·d) per query and should stay nearly flat; naive scoring is O(N·d). Odd powers
   use two sub-key tables of 2^⌊e/2⌋ and 2^⌈e/2⌉ rows. The naive side scores every head's
   query against one table of N full keys (shared by the heads to keep 8 GB of keys out of
   memory at N = 2^20; the FLOPs are those of per-head tables) on fewer tokens at large N,
   and reports time per token. The heads' sub-keys are equal copies, so both sides must
   retrieve the same keys; the agreement is printed.
2. ``peer_1m``: the PEER layer at He 2024's scale, N = 1024² experts, d_model 256, h = 8,
   k = 16, 4096 tokens, fp32: forward and forward+backward time and peak memory, with dense
   gradients and with ``sparse_grad``.
3. The reference packages at the same sizes in the same run, given the same weights (their
   outputs are compared): ``peer-pytorch`` (``peer_peer_pytorch``) and
   ``product-key-memory`` (``pkm_product_key_memory``, against our PKM with the same query
   network and query LayerNorm: ``pkm``).
4. ``peer_1m_train`` (run first): a few hundred steps of ``PEER(LayerNorm(x))`` with a
   million experts memorising 8192 random input -> target pairs (sparse gradients, SparseAdam
   on the expert tables), with the loss at the start and the end, time per step, parameter
   and optimiser-state bytes and the process's peak resident memory.

``peak_bytes`` is the peak of PyTorch's CPU allocations during one call above what was
allocated before it (parameters and inputs excluded; what the C kernels malloc themselves,
a few MB of sort offsets, is not seen); on a GPU (``--device cuda``: cases 1-3, timed with
CUDA events; the training run stays on the CPU) it is the CUDA allocator's peak.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import resource
import statistics
import time

import torch
from torch import nn

from ..config import PEERConfig, PKMConfig
from ..layers import PEER, ProductKeyMemory
from ..ops.product_keys import retrieve
from .measure import (InterruptibleLoop, cuda_peak_bytes, describe_device, forward_backward_fn,
                      forward_fn, interleaved_times, paired_ratio, peak_bytes, verdict,
                      write_json)

D_MODEL, HEADS, K = 256, 8, 16
NAIVE_SCORE_ELEMENTS = 1 << 24      # scores per chunk of naive scoring (64 MB)
NAIVE_TOKEN_ELEMENTS = 1 << 27      # tokens · heads · N scored per naive call


def _peak(fn, device: torch.device) -> int:
    """Peak bytes allocated during one call of ``fn`` (see the module docstring)."""
    return cuda_peak_bytes(fn, device) if device.type == "cuda" else peak_bytes(fn)


def _record(case: str, n_experts: int, method: str, pass_name: str, ms: float,
            peak: int | None, **extra) -> dict:
    return {"case": case, "n_experts": n_experts, "method": method, "pass": pass_name,
            "ms": ms, "peak_bytes": peak, **extra}


# --- 1. scaling ----------------------------------------------------------------------------

def _scaling_point(exponent: int, tokens: int, repeats: int,
                   device: torch.device = torch.device("cpu")) -> tuple[list[dict], str]:
    n_experts = 1 << exponent
    n_a, n_b = 1 << (exponent // 2), 1 << (exponent - exponent // 2)
    half = D_MODEL // 2
    g = torch.Generator().manual_seed(exponent)
    sub_a = (torch.randn(n_a, half, generator=g) / math.sqrt(half)).to(device)
    sub_b = (torch.randn(n_b, half, generator=g) / math.sqrt(half)).to(device)
    keys_a = sub_a.expand(HEADS, n_a, half).contiguous()
    keys_b = sub_b.expand(HEADS, n_b, half).contiguous()
    query = torch.randn(tokens, HEADS, D_MODEL, generator=g).to(device)
    naive_tokens = max(8, min(tokens, NAIVE_TOKEN_ELEMENTS // (HEADS * n_experts)))
    # Key i + n_a·j = [sub_a[i] | sub_b[j]] (Csordás et al. 2023 Eq. 15), as one [N, d] table.
    full_keys = torch.cat([sub_a.repeat(n_b, 1), sub_b.repeat_interleave(n_a, dim=0)], dim=1)
    naive_query = query[:naive_tokens].reshape(-1, D_MODEL)

    def product_keys():
        with torch.no_grad():
            return retrieve(query, keys_a, keys_b, K)[1]

    def naive():
        rows = max(1, NAIVE_SCORE_ELEMENTS // n_experts)
        out = []
        with torch.no_grad():
            for start in range(0, naive_query.shape[0], rows):
                out.append((naive_query[start:start + rows] @ full_keys.t()).topk(K).indices)
        return torch.cat(out).view(naive_tokens, HEADS, K)

    agree = (product_keys()[:naive_tokens].sort(-1).values
             == naive().sort(-1).values).all(-1).float().mean().item()
    times = interleaved_times({"product_keys": product_keys, "naive": naive}, repeats, warmup=1,
                              device=device)
    records = []
    for method, n_tok in (("product_keys", tokens), ("naive", naive_tokens)):
        ms = statistics.median(times[method])
        fn = product_keys if method == "product_keys" else naive
        records.append(_record("scaling", n_experts, method, "forward", ms, _peak(fn, device),
                               tokens=n_tok, ms_per_token=ms / n_tok,
                               subkeys=[n_a, n_b] if method == "product_keys" else None))
    note = (f"2^{exponent}: product keys and naive scoring retrieve the same {K} keys for "
            f"{100 * agree:.1f}% of (token, head) pairs")
    return records, note


def scaling(exponents: list[int], tokens: int, repeats: int,
            device: torch.device = torch.device("cpu")) -> tuple[list[dict], list[str]]:
    records, notes = [], []
    for e in exponents:
        recs, note = _scaling_point(e, tokens, repeats, device)
        records += recs
        notes.append(note)
        pk, nv = recs
        print(f"  N = 2^{e:<2d} product keys {1e3 * pk['ms_per_token']:8.2f} µs/token   naive "
              f"{1e3 * nv['ms_per_token']:10.2f} µs/token ({nv['tokens']} tokens)", flush=True)
    return records, notes


# --- 2./3. PEER and PKM side by side -------------------------------------------------------

class _Batched(nn.Module):
    """Feeds [T, d] to a module that wants [batch, seq, d]."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.unsqueeze(0)).squeeze(0)


def _their_query_rows(heads: int, half: int) -> torch.Tensor:
    """Row order that maps their query features ``(p h d)`` onto ours (head h: our a-half is
    their p = 1, our b-half their p = 0, so that their index ``x·n + y`` is our ``a + n·b``)."""
    order = []
    for h in range(heads):
        for p in (1, 0):
            start = p * heads * half + h * half
            order.extend(range(start, start + half))
    return torch.tensor(order)


@torch.no_grad()
def _copy_keys_and_query(ours, their_keys: torch.Tensor, their_query: torch.Tensor) -> None:
    heads, _, _, half = their_keys.shape
    ours.router.keys_a.copy_(their_keys[:, :, 1])
    ours.router.keys_b.copy_(their_keys[:, :, 0])
    ours.router.query.weight.copy_(their_query[_their_query_rows(heads, half)])


def _peer_pytorch(ours: PEER) -> nn.Module | None:
    if importlib.util.find_spec("PEER_pytorch") is None:
        return None
    from PEER_pytorch import PEER as TheirPEER
    cfg = ours.config
    # non_competing_scores=False: softmax over the k retrieved per head, as He 2024 (with
    # True, peer-pytorch 0.2.2 keeps a single expert per head).
    theirs = TheirPEER(dim=cfg.d_model, heads=cfg.heads, num_experts=cfg.num_experts,
                       num_experts_per_head=cfg.k, non_competing_scores=False)
    with torch.no_grad():
        _copy_keys_and_query(ours, theirs.keys, theirs.to_queries[0].weight)
        ours.store.w_in.copy_(theirs.weight_down_embed.weight)
        ours.store.w_out.copy_(theirs.weight_up_embed.weight)
    return _Batched(theirs).to(ours.store.w_out.device)


def _product_key_memory(ours: ProductKeyMemory) -> nn.Module | None:
    if importlib.util.find_spec("product_key_memory") is None:
        return None
    from product_key_memory import PKM
    cfg = ours.config
    theirs = PKM(dim=cfg.d_model, heads=cfg.heads, num_keys=cfg.num_subkeys, topk=cfg.k,
                 dim_head=cfg.key_dim // 2)
    with torch.no_grad():
        _copy_keys_and_query(ours, theirs.keys, theirs.to_queries.weight)
        ours.store.values.copy_(theirs.values.weight)
    return _Batched(theirs).to(ours.store.values.device)


def _side_by_side(case: str, their_case: str, their_name: str, ours: nn.Module,
                  theirs: nn.Module | None, extra: dict[str, nn.Module], n_experts: int,
                  x: torch.Tensor, repeats: int) -> tuple[list[dict], list[str]]:
    contenders = {"sparseffn": ours, **extra}
    if theirs is not None:
        contenders[their_name] = theirs
    fns = {}
    for name, module in contenders.items():
        fns[(name, "forward")] = forward_fn(module, x)
        fns[(name, "forward_backward")] = forward_backward_fn(module, x)
    notes = []
    if theirs is not None:
        with torch.no_grad():
            diff = (ours(x[:256]) - theirs(x[:256])).abs().max().item()
        notes.append(f"{case}: same weights, max |sparseffn - {their_name}| = {diff:.2e}")
    keyed = {f"{m}|{p}": fn for (m, p), fn in fns.items()}
    times = interleaved_times(keyed, repeats, warmup=1, device=x.device)
    records = []
    for (method, pass_name), fn in fns.items():
        ts = times[f"{method}|{pass_name}"]
        for module in contenders.values():      # no gradients left from an earlier call
            module.zero_grad(set_to_none=True)
        record = _record(their_case if method == their_name else case, n_experts, method,
                         pass_name, statistics.median(ts), _peak(fn, x.device),
                         tokens=x.shape[0], rounds_ms=ts)
        if method != "sparseffn":
            record["time_vs_sparseffn"] = paired_ratio(ts, times[f"sparseffn|{pass_name}"])
        records.append(record)
    return records, notes


def with_sparse_grad(layer: nn.Module) -> nn.Module:
    """A twin of a PKM/PEER layer that shares its parameters (no second copy of the tables)
    but gives the tables sparse gradients: its own module table and a shallow copy of the
    store with ``sparse_grad`` on."""
    twin = copy.copy(layer)
    twin._modules = dict(layer._modules)
    store = copy.copy(layer.store)
    store.sparse_grad = True
    twin._modules["store"] = store
    twin.config = layer.config.replace(sparse_grad=True)
    return twin


def peer_1m(tokens: int, repeats: int, peers: bool,
            device: torch.device = torch.device("cpu")) -> tuple[list[dict], list[str]]:
    torch.manual_seed(0)
    cfg = PEERConfig(d_model=D_MODEL, num_experts=1024 ** 2, heads=HEADS, k=K)
    ours = PEER(cfg).to(device)
    theirs = _peer_pytorch(ours) if peers else None
    sparse = with_sparse_grad(ours)   # the same parameters (no second million rows)
    x = torch.randn(tokens, D_MODEL).to(device)
    records, notes = _side_by_side("peer_1m", "peer_peer_pytorch", "peer_pytorch", ours, theirs,
                                   {"sparseffn_sparse_grad": sparse}, cfg.num_experts, x,
                                   repeats)
    if peers and theirs is None:
        notes.append("peer-pytorch is not installed: pip install 'sparseffn[peers]'")
    return records, notes


def pkm(tokens: int, repeats: int, peers: bool,
        device: torch.device = torch.device("cpu")) -> tuple[list[dict], list[str]]:
    torch.manual_seed(0)
    # product-key-memory's defaults, scaled to 512² values: 4 heads, top 32, 128-unit
    # half-queries from a linear query network, LayerNorm on each half-query, softmax.
    cfg = PKMConfig(d_model=D_MODEL, num_subkeys=512, heads=4, k=32, query="linear",
                    key_dim=256, query_norm="layernorm")
    ours = ProductKeyMemory(cfg).to(device)
    theirs = _product_key_memory(ours) if peers else None
    x = torch.randn(tokens, D_MODEL).to(device)
    records, notes = _side_by_side("pkm", "pkm_product_key_memory", "product_key_memory", ours,
                                   theirs, {}, cfg.num_values, x, repeats)
    if peers and theirs is None:
        notes.append("product-key-memory is not installed: pip install 'sparseffn[peers]'")
    return records, notes


# --- 4. training a million experts ---------------------------------------------------------

def peer_1m_train(steps: int, batch: int, pairs: int = 8192) -> tuple[list[dict], list[str]]:
    """``PEER(LayerNorm(x))`` with a million experts memorises ``pairs`` random input -> target
    pairs (unit-variance targets: a loss of about 1 at the start): the kind of large,
    sparsely-read store PEER is for. Sparse table gradients with SparseAdam (lr 1e-2), Adam
    (1e-3) for the norm, query networks and sub-keys; minibatches drawn with a fixed seed."""
    torch.manual_seed(0)
    cfg = PEERConfig(d_model=D_MODEL, num_experts=1024 ** 2, heads=HEADS, k=K, sparse_grad=True)
    norm, layer = nn.LayerNorm(D_MODEL), PEER(cfg)
    inputs, targets = torch.randn(pairs, D_MODEL), torch.randn(pairs, D_MODEL)
    dense = [*norm.parameters(), *layer.router.parameters()]
    optimizers = [torch.optim.Adam(dense, lr=1e-3),
                  torch.optim.SparseAdam(layer.sparse_grad_parameters(), lr=1e-2)]
    losses, start = [], time.perf_counter()
    for _ in range(steps):
        rows = torch.randint(0, pairs, (batch,))
        loss = nn.functional.mse_loss(layer(norm(inputs[rows])), targets[rows])
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
    ms = 1e3 * (time.perf_counter() - start) / max(1, steps)
    window = max(1, min(10, steps // 10))
    first, last = statistics.mean(losses[:window]), statistics.mean(losses[-window:])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    state = sum(t.numel() * t.element_size() for opt in optimizers
                for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    params = sum(p.numel() * p.element_size() for p in (*dense, *layer.sparse_grad_parameters()))
    record = _record("peer_1m_train", cfg.num_experts, "sparseffn_sparse_grad", "train_step", ms,
                     None, steps=steps, batch=batch, loss_first=first, loss_last=last,
                     peak_rss_bytes=rss, param_bytes=params, optimizer_state_bytes=state)
    note = (f"peer_1m_train: {steps} steps of {batch} tokens, {ms:.0f} ms/step, loss "
            f"{first:.3f} -> {last:.3f}; parameters {params / 2**30:.1f} GiB, optimiser state "
            f"{state / 2**30:.1f} GiB, process peak RSS so far {rss / 2**30:.1f} GiB")
    return [record], [note]


# --- report --------------------------------------------------------------------------------

def format_table(records: list[dict]) -> str:
    lines = [f"{'case':24s}{'N':>9s}  {'method':22s}{'pass':>17s}{'ms':>10s}{'peak MB':>10s}"
             f"{'vs ours':>9s}"]
    for r in records:
        if r["case"] == "scaling":
            continue
        peak = "" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:10.0f}"
        ratio = r.get("time_vs_sparseffn")
        lines.append(f"{r['case']:24s}{r['n_experts']:9d}  {r['method']:22s}{r['pass']:>17s}"
                     f"{r['ms']:10.1f}{peak:>10s}{'' if ratio is None else f'{ratio:8.2f}x':>9s}")
    return "\n".join(lines)


def check_targets(records: list[dict]) -> list[str]:
    """The issue's targets, from ratios measured in this run."""
    out = []
    by = {(r["case"], r["method"], r["pass"]): r for r in records}
    ours = by.get(("peer_1m", "sparseffn", "forward_backward"))
    theirs = by.get(("peer_peer_pytorch", "peer_pytorch", "forward_backward"))
    if ours and theirs:
        ratio = theirs["time_vs_sparseffn"]
        out.append(f"PEER 1M fwd+bwd: peer-pytorch / ours = {ratio:.2f}x (target >= 1.5): "
                   f"{verdict(ratio >= 1.5)}; peak {ours['peak_bytes'] / 2**20:.0f} "
                   f"MB vs {theirs['peak_bytes'] / 2**20:.0f} MB (target lower): "
                   f"{verdict(ours['peak_bytes'] < theirs['peak_bytes'])}")
    for pass_name in ("forward", "forward_backward"):
        theirs = by.get(("pkm_product_key_memory", "product_key_memory", pass_name))
        if theirs:
            ratio = theirs["time_vs_sparseffn"]
            out.append(f"PKM {pass_name}: product-key-memory / ours = {ratio:.2f}x (target >= 1): "
                       f"{verdict(ratio >= 1)}")
    scaling = sorted((r for r in records if r["case"] == "scaling"), key=lambda r: r["n_experts"])
    for method in ("product_keys", "naive"):
        series = [r for r in scaling if r["method"] == method]
        if len(series) >= 2:
            lo, hi = series[0], series[-1]
            out.append(f"scaling, {method}: time per token grows {hi['ms_per_token'] / lo['ms_per_token']:.1f}x "
                       f"from N = {lo['n_experts']} to {hi['n_experts']} "
                       f"({hi['n_experts'] // lo['n_experts']}x the keys)")
    train = by.get(("peer_1m_train", "sparseffn_sparse_grad", "train_step"))
    if train:
        ok = train["loss_last"] < 0.5 * train["loss_first"]
        out.append(f"PEER 1M trains {train['steps']} steps: loss {train['loss_first']:.3f} -> "
                   f"{train['loss_last']:.3f}: {verdict(ok)}")
    return out


def plot(records: list[dict], path: str) -> None:
    from .plotting import pyplot
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for method, label in (("product_keys", "product keys"), ("naive", "naive full scoring")):
        series = sorted((r for r in records if r["case"] == "scaling" and r["method"] == method),
                        key=lambda r: r["n_experts"])
        ax.plot([r["n_experts"] for r in series], [1e3 * r["ms_per_token"] for r in series],
                marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("keys N")
    ax.set_ylabel("µs per token (h = 8, k = 16, d = 256)")
    ax.set_title("Retrieval: product keys vs naive scoring")
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(exponents: list[int], tokens: int = 4096, scaling_tokens: int = 1024, repeats: int = 3,
        peers: bool = True, train_steps: int = 300, train_batch: int = 512,
        cases: tuple[str, ...] = ("scaling", "peer_1m", "pkm", "train"),
        json_path: str | None = None, plot_path: str | None = None,
        device: str = "cpu") -> list[dict]:
    """Run the chosen ``cases`` in turn (training first), print the table, notes and
    targets, and write the JSON (after each case) and the plot if asked. Ctrl-C (or
    ``timeout -s INT``) after the first case reports the cases done and names the others."""
    dev = torch.device(device)
    print(f"sparseffn bench productkeys: d_model {D_MODEL}, fp32, {describe_device(dev)}",
          flush=True)
    records, notes = [], []
    # Training first, so that the process's peak RSS it reports is its own.
    steps = [("train", lambda: peer_1m_train(train_steps, train_batch)),
             ("scaling", lambda: scaling(exponents, scaling_tokens, repeats, dev)),
             ("peer_1m", lambda: peer_1m(tokens, repeats, peers, dev)),
             ("pkm", lambda: pkm(tokens, repeats, peers, dev))]
    chosen = [(name, step) for name, step in steps
              if name in cases and not (name == "train" and train_steps <= 0)]
    with InterruptibleLoop(chosen) as loop:
        for name, step in loop:
            print(f"{name} ...", flush=True)
            recs, msgs = step()
            # what each record ran on: the training run stays on the CPU, the rest on ``device``
            records += [{**r, "device": "cpu" if name == "train" else str(dev),
                         "dtype": "float32"} for r in recs]
            notes += msgs
            if json_path:                   # what is measured is never lost to a later failure
                write_json(records, json_path)
    if loop.left:
        print(f"bench productkeys: interrupted: not run: "
              f"{', '.join(name for name, _ in loop.left)}", flush=True)
    print(format_table(records))
    for line in notes + check_targets(records):
        print(line)
    if json_path:
        print(f"wrote {json_path}")
    if plot_path and any(r["case"] == "scaling" for r in records):
        plot(records, plot_path)
        print(f"wrote {plot_path}")
    return records
