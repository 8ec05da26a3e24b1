"""``sparseffn compare``: train several variants of one run at equal parameters and report.

The config is a run config (see :mod:`sparseffn.train.config`) with a ``[compare]`` table:

```toml
[compare]
# FFN presets, sized to model.d_ff
variants = ["dense", "sigma_moe", "switch", "fff", "pkm", "peer"]
[compare.options.sigma_moe]       # preset fields per variant
k = 4
```

A variant may also be a table: ``{name = "moe-top4", ffn = "sigma_moe", ffn_options = {k = 4}}``,
``{name = "mine", ffn = {type = "moe", num_experts = 16, expert_size = 32, k = 4}}``, or
``{name = "dense-matched", match = "sigma_moe"}``: the dense model with the same total
parameters as that variant (Csordás et al.'s evaluation rule).

Each variant trains in its own process (so its peak memory is its own) in ``OUT/<variant>``.
A variant that already finished with the same config is not trained again, and one that was
interrupted resumes from its checkpoint: running the command again loses nothing. The report
(``OUT/report.md``, ``OUT/results.json``, ``OUT/val_loss_vs_step.png``,
``OUT/val_loss_vs_time.png``) is written at the end.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from .config import RunConfig, _check, dense_baseline, run_config_from_dict
from .report import write_report
from .trainer import CHECKPOINT, METRICS, SUMMARY


def variant_runs(data: dict[str, Any]) -> list[RunConfig]:
    """The run of each variant in the ``[compare]`` table of a parsed config."""
    base = run_config_from_dict(data, allow=("compare",))
    compare = data.get("compare")
    _check(isinstance(compare, dict) and compare.get("variants"),
           "compare needs a [compare] table with variants = [...]")
    unknown = sorted(set(compare) - {"variants", "options"})
    _check(not unknown, f"[compare] has no field(s) {unknown}; fields are ['options', 'variants']")
    options = compare.get("options", {})
    runs: dict[str, RunConfig] = {}
    pending_matches: list[tuple[str, str]] = []
    for entry in compare["variants"]:
        if isinstance(entry, str):
            entry = {"name": entry, "ffn": entry}
        _check(isinstance(entry, dict) and isinstance(entry.get("name"), str),
               f"each compare variant is a preset name or a table with a name, got {entry!r}")
        name = entry["name"]
        _check(name not in runs and name not in dict(pending_matches),
               f"compare variant {name!r} appears twice")
        extra = sorted(set(entry) - {"name", "ffn", "ffn_options", "match"})
        _check(not extra, f"compare variant {name!r}: unknown key(s) {extra}")
        if "match" in entry:
            pending_matches.append((name, entry["match"]))
            continue
        ffn = entry.get("ffn", name)
        ffn_options = entry.get("ffn_options", options.get(name, {}) if isinstance(ffn, str) else {})
        model = dataclasses.replace(base.model, ffn=ffn, ffn_options=ffn_options)
        runs[name] = base.replace(name=name, model=model)
    for name, target in pending_matches:
        _check(target in runs, f"compare variant {name!r} matches {target!r}, which is no variant")
        runs[name] = dense_baseline(runs[target]).replace(name=name)
    return list(runs.values())


def _saved_run(folder: Path) -> RunConfig | None:
    """The config a previous run in ``folder`` was trained with, if any."""
    try:
        return run_config_from_dict(json.loads((folder / "config.json").read_text()))
    except (OSError, ValueError):
        return None


def _train_in_subprocess(run: RunConfig, folder: Path, resume: bool) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    config = folder / "variant.json"
    config.write_text(json.dumps(run.to_dict(), indent=2))
    command = [sys.executable, "-m", "sparseffn", "train", str(config), "--out", str(folder)]
    if resume:
        command.append("--resume")
    process = subprocess.Popen(command)
    try:
        return process.wait()
    except KeyboardInterrupt:
        # Ctrl-C reached the child too: let it finish writing its checkpoint
        process.wait()
        raise


def compare(data: dict[str, Any], out: str | Path, fresh: bool = False,
            only: list[str] | None = None) -> dict:
    """Train every variant (or those in ``only``), then write the report; returns its results."""
    runs = variant_runs(data)
    if only:
        names = {r.name for r in runs}
        missing = sorted(set(only) - names)
        _check(not missing, f"--variants: no variant(s) {missing}; variants are {sorted(names)}")
        runs = [r for r in runs if r.name in only]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for index, run in enumerate(runs, 1):
        folder = out / run.name
        same_config = not fresh and _saved_run(folder) == run
        if same_config and (folder / SUMMARY).is_file():
            print(f"[{index}/{len(runs)}] {run.name}: already trained, reusing {folder}",
                  file=sys.stderr)
            continue
        resume = same_config and (folder / CHECKPOINT).is_file()
        print(f"[{index}/{len(runs)}] {run.name}: {'resuming' if resume else 'training'}",
              file=sys.stderr)
        code = _train_in_subprocess(run, folder, resume)
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
    return write_report(results, out, title=data.get("name", "compare"))
