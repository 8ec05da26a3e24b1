"""``sparseffn compare``: train several variants of one run and report.

The config is a run config (see :mod:`sparseffn.train.config`) with a ``[compare]`` table:

```toml
[compare]
# FFN presets, sized to model.d_ff
variants = ["dense", "sigma_moe", "switch", "fff", "pkm", "peer"]
lrs = [2.5e-3, 5e-3, 1e-2]        # optional: every variant once per learning rate (a sweep)
[compare.options.sigma_moe]       # preset fields per variant
k = 4
```

A variant may also be a table:
- ``{name = "moe-top4", ffn = "sigma_moe", ffn_options = {k = 4}}``, or
  ``{name = "mine", ffn = {type = "moe", num_experts = 16, expert_size = 32, k = 4}}``;
- ``{name = "dense-params", match = "sigma_moe"}``: the dense model with the same total
  parameters as that variant (Csordás et al. 2023's evaluation rule), and
  ``{name = "dense-compute", match = "sigma_moe", by = "compute"}``: the dense model with that
  variant's active parameters per token (Fedus et al. 2022's FLOP-matched baseline);
- any of them with ``train = {lr = 2e-3}``: fields of ``[train]`` for this variant only
  (e.g. the learning rate a sweep found best for its family).

With ``lrs``, variant ``v`` becomes ``v@lr`` for each rate (a matched variant follows its
target at the same rate), and the report adds the best rate of each variant.

Each variant trains in its own process (so its peak memory is its own) in ``OUT/<variant>``.
A variant that already finished with the same config is not trained again, and one that was
interrupted resumes from its checkpoint: running the command again loses nothing. The report
(``OUT/report.md``, ``OUT/results.json``, ``OUT/val_loss_vs_step.png``,
``OUT/val_loss_vs_time.png``) is written at the end. A second compare into the same ``OUT``
while one runs is refused (``OUT/.lock``), as is a second training run in one variant folder.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .config import RunConfig, _check, _section, dense_baseline, run_config_from_dict
from .lock import folder_lock
from .model_config import describe_changes, model_changes
from .report import write_report
from .trainer import CHECKPOINT, METRICS, SUMMARY


_VARIANT_KEYS = ("name", "ffn", "ffn_options", "match", "by", "train")


def _lr_label(lr: float) -> str:
    return f"{lr:g}"


def _rate_suffix(lr: float | None) -> str:
    """How a sweep names a variant's run at rate ``lr``: ``name@lr`` ('' outside a sweep)."""
    return "" if lr is None else f"@{_lr_label(lr)}"


def _at_rate(run: RunConfig, lr: float | None) -> RunConfig:
    """``run`` at the sweep's learning rate ``lr`` (unchanged outside a sweep)."""
    return run if lr is None else run.replace(train=dataclasses.replace(run.train, lr=float(lr)))


def _with_train(run: RunConfig, name: str, train: Any) -> RunConfig:
    """``run`` with the variant's ``train`` table applied over the shared ``[train]``."""
    if not train:
        return run
    _check(isinstance(train, dict), f"compare variant {name!r}: train must be a table of "
                                    f"[train] fields")
    fields = {**dataclasses.asdict(run.train), **train}
    return run.replace(train=_section(type(run.train), fields, f"compare variant {name!r} train"))


