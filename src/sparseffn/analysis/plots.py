"""PNG figures of layer summaries (:mod:`sparseffn.analysis.summary`); matplotlib is optional.

Each function writes one file and returns its name, or returns None when there is nothing to
draw. They raise :class:`~sparseffn.bench.plotting.MissingDependency` without matplotlib.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

from ..bench.plotting import pyplot


def _grid(count: int, width: float = 3.6, height: float = 3.2):
    plt = pyplot()
    cols = min(4, count)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    for ax in axes.flat[count:]:
        ax.axis("off")
    return plt, fig, list(axes.flat)


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def usage_plot(curves: dict[str, dict[str, list]], path: Path, title: str = "") -> str | None:
    """Sorted expert usage (Csordás et al. 2023 Fig. 3/7): one panel per layer, one line per
    model. ``curves``: ``{panel: {line label: usage_curve}}``."""
    curves = {panel: lines for panel, lines in curves.items() if lines}
    if not curves:
        return None
    plt, fig, axes = _grid(len(curves))
    for ax, (panel, lines) in zip(axes, curves.items()):
        for label, curve in lines.items():
            ax.plot([p[0] for p in curve], [max(p[1], 1e-4) for p in curve], label=label)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel("expert rank / number of experts")
        ax.set_ylabel("share of selection weight × E")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(plt, fig, path)


def co_occurrence_plot(layers: dict[str, list[list[int]]], path: Path) -> str | None:
    """Per layer, ``C[i, j] / C[i, i]``: of the tokens that selected expert i, the share that
    also selected j (Csordás et al. 2023 Fig. 6)."""
    layers = {name: matrix for name, matrix in layers.items() if matrix}
    if not layers:
        return None
    import numpy as np
    plt, fig, axes = _grid(len(layers))
    for ax, (name, matrix) in zip(axes, layers.items()):
        c = np.asarray(matrix, dtype=float)
        diagonal = np.maximum(np.diag(c), 1)
        share = c / diagonal[:, None]
        np.fill_diagonal(share, np.nan)
        image = ax.imshow(share, cmap="viridis", vmin=0)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("also selected: expert j")
        ax.set_ylabel("expert i")
        fig.colorbar(image, ax=ax, fraction=0.046)
    return _save(plt, fig, path)


def active_channels_plot(models: dict[str, dict[str, dict]], path: Path) -> str | None:
    """Non-zero hidden units of each dense MLP, as a fraction of d_ff, mean ± std over tokens
    (Csordás et al. 2023 Fig. 1): one group of bars per layer, one bar per model."""
    models = {m: layers for m, layers in models.items() if layers}
    if not models:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(models)
    for i, (label, layers) in enumerate(models.items()):
        xs = [j + i * width for j in range(len(layers))]
        means = [s["active_mean"] / s["d_ff"] for s in layers.values()]
        stds = [s["active_std"] / s["d_ff"] for s in layers.values()]
        ax.bar(xs, means, width, yerr=stds, capsize=3, label=label)
        names = list(layers)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=20,
                  fontsize=8)
    ax.set_ylabel("active hidden units / d_ff")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=8)
    return _save(plt, fig, path)


def token_experts_plot(layers: dict[str, dict], path: Path,
                       token_label: Callable[[int], str] = str,
                       rows: int = 32) -> str | None:
    """Which tokens each expert takes (Fedus et al. 2022): per layer, the ``rows`` most
    frequent tokens, each row the share of its occurrences sent to each expert by the top-1
    choice."""
    layers = {name: s for name, s in layers.items() if s.get("token_experts")}
    if not layers:
        return None
    import numpy as np
    plt, fig, axes = _grid(len(layers), width=4.2, height=6.5)
    for ax, (name, summary) in zip(axes, layers.items()):
        counts = np.asarray(summary["token_experts"], dtype=float)
        frequent = np.argsort(-counts.sum(1))[:rows]
        frequent = frequent[counts[frequent].sum(1) > 0]
        share = counts[frequent] / counts[frequent].sum(1, keepdims=True)
        ax.imshow(share, cmap="magma", vmin=0, vmax=1, aspect="auto")
        ax.set_yticks(range(len(frequent)), [token_label(int(t)) for t in frequent], fontsize=7)
        ax.set_xlabel("expert (top-1 choice)")
        ax.set_title(name, fontsize=9)
    return _save(plt, fig, path)


def tree_plot(layers: dict[str, dict], path: Path) -> str | None:
    """Fast feed-forward trees: tokens per leaf, and per node the entropy of its split and of
    its decisions (bits)."""
    layers = {name: s["tree"] for name, s in layers.items() if s.get("tree")}
    if not layers:
        return None
    plt, fig, axes = _grid(2 * len(layers), width=3.8)
    for i, (name, tree) in enumerate(layers.items()):
        leaves, nodes = axes[2 * i], axes[2 * i + 1]
        total = max(1, sum(tree["leaves"]))
        leaves.bar(range(len(tree["leaves"])), [c / total for c in tree["leaves"]])
        leaves.set_title(f"{name}: leaves (greedy descent)", fontsize=9)
        leaves.set_xlabel("leaf")
        leaves.set_ylabel("share of tokens")
        index = range(len(tree["reached"]))
        nodes.plot(index, [math.nan if v is None else v for v in tree["split_entropy"]], "o-",
                   label="split entropy")
        nodes.plot(index, [math.nan if v is None else v for v in tree["decision_entropy"]], "s-",
                   label="decision entropy")
        nodes.set_ylim(-0.05, 1.05)
        nodes.set_title(f"{name}: nodes", fontsize=9)
        nodes.set_xlabel("node (heap order)")
        nodes.set_ylabel("bits")
        nodes.legend(fontsize=7)
    return _save(plt, fig, path)
