"""Analyse a model on some inputs and write the report: ``analysis.md``, ``analysis.json`` and
the figures (``usage.png``, ``co_occurrence.png``, ``active_channels.png``,
``token_experts.png``, ``tree.png``, each when the model has something to show in it)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterable

import torch
from torch import nn

from ..auxiliary import no_usage_statistics
from ..bench.plotting import MissingDependency
from . import plots
from .record import RoutingRecorder
from .summary import summarize


@torch.no_grad()
def analyze_model(model: nn.Module, batches: Iterable, tokens: torch.Tensor | None = None,
                  vocab_size: int | None = None,
                  token_label: Callable[[int], str] = str) -> dict[str, dict]:
    """Run ``model`` in eval mode on each of ``batches`` (tensors, or tuples of arguments) and
    summarise every sparse layer and dense MLP (:func:`sparseffn.analysis.summary.summarize`).
    ``tokens``: the token id of every position the model sees, in order (for the token
    tables). The model's mode and its layers' accumulated usage are left as they were."""
    was_training = model.training
    model.eval()
    try:     # the recorder keeps the routing itself; the layers need not count it too
        with RoutingRecorder(model) as recorder, no_usage_statistics(model):
            for batch in batches:
                model(*batch) if isinstance(batch, tuple) else model(batch)
    finally:
        model.train(was_training)
    return summarize(recorder.records, tokens, vocab_size, token_label)


def layer_table(layers: dict[str, dict]) -> list[str]:
    """Markdown lines: one table of the routed layers, one of the dense MLPs."""
    lines = []
    routed = {n: s for n, s in layers.items() if s["kind"] == "routed"}
    dense = {n: s for n, s in layers.items() if s["kind"] == "dense"}
    if routed:
        lines += ["| layer | experts | k | tokens | usage entropy | starved experts | "
                  "most used expert (× fair share) | note |", "|---|---|---|---|---|---|---|---|"]
        for name, s in routed.items():
            top = s["usage_curve"][0][1] if s["usage_curve"] else float("nan")
            lines.append(f"| {name} | {s['num_experts']:,} | {s['k']} | {s['tokens']:,} | "
                         f"{s['usage_entropy']:.3f} | {s['starved_fraction']:.1%} | {top:.2f} | "
                         f"{s['warning'] or ''} |")
        lines.append("")
    if dense:
        lines += ["| layer | d_ff | tokens | active units per token (mean ± std) | "
                  "active fraction |", "|---|---|---|---|---|"]
        for name, s in dense.items():
            lines.append(f"| {name} | {s['d_ff']} | {s['tokens']:,} | {s['active_mean']:.1f} ± "
                         f"{s['active_std']:.1f} | {s['active_fraction']:.1%} |")
        lines.append("")
    return lines


def top_token_lines(layers: dict[str, dict], max_layers: int = 2) -> list[str]:
    """Markdown: for the first ``max_layers`` routed layers with token tables, each expert's
    most frequent tokens and their share of the expert's tokens."""
    lines = []
    shown = [(n, s) for n, s in layers.items() if s.get("top_tokens")][:max_layers]
    for name, s in shown:
        lines += [f"Tokens per expert in `{name}` (top-1 choice; share of the expert's tokens):",
                  ""]
        for expert, top in enumerate(s["top_tokens"]):
            listed = ", ".join(f"`{label}` {share:.0%}" for label, _, share in top[:6])
            lines.append(f"- expert {expert}: {listed or '(no tokens)'}")
        lines.append("")
    return lines


def write_figures(layers: dict[str, dict], out: Path, label: str,
                  token_label: Callable[[int], str] = str) -> list[str]:
    """The figures of one model's analysis in ``out``; returns the files written (or a note
    saying why there are none)."""
    try:
        written = [
            plots.usage_plot({name: {label: s["usage_curve"]} for name, s in layers.items()
                              if s["kind"] == "routed"}, out / "usage.png", f"{label}: expert usage"),
            plots.co_occurrence_plot({n: s.get("co_occurrence") for n, s in layers.items()},
                                     out / "co_occurrence.png"),
            plots.active_channels_plot({label: {n: s for n, s in layers.items()
                                                if s["kind"] == "dense"}},
                                       out / "active_channels.png"),
            plots.token_experts_plot(layers, out / "token_experts.png", token_label),
            plots.tree_plot(layers, out / "tree.png"),
        ]
    except MissingDependency as error:
        return [f"(no figures: {error})"]
    return [name for name in written if name]


def write_analysis(result: dict, out: Path, token_label: Callable[[int], str] = str) -> Path:
    """``analysis.md``, ``analysis.json`` and the figures of ``result`` (``{"name", "layers",
    ...}``) in ``out``; returns the Markdown file."""
    out.mkdir(parents=True, exist_ok=True)
    layers = result["layers"]
    figures = write_figures(layers, out, result["name"], token_label)
    lines = [f"# Analysis: {result['name']}", ""]
    if result.get("source"):
        lines += [result["source"], ""]
    lines += layer_table(layers) or ["The model has no sparse layer and no dense MLP.", ""]
    lines += ["usage entropy: the entropy of the experts' shares of selection weight over "
              "log E (1: even, 0: one expert takes all); starved: experts below 1% of the fair "
              "share 1/E; active units: non-zero hidden units of a dense MLP per token.", ""]
    lines += top_token_lines(layers)
    lines += [f"![{name}]({name})" if name.endswith(".png") else name for name in figures]
    path = out / "analysis.md"
    path.write_text("\n".join(lines) + "\n")
    (out / "analysis.json").write_text(json.dumps(result, indent=1))
    return path