def variant_runs(data: dict[str, Any]) -> list[RunConfig]:
    """The run of each variant in the ``[compare]`` table of a parsed config (with ``lrs``,
    one per variant and learning rate)."""
    base = run_config_from_dict(data, allow=("compare",))
    compare = data.get("compare")
    _check(isinstance(compare, dict) and compare.get("variants"),
           "compare needs a [compare] table with variants = [...]")
    unknown = sorted(set(compare) - {"variants", "options", "lrs"})
    _check(not unknown, f"[compare] has no field(s) {unknown}; fields are "
                        f"['lrs', 'options', 'variants']")
    options = compare.get("options", {})
    lrs = compare.get("lrs")
    _check(lrs is None or (isinstance(lrs, list) and lrs and all(
        isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr > 0 for lr in lrs)),
        f"[compare] lrs must be a list of positive learning rates, got {lrs!r}")
    _check(lrs is None or len(set(map(_lr_label, lrs))) == len(lrs),
           f"[compare] lrs has a rate twice: {lrs!r}")
    entries = []
    for entry in compare["variants"]:
        if isinstance(entry, str):
            entry = {"name": entry, "ffn": entry}
        _check(isinstance(entry, dict) and isinstance(entry.get("name"), str),
               f"each compare variant is a preset name or a table with a name, got {entry!r}")
        extra = sorted(set(entry) - set(_VARIANT_KEYS))
        _check(not extra, f"compare variant {entry['name']!r}: unknown key(s) {extra}; keys are "
                          f"{list(_VARIANT_KEYS)}")
        _check("by" not in entry or "match" in entry,
               f"compare variant {entry['name']!r}: by applies to a matched variant (match = ...)")
        entries.append(entry)
    names = [e["name"] for e in entries]
    twice = sorted({n for n in names if names.count(n) > 1})
    _check(not twice, f"compare variant(s) {twice} appear twice")
    trained = {e["name"] for e in entries if "match" not in e}
    runs: dict[str, RunConfig] = {}
    for lr in lrs or [None]:
        suffix = _rate_suffix(lr)
        pending: list[tuple[dict, str]] = []
        for entry in entries:
            name = entry["name"] + suffix
            if "match" in entry:
                pending.append((entry, name))
                continue
            ffn = entry.get("ffn", entry["name"])
            ffn_options = entry.get("ffn_options",
                                    options.get(entry["name"], {}) if isinstance(ffn, str) else {})
            model = dataclasses.replace(base.model, ffn=ffn, ffn_options=ffn_options)
            run = _with_train(base.replace(name=name, model=model), name, entry.get("train"))
            runs[name] = _at_rate(run, lr)
        for entry, name in pending:
            target = entry["match"] + suffix
            _check(entry["match"] in trained and target in runs,
                   f"compare variant {entry['name']!r} matches {entry['match']!r}, which is no "
                   f"trained variant")
            matched = dense_baseline(runs[target], entry.get("by", "params"))
            run = _with_train(matched.replace(name=name, train=base.train), name,
                              entry.get("train"))
            runs[name] = _at_rate(run, lr)
    order = [entry["name"] + _rate_suffix(lr) for lr in lrs or [None] for entry in entries]
    return [runs[name] for name in order]


def _saved_run(folder: Path) -> RunConfig | None:
    """The config a previous run in ``folder`` was trained with, if any."""
    try:
        return run_config_from_dict(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError):
        return None


def _train_in_subprocess(run: RunConfig, folder: Path, resume: bool, device: str) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "variant.json"
    config.write_text(json.dumps(run.to_dict(), indent=2))
    command = [sys.executable, "-m", "sparseffn", "train", str(config), "--out", str(folder),
               "--device", device]
    if resume:
        command.append("--resume")
    process = subprocess.Popen(command)
    try:
        return process.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the child too: let it finish writing its checkpoint
        process.wait()
        raise


def _train_here(run: RunConfig, folder: Path, resume: bool, device: str) -> int:
    from .trainer import Trainer
    Trainer(run, folder, progress=False, device=device).train(resume=resume)
    return 0


def compare(data: dict[str, Any], out: str | Path, fresh: bool = False,
            only: list[str] | None = None, isolate: bool = True, analyses: bool = True,
            device: str = "cpu") -> dict:
    """Train every variant (or those in ``only``), then write the report; returns its results.
    ``isolate=False`` trains in this process (no start-up per variant, but the peak-memory
    column is then the largest so far, not each variant's own); ``analyses=False`` leaves out
    the per-variant expert analyses (e.g. for the second seed of the same variants).
    ``device``: where every variant trains (``cpu``, ``cuda``, ``cuda:N``)."""
    from .trainer import training_device
    training_device(device)      # a bad device is refused before anything trains
    _check(int(os.environ.get("WORLD_SIZE", "1")) <= 1,
           "sparseffn compare runs each variant in a process of its own and cannot run under "
           "torchrun; train the variants there one by one with sparseffn train (same config, "
           "--set model.ffn=...), or run compare in one process")
    runs = variant_runs(data)
    if only:
        names = {r.name for r in runs}
        missing = sorted(set(only) - names)
        _check(not missing, f"--variants: no variant(s) {missing}; variants are {sorted(names)}")
        runs = [r for r in runs if r.name in only]
    out = Path(out)
    with folder_lock(out, "compare"):
        return _train_and_report(data, runs, out, fresh, isolate, analyses, device)


def _note_changed_defaults(run: RunConfig, folder: Path) -> None:
    """A finished variant reused although this version would build its model otherwise (a
    default changed since it trained): say so, naming the fields, and how to retrain it."""
    trained = json.loads((folder / SUMMARY).read_text()).get("model")
    changes = model_changes(run, trained) if isinstance(trained, dict) else []
    if changes:
        print(f"  note: {run.name} was trained with a model this version of sparseffn builds "
              f"otherwise ({describe_changes(changes, 'that run')}); its results are that "
              f"model's; `sparseffn compare CONFIG --fresh --variants {run.name}` retrains it",
              file=sys.stderr)


