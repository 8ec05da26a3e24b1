"""The comparison report: a Markdown table, the results as JSON, and PNG plots of the
validation loss against steps and against training time."""

from __future__ import annotations

import json
from pathlib import Path


def _layer_name(model: dict) -> str:
    ffn = model.get("ffn") or model.get("layer") or {}
    name = ffn.get("type", "?")
    if name == "moe":
        router = ffn.get("router", {}).get("type", "")
        name = f"moe/{router}"
    if model.get("sparse_every", 1) > 1:
        name += f" every {model['sparse_every']}"
    return name


def _columns(summaries: list[dict]) -> tuple[list[str], list[list[str]]]:
    text = "bpc" in summaries[0]["val"]
    header = ["variant", "FFN", "params", "FFN params", "active params/token", "FLOPs/token",
              "val loss", "val bpc" if text else "val accuracy",
              "tokens/s" if text else "examples/s", "train time", "peak RSS"]
    rows = []
    for s in summaries:
        metric = f"{s['val']['bpc']:.3f}" if text else f"{s['val']['accuracy']:.4f}"
        rows.append([s["name"], _layer_name(s["model"]), f"{s['total_params']:,}",
                     f"{s['ffn_params']:,}", f"{s['active_params']:,}",
                     f"{s['flops_per_token']:,}", f"{s['val']['loss']:.4f}", metric,
                     f"{s['items_per_s']:,.0f}", f"{s['train_time_s']:.0f} s",
                     f"{s['peak_rss_mb']:,.0f} MB"])
    return header, rows


