"""Check ``sparseffn train --device cuda`` on a GPU machine (not part of the test suite: CI has
no GPU).

    python scripts/gpu_train_check.py [--steps N] [--presets a,b] [--json PATH] [--device cpu]

For each FFN preset of a small byte-level LM on pydoc (no download):
  - fp32 on CUDA against the same run on the CPU: the training curve and the final validation
    loss agree to a relative tolerance (different kernels, so not to the bit);
  - bf16 autocast on CUDA trains and stays finite, eagerly and with ``train.compile``
    (tokens per second of the last step of each, the compiled one's long past compiling);
    with ``train.compile = "reduce-overhead"`` (CUDA graphs) it follows the compiled run's
    curve to 1% (tokens per second beside);
  - fp16 autocast with loss scaling (``train.fp16``) follows the fp32 CUDA curve to 2% and
    skips no step at the initial scale;
  - the memory levers in bf16: ``micro_batches = 2`` follows the plain run's curve to 2%,
    ``activation_checkpointing`` repeats it exactly; on CUDA the allocator's peak of each run;
  - no training step synchronises with the host, in bf16 and in fp16 (each step after the
    first two runs under ``torch.cuda.set_sync_debug_mode("warn")``; the trainer reads the
    losses where it logs, evaluates or saves, outside the steps);
  - a run stopped after half its steps and resumed on CUDA ends with exactly the losses and
    weights of the straight run (deterministic mode: cuBLAS workspace fixed; ops without a
    deterministic CUDA kernel are listed, since they warn instead of failing);
  - milliseconds per step on CUDA and on the CPU;
  - greedy text from the fp32 run's checkpoint (``TransformerLM.generate``) on CUDA: 32
    tokens, and how many of them lead as on the CPU (near-ties may flip one, so not a test).
Prints one line per preset and check and exits 1 if any check failed. ``--device cpu`` runs it
all on the CPU (to check the script itself). ``--quick`` runs only the fp32, bf16 (with its
synchronisations) and resume checks: does a user's ``sparseffn train --device cuda`` train at
all, in the minute a 15-minute GPU session can spare for it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import traceback
import warnings
from pathlib import Path

import torch

from sparseffn.train import checkpoint as ckpt
from sparseffn.train.config import DataSpec, ModelSpec, RunConfig, TrainSpec
from sparseffn.train.sample import load_language_model
from sparseffn.train.trainer import Trainer

PRESETS = ("dense", "sigma_moe", "switch", "fff", "pkm", "peer")


def _run(preset: str, steps: int, bf16: bool = False, compile: bool | str = False,
         fp16: bool = False, **train) -> RunConfig:
    return RunConfig(name=f"check-{preset}", data=DataSpec(corpus="pydoc"),
                     model=ModelSpec(d_model=64, n_layers=2, n_heads=4, context=64, ffn=preset,
                                     d_ff=256),
                     train=TrainSpec(steps=steps, batch_size=16, lr=3e-3, eval_every=steps,
                                     log_every=1, eval_windows=16, bf16=bf16,
                                     fp16=fp16, compile=compile, **train))


def _train_records(folder: Path) -> list[dict]:
    """The run's logged training steps, from its metrics.jsonl."""
    return [m for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if m["kind"] == "train"]


def _curve(folder: Path) -> list[float]:
    return [m["loss"] for m in _train_records(folder)]


def _reset_peak(device: str) -> None:
    """Start the CUDA allocator's peak afresh (nothing on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device: str) -> float | None:
    """The CUDA allocator's peak since :func:`_reset_peak`, in MiB (None on the CPU)."""
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**20


def _largest_gap(curve: list[float], reference: list[float]) -> float:
    """The largest relative difference between two loss curves, step by step."""
    return max(abs(x - y) / abs(y) for x, y in zip(curve, reference))


def _last_rate(folder: Path) -> float:
    """Tokens per second of the last logged training step."""
    return _train_records(folder)[-1]["items_per_s"]


