"""Language-model comparisons of the papers, run as ``sparseffn compare`` and judged claim by
claim.

An :class:`LMExperiment` is a list of compare variants (see :mod:`sparseffn.train.compare`),
the paper's number for each, and the claims to check. ``run`` trains every variant on a
byte-level corpus that ships with Python (nothing downloaded; bits per byte, the unit of the
papers' Enwik8 column), writes ``OUT/NAME.md`` (our table beside the paper's, one line per
claim: held or not at this scale, with the numbers) and ``OUT/NAME.json``, and keeps the runs,
their report and expert analyses in ``OUT/runs/NAME/``.

A claim compares validation bits per byte; "matches" allows ``MATCH_TOLERANCE`` (relative),
which is about the run-to-run spread we see between seeds at this size.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

MATCH_TOLERANCE = 0.01     # "matches": within 1% of the other's bits per byte


@dataclass(frozen=True)
class Claim:
    """One sentence of a paper and how to check it on our results.

    check: the experiment's results (here: bpc by variant name) -> (held, our numbers in
    words)."""

    text: str
    paper: str
    check: Callable[[dict[str, float]], tuple[bool, str]]


def judge(claims: list[Claim], results: Any) -> list[dict]:
    """Each claim checked on ``results``: ``{"claim", "paper", "held", "ours"}``."""
    judged = []
    for claim in claims:
        held, words = claim.check(results)
        judged.append({"claim": claim.text, "paper": claim.paper, "held": bool(held),
                       "ours": words})
    return judged


def better(a: str, b: str) -> Callable[[dict[str, float]], tuple[bool, str]]:
    """Variant ``a`` reaches lower bits per byte than ``b``."""
    def check(bpc):
        return bpc[a] < bpc[b], f"{a} {bpc[a]:.3f} vs {b} {bpc[b]:.3f} ({bpc[a] - bpc[b]:+.3f})"
    return check


def matches(a: str, b: str, tolerance: float = MATCH_TOLERANCE):
    """Variant ``a`` is at most ``tolerance`` (relative) worse than ``b``."""
    def check(bpc):
        return (bpc[a] <= bpc[b] * (1 + tolerance),
                f"{a} {bpc[a]:.3f} vs {b} {bpc[b]:.3f} ({bpc[a] - bpc[b]:+.3f}; "
                f"allowed +{bpc[b] * tolerance:.3f})")
    return check


def best_of(a: str, others: list[str]):
    """Variant ``a`` is better than every one of ``others``."""
    def check(bpc):
        worst_gap = min(bpc[o] - bpc[a] for o in others)
        shown = ", ".join(f"{o} {bpc[o]:.3f}" for o in others)
        return worst_gap > 0, f"{a} {bpc[a]:.3f}; {shown}"
    return check


def all_hold(*checks):
    """Every check holds (their words joined)."""
    def check(bpc):
        results = [c(bpc) for c in checks]
        return all(held for held, _ in results), "; ".join(words for _, words in results)
    return check


@dataclass(frozen=True)
class LMExperiment:
    """A comparison of a paper, as compare variants and claims.

    model / train: the ``[model]`` / ``[train]`` tables of the full run; ``quick_model`` /
    ``quick_train`` replace fields for ``--quick`` (a smoke test: too small to judge claims).
    paper: the paper's number for each variant (shown beside ours), and ``paper_unit``.
    """

    name: str
    title: str
    source: str
    variants: list
    claims: list[Claim]
    paper: dict[str, str] = field(default_factory=dict)
    paper_unit: str = "Enwik8 bpc"
    corpus: str = "pydoc"
    model: dict = field(default_factory=dict)
    train: dict = field(default_factory=dict)
    quick_model: dict = field(default_factory=lambda: {
        "d_model": 32, "n_layers": 2, "n_heads": 2, "context": 16})
    quick_train: dict = field(default_factory=lambda: {
        "steps": 6, "batch_size": 4, "eval_every": 3, "eval_windows": 4, "warmup_steps": 1})
    notes: str = ""

    def config(self, quick: bool = False, seed: int = 0) -> dict[str, Any]:
        """The compare config of the full (or quick) run."""
        model = {"kind": "lm", **self.model, **(self.quick_model if quick else {})}
        train = {**self.train, **(self.quick_train if quick else {})}
        return {"name": self.name, "seed": seed, "data": {"corpus": self.corpus},
                "model": model, "train": train, "compare": {"variants": self.variants}}


def _table(summaries: list[dict], paper: dict[str, str], unit: str) -> list[str]:
    lines = ["| variant | lr | params | active params/token | FLOPs/token | val bpc | tokens/s | "
             f"paper ({unit}) |", "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lr = f"{s['lr']:g}" if "lr" in s else "–"     # summaries written before 'lr' existed
        lines.append(f"| {s['name']} | {lr} | {s['total_params']:,} | {s['active_params']:,} | "
                     f"{s['flops_per_token']:,} | {s['val']['bpc']:.3f} | "
                     f"{s['items_per_s']:,.0f} | {paper.get(s['name'], '–')} |")
    return lines


def run_lm_experiment(experiment: LMExperiment, *, quick: bool = False, out: str = "results",
                      seed: int = 0, device: str = "cpu", **_: Any) -> dict:
    """Train the experiment's variants and write ``OUT/NAME.md`` / ``.json``."""
    from ..train.compare import compare
    started = time.perf_counter()
    out_dir = Path(out)
    runs = out_dir / "runs" / (experiment.name + ("-quick" if quick else ""))
    results = compare(experiment.config(quick, seed), runs, isolate=not quick, device=device)
    summaries = results["variants"]
    bpc = {s["name"]: s["val"]["bpc"] for s in summaries}
    claims = judge(experiment.claims, bpc)
    first = summaries[0]
    seconds = time.perf_counter() - started
    lines = [f"# {experiment.title}", "", experiment.source, "",
             f"{'Quick form (a smoke test, too small to judge the claims): ' if quick else ''}"
             f"byte-level LM on `{first['corpus']}` (unigram entropy {first['unigram_bits']:.3f} "
             f"bits per byte), d_model {first['model']['d_model']}, "
             f"{first['model']['n_layers']} blocks, {first['steps']} steps, seed {seed}; "
             f"{seconds:.0f} s on this machine. The paper's models have 41M parameters and "
             f"train for 100k steps on Enwik8: compare the ordering, not the values.", "",
             *_table(summaries, experiment.paper, experiment.paper_unit), "",
             "## Claims", ""]
    for c in claims:
        lines.append(f"- **{'held' if c['held'] else 'did not hold'}** at this scale: "
                     f"{c['claim']} (paper: {c['paper']}). Ours: {c['ours']}.")
    lines.append("")
    if experiment.notes:
        lines += [experiment.notes, ""]
    figures = []
    for name in ("val_loss_vs_step.png", "val_loss_vs_time.png", "usage.png"):
        if (runs / name).is_file():
            target = f"{experiment.name}_{name}"
            shutil.copyfile(runs / name, out_dir / target)
            figures.append(f"![{name}]({target})")
    lines += figures + ["", f"Runs, their report and each variant's expert analysis: "
                            f"`{runs}` (`report.md`)."]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{experiment.name}.md").write_text("\n".join(lines) + "\n")
    payload = {"experiment": experiment.name, "quick": quick, "seed": seed, "seconds": seconds,
               "claims": claims, "variants": summaries}
    (out_dir / f"{experiment.name}.json").write_text(json.dumps(payload, indent=1))
    return payload
