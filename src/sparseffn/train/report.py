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


def write_report(results: list[dict], out: Path, title: str) -> dict:
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
    for name in plots:
        lines.append(f"![{name}]({name})" if name.endswith(".png") else name)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    payload = {"title": title, "variants": summaries}
    (out / "results.json").write_text(json.dumps(payload, indent=2))
    return payload