def _watch_syncs(trainer: Trainer, found: list[str], warm: int = 2) -> None:
    """Run each of ``trainer``'s steps after the first ``warm`` (lazy initialisation may
    synchronise once) under the CUDA sync debug mode "warn"; add where one synchronised to
    ``found``."""
    step = trainer._step

    def watched(index):
        if index < warm:
            return step(index)
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return step(index)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
                # PyTorch 2.11 warns on entering the mode that it is a prototype which "does
                # not yet detect all synchronizing operations": that is not a synchronisation
                found.extend(f"step {index + 1}: {w.filename}:{w.lineno}" for w in caught
                             if "synchroniz" in str(w.message)
                             and "prototype feature" not in str(w.message))
    trainer._step = watched


def _train(run: RunConfig, folder: Path, device: str, stop_at: int | None = None,
           resume: bool = False, syncs: list[str] | None = None
           ) -> tuple[dict | None, list[str]]:
    """Train ``run`` on ``device``: its summary (None if stopped at ``stop_at``) and the ops
    that warned they are not deterministic; with a ``syncs`` list (on CUDA), the steps'
    synchronisations are added to it."""
    trainer = Trainer(run, folder, progress=False, device=device)
    if syncs is not None:
        _watch_syncs(trainer, syncs)
    if stop_at is not None:
        original = trainer._batch

        def batch(step):
            if step == stop_at:
                raise KeyboardInterrupt
            return original(step)
        trainer._batch = batch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            summary = trainer.train(resume=resume)
        except KeyboardInterrupt:
            summary = None
    nondeterministic = sorted({str(w.message).split(" does not have")[0] for w in caught
                               if "deterministic" in str(w.message)})
    return summary, nondeterministic