def markdown_table(summaries: list[dict]) -> str:
    header, rows = _columns(summaries)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(summaries: list[dict]) -> str:
    header, rows = _columns(summaries)
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    def fmt(row):
        return "  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths)))
    return "\n".join([fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def _plots(results: list[dict], out: Path) -> list[str]:
    from ..bench.plotting import MissingDependency, pyplot
    try:
        plt = pyplot()
    except MissingDependency as err:
        return [f"(no plots: {err})"]
    written = []
    for x_key, x_label, filename in (("step", "step", "val_loss_vs_step.png"),
                                     ("train_time", "training time (s)", "val_loss_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for result in results:
            evals = result["evals"]
            ax.plot([e[x_key] for e in evals], [e["loss"] for e in evals], marker="o",
                    markersize=3, label=result["summary"]["name"])
        ax.set_xlabel(x_label)
        ax.set_ylabel("validation loss (nats)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / filename, dpi=110)
        plt.close(fig)
        written.append(filename)
    return written


def _ffn_type(summary: dict) -> str:
    model = summary["model"]
    return (model.get("ffn") or model.get("layer") or {}).get("type", "?")


def _metric(summary: dict) -> tuple[float, str, int]:
    """The headline metric, its unit and the sign that makes "better" positive."""
    val = summary["val"]
    return (val["bpc"], "bpc", -1) if "bpc" in val else (val["accuracy"], "accuracy", 1)


def _closest(candidates: list[dict], key: str, target: float, tolerance: float):
    """The candidate whose ``key`` is nearest to ``target``, if within ``tolerance`` of it."""
    best = min(candidates, key=lambda c: abs(c[key] - target), default=None)
    if best is None or abs(best[key] - target) > tolerance * target:
        return None
    return best


def _sweep_rate(name: str) -> str:
    """The ``@lr`` suffix of a sweep's variant name ('' outside a sweep)."""
    return name.rpartition("@")[2] if "@" in name else ""


def findings(summaries: list[dict], tolerance: float = 0.05) -> list[str]:
    """What the table says, in words: each sparse variant against the dense variant with the
    same total parameters and the one with the same active parameters per token (each within
    ``tolerance``, at the same learning rate in a sweep), with its throughput relative to the
    equal-parameter dense model."""
    lines = []
    for s in summaries:
        if _ffn_type(s) == "dense":
            continue
        dense = [d for d in summaries if _ffn_type(d) == "dense"
                 and _sweep_rate(d["name"]) == _sweep_rate(s["name"])]
        value, unit, sign = _metric(s)
        equal_params = _closest(dense, "total_params", s["total_params"], tolerance)
        equal_compute = _closest(dense, "active_params", s["active_params"], tolerance)
        if equal_compute is equal_params:   # a layer that reads all it has: one baseline
            equal_compute = None
        parts = []
        for match, what in ((equal_params, "the same parameters"),
                            (equal_compute, "the same active parameters per token")):
            if match is None:
                continue
            other = _metric(match)[0]
            verdict = "better" if sign * (value - other) > 0 else "worse" if value != other \
                else "equal"
            parts.append(f"{verdict} than the dense model with {what} (`{match['name']}`, "
                         f"{other:.3f}; {value - other:+.3f})")
        speed = "" if equal_params is None else (
            f"; it trained at {s['items_per_s'] / equal_params['items_per_s']:.2f}× that "
            f"model's throughput")
        if parts:
            lines.append(f"- `{s['name']}` ({value:.3f} {unit}): " + ", and ".join(parts)
                         + speed + ".")
    return lines


def lr_sweep_lines(summaries: list[dict]) -> list[str]:
    """For variants named ``name@lr`` (a sweep): each name's metric at every rate and the
    best rate."""
    groups: dict[str, dict[str, dict]] = {}
    for s in summaries:
        name, sep, lr = s["name"].rpartition("@")
        if sep:
            groups.setdefault(name, {})[lr] = s
    if not groups:
        return []
    rates = sorted({lr for g in groups.values() for lr in g}, key=float)
    unit = _metric(summaries[0])[1]
    lines = ["## Best learning rate per variant", "",
             "| variant | " + " | ".join(f"lr {r}" for r in rates) + " | best |",
             "|---|" + "---|" * (len(rates) + 1)]
    for name, runs in groups.items():
        sign = _metric(next(iter(runs.values())))[2]
        best = max(runs, key=lambda r: sign * _metric(runs[r])[0])
        cells = [f"**{_metric(runs[r])[0]:.3f}**" if r == best else
                 (f"{_metric(runs[r])[0]:.3f}" if r in runs else "") for r in rates]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {best} |")
    return lines + ["", f"Validation {unit} at the end of training; bold: the best rate.", ""]


def write_report(results: list[dict], out: Path, title: str,
                 extra_sections: list[str] | None = None) -> dict:
    summaries = [r["summary"] for r in results]
    plots = _plots(results, out)
    lines = [f"# {title}", ""]
    first = summaries[0]
    if "unigram_bits" in first:
        lines += [f"Corpus `{first['corpus']}`: unigram entropy of the training bytes "
                  f"{first['unigram_bits']:.3f} bits per byte (what byte frequencies alone give).",
                  ""]
    lines += [markdown_table(summaries), "",
              "params: all parameters; active params/token: those one token reads (embedding "
              "row, attention, every FFN's selected part, the output layer); FLOPs/token: "
              "forward matrix products (attention at the full context); val: the whole "
              "validation split at the end; bpc: bits per byte of text; tokens/s: training "
              "throughput, evaluation excluded; peak RSS: the variant's process.", ""]
    said = findings(summaries)
    if said:
        lines += ["## What the table shows", "", *said, "",
                  "One seed per variant: the spread between seeds was not measured here, so small "
                  "differences may not survive another seed. Throughput is this machine's, "
                  "in this run; the variants ran one after another.", ""]
    lines += lr_sweep_lines(summaries)
    for name in plots:
        lines.append(f"![{name}]({name})" if name.endswith(".png") else name)
    lines.append("")
    lines += extra_sections or []
    (out / "report.md").write_text("\n".join(lines) + "\n")
    payload = {"title": title, "variants": summaries}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    return payload