def _train_and_report(data: dict[str, Any], runs: list[RunConfig], out: Path, fresh: bool,
                      isolate: bool, analyses: bool, device: str) -> dict:
    for index, run in enumerate(runs, 1):
        folder = out / run.name
        same_config = not fresh and _saved_run(folder) == run
        if same_config and (folder / SUMMARY).is_file():
            print(f"[{index}/{len(runs)}] {run.name}: already trained, reusing {folder}",
                  file=sys.stderr)
            _note_changed_defaults(run, folder)
            continue
        resume = same_config and (folder / CHECKPOINT).is_file()
        print(f"[{index}/{len(runs)}] {run.name}: {'resuming' if resume else 'training'}",
              file=sys.stderr)
        code = (_train_in_subprocess if isolate else _train_here)(run, folder, resume, device)
        if code == 130:
            raise KeyboardInterrupt
        if code != 0:
            raise RuntimeError(f"variant {run.name!r} failed (exit {code}); its log is above, "
                               f"its files in {folder}")
    results = []
    for run in runs:
        summary = json.loads((out / run.name / SUMMARY).read_text())
        metrics = [json.loads(line) for line in (out / run.name / METRICS).read_text().splitlines()
                   if line.strip()]
        results.append({"summary": summary, "evals": [m for m in metrics if m["kind"] == "eval"]})
    sections = analysis_sections([run.name for run in runs], out) if analyses else []
    return write_report(results, out, title=data.get("name", "compare"), extra_sections=sections)


def analysis_sections(names: list[str], out: Path, windows: int = 64) -> list[str]:
    """Analyse every variant's final checkpoint (``OUT/<variant>/analysis/``) and return the
    report's section on them: collapse numbers per variant, the sorted expert usage of every
    variant in one figure (a panel per layer) and the dense MLPs' active units."""
    from ..analysis import plots
    from ..bench.plotting import MissingDependency
    from ..analysis.report import write_analysis
    from .analyze import analyze_checkpoint
    layers_of = {}
    for name in names:
        result, label = analyze_checkpoint(out / name / CHECKPOINT, "val", windows)
        write_analysis(result, out / name / "analysis", label)
        layers_of[name] = result["layers"]
    lines = ["## Experts", "",
             f"Each variant's final model on {windows} validation windows "
             f"(`sparseffn analyze`; details in `<variant>/analysis/analysis.md`).", "",
             "| variant | layers | usage entropy (min over layers) | starved experts (max) | "
             "dense: active hidden units | warning |", "|---|---|---|---|---|---|"]
    for name, layers in layers_of.items():
        routed = [s for s in layers.values() if s["kind"] == "routed"]
        dense = [s for s in layers.values() if s["kind"] == "dense"]
        entropy = f"{min(s['usage_entropy'] for s in routed):.3f}" if routed else ""
        starved = f"{max(s['starved_fraction'] for s in routed):.1%}" if routed else ""
        active = (f"{sum(s['active_fraction'] for s in dense) / len(dense):.1%} of d_ff"
                  if dense else "")
        warned = [s for s in routed if s["warning"]]
        warning = (f"{len(warned)} of {len(routed)} layers, worst: "
                   f"{min(warned, key=lambda s: s['usage_entropy'])['warning']}" if warned else "")
        lines.append(f"| [{name}]({name}/analysis/analysis.md) | {len(layers)} | {entropy} | "
                     f"{starved} | {active} | {warning} |")
    lines += ["", "usage entropy: 1 when every expert gets the same share of selection weight, "
              "0 when one takes all (Csordás et al. 2023 Fig. 3); starved: below 1% of the fair "
              "share; active hidden units: the non-zero units of a dense MLP per token "
              "(their Fig. 1).", ""]
    panels: dict[str, dict[str, list]] = {}
    for name, layers in layers_of.items():
        for layer, s in layers.items():
            if s["kind"] == "routed":
                panels.setdefault(layer, {})[name] = s["usage_curve"]
    try:
        figures = [plots.usage_plot(panels, out / "usage.png", "sorted expert usage"),
                   plots.active_channels_plot(
                       {name: {n: s for n, s in layers.items() if s["kind"] == "dense"}
                        for name, layers in layers_of.items()}, out / "active_channels.png")]
    except MissingDependency as error:
        figures = [f"(no figures: {error})"]
    lines += [f"![{f}]({f})" if f.endswith(".png") else f for f in figures if f]
    return lines + [""]