def check(preset: str, steps: int, device: str, tmp: Path, quick: bool = False) -> list[dict]:
    results = []

    def record(name, ok, detail):
        results.append({"preset": preset, "check": name, "ok": bool(ok), "detail": detail})
        print(f"{preset:<10} {name:<22} {'ok' if ok else 'FAILED':<7} {detail}", flush=True)

    run = _run(preset, steps)
    gpu, nondeterministic = _train(run, tmp / f"{preset}-gpu", device)
    cpu, _ = _train(run, tmp / f"{preset}-cpu", "cpu")
    a, b = _curve(tmp / f"{preset}-gpu"), _curve(tmp / f"{preset}-cpu")
    worst = _largest_gap(a, b)
    record("fp32 vs cpu", worst < 1e-3 and math.isclose(gpu["val"]["loss"], cpu["val"]["loss"],
                                                        rel_tol=1e-3),
           f"largest relative gap in the curve {worst:.2e}; val {gpu['val']['loss']:.4f} vs "
           f"{cpu['val']['loss']:.4f}")
    record("ms per step", True, f"{device} {1e3 * gpu['train_time_s'] / steps:.1f}, cpu "
                                f"{1e3 * cpu['train_time_s'] / steps:.1f}")
    cuda = torch.device(device).type == "cuda"
    syncs: list[str] | None = [] if cuda else None
    _reset_peak(device)
    bf16, _ = _train(_run(preset, steps, bf16=True), tmp / f"{preset}-bf16", device,
                     syncs=syncs)
    record("bf16 autocast", math.isfinite(bf16["val"]["loss"]), f"val {bf16['val']['loss']:.4f}")
    if not quick:
        _check_more(preset, steps, device, tmp, record, a, syncs)
    if cuda:
        record("no sync in a step", not syncs,
               f"{len(syncs)} synchronising calls in the bf16"
               + ("" if quick else " and fp16") + " steps"
               + (f", the first at {syncs[0]}" if syncs else ""))
    folder = tmp / f"{preset}-resumed"
    _train(run, folder, device, stop_at=steps // 2)
    _train(run, folder, device, resume=True)
    same_curve = _curve(folder) == a
    x = ckpt.load(folder / "checkpoint.pt")["model"]
    y = ckpt.load(tmp / f"{preset}-gpu" / "checkpoint.pt")["model"]
    same_weights = all(torch.equal(x[k], y[k]) for k in x)
    record("resume to the bit", same_curve and same_weights,
           "nondeterministic ops: " + (", ".join(nondeterministic) or "none"))
    if not quick:
        _check_sample(preset, device, tmp, record)
    return results


def _check_more(preset: str, steps: int, device: str, tmp: Path, record, fp32_curve,
                syncs: list[str] | None) -> None:
    """The checks ``--quick`` leaves out: the memory levers, compiled, CUDA graphs, fp16."""
    cuda = torch.device(device).type == "cuda"
    peaks, curves = {"plain": _peak_mib(device)}, {"plain": _curve(tmp / f"{preset}-bf16")}
    for name, fields in (("micro_batches 2", {"micro_batches": 2}),
                         ("recomputed", {"activation_checkpointing": True})):
        folder = tmp / f"{preset}-bf16-{name.split()[0]}"
        _reset_peak(device)
        _train(_run(preset, steps, bf16=True, **fields), folder, device)
        peaks[name], curves[name] = _peak_mib(device), _curve(folder)
    gap = _largest_gap(curves["micro_batches 2"], curves["plain"])
    same = curves["recomputed"] == curves["plain"]
    record("memory levers", gap < 2e-2 and same,
           f"micro-batches' largest relative gap {gap:.2e}, recomputed "
           f"{'equal' if same else 'DIFFERENT'}"
           + ("; peak MiB " + ", ".join(f"{name} {mib:.0f}" for name, mib in peaks.items())
              if cuda else ""))
    compiled, _ = _train(_run(preset, steps, bf16=True, compile=True),
                         tmp / f"{preset}-bf16-compiled", device)
    record("bf16 compiled", math.isfinite(compiled["val"]["loss"]),
           f"val {compiled['val']['loss']:.4f}; tokens/s at the last step "
           f"{_last_rate(tmp / f'{preset}-bf16-compiled'):.0f}, eager "
           f"{_last_rate(tmp / f'{preset}-bf16'):.0f}")
    graphed, _ = _train(_run(preset, steps, bf16=True, compile="reduce-overhead"),
                        tmp / f"{preset}-bf16-graphs", device)
    gap = _largest_gap(_curve(tmp / f"{preset}-bf16-graphs"),
                       _curve(tmp / f"{preset}-bf16-compiled"))
    record("bf16 CUDA graphs", math.isfinite(graphed["val"]["loss"]) and gap < 1e-2,
           f"largest relative gap to compiled {gap:.2e}; tokens/s at the last step "
           f"{_last_rate(tmp / f'{preset}-bf16-graphs'):.0f}, compiled "
           f"{_last_rate(tmp / f'{preset}-bf16-compiled'):.0f}")
    fp16, _ = _train(_run(preset, steps, fp16=True), tmp / f"{preset}-fp16", device,
                     syncs=syncs)
    gap = _largest_gap(_curve(tmp / f"{preset}-fp16"), fp32_curve)
    record("fp16 autocast", gap < 2e-2 and fp16["skipped_steps"] == 0
           and math.isfinite(fp16["val"]["loss"]),
           f"largest relative gap to fp32 {gap:.2e}; skipped steps {fp16['skipped_steps']}")


def _check_sample(preset: str, device: str, tmp: Path, record) -> None:
    """Greedy text from the fp32 run's checkpoint, on the CPU and on ``device``."""
    _, model, tokenizer = load_language_model(tmp / f"{preset}-gpu" / "checkpoint.pt")
    prompt = torch.as_tensor(tokenizer.encode(b"def ")).view(1, -1)
    texts = {where: model.to(where).generate(prompt.to(where), 32, temperature=0).cpu()
             for where in ("cpu", device)}
    same = int((texts["cpu"] == texts[device]).long().cumprod(1).sum()) - prompt.shape[1]
    record("greedy sample", texts[device].shape == (1, prompt.shape[1] + 32),
           f"the first {same} of 32 tokens as on the cpu")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json")
    parser.add_argument("--quick", action="store_true",
                        help="only the fp32, bf16 and resume checks")
    args = parser.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets.split(","):
            try:
                results += check(preset, args.steps, args.device, Path(tmp), args.quick)
            except Exception:
                traceback.print_exc()
                results.append({"preset": preset, "check": "ran", "ok": False,
                                "detail": traceback.format_exc(limit=3)})
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} checks passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
