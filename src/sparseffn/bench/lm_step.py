"""``sparseffn bench lm``: one training step of a byte-level Transformer LM with each FFN preset,
beside the dense model of equal parameters, on any device.

The model is :class:`~sparseffn.models.TransformerLM`; each preset of
:func:`~sparseffn.models.ffn_preset` fills every block's FFN with a layer of at most the
parameters of a dense MLP of width ``d_ff`` (the comparison rule of Csordás et al. 2023,
arXiv:2310.10837 §6), so ``dense`` is the parameter-equal baseline of all the others.

A step is what a user's training loop pays: the forward pass and the loss (next-token
cross-entropy plus the layers' auxiliary losses), under autocast when a reduced ``dtype`` is
asked for, the backward pass, and the trainer's Adam update (:func:`sparseffn.adam_optimizers`:
fused Adam, SparseAdam for parameters with sparse gradients), with ``--dtype float16`` the
trainer's dynamic loss scaling around it (:class:`sparseffn.train.loss_scaling.LossScaling`:
the scaled backward, an unscaling pass over the gradients, the inf check and the scale's
update, all on the device). The models are timed in rotation,
one step of each per round (CUDA events on a GPU, the wall clock on a CPU); a model's ratio to
``dense`` is the median of the per-round ratios. Peak MiB (CUDA only) is the allocator's peak
during one step above what was allocated before it. The tokens are random bytes: only the time
is measured.

Defaults follow the measurement in the GPU issue (d_model 256, 6 blocks, context 256, batch
64, d_ff 2048) on a GPU; on a CPU the batch is 4 and the context 128 unless given.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch

from ..auxiliary import aux_loss
from ..models import PRESETS, LMConfig, TransformerLM, ffn_preset
from ..optim import adam_optimizers
from ..runtime import check_compile_mode, compiled, compiling_many, deterministic_algorithms
from ..train.loss_scaling import LossScaling
from .measure import (InterruptibleLoop, autocast_dtype_of, describe_device, error_summary,
                      first_call_or_eager, keeping_swallowed_interrupts, new_graph_step,
                      paired_ratio, peak_mib, preparing_stopped, raise_if_interrupted,
                      times_kept_on_interrupt, verdict, write_json)


def lm_config(preset: str, d_model: int, n_layers: int, n_heads: int, context: int,
              d_ff: int) -> LMConfig:
    """The byte-level LM whose FFNs are the named preset sized to a dense MLP of ``d_ff``."""
    layout = ffn_preset(preset, d_model, d_ff, n_layers)
    return LMConfig(vocab_size=256, d_model=d_model, n_layers=n_layers, n_heads=n_heads,
                    context=context, ffn=layout.ffn, sparse_every=layout.sparse_every,
                    dense_ffn=layout.dense_ffn)


def lm_ffn(preset: str, d_model: int = 256, n_layers: int = 6, d_ff: int = 2048):
    """The config of the FFN layer that :func:`lm_model` puts in its blocks for ``preset`` (at
    the benchmark's sizes by default), for scripts that study one layer at the LM's shapes."""
    return ffn_preset(preset, d_model, d_ff, n_layers).ffn


def lm_model(preset: str, d_model: int = 256, n_layers: int = 6, n_heads: int = 4,
             context: int = 256, d_ff: int = 2048,
             device: torch.device | str = "cpu") -> TransformerLM:
    """The benchmark's LM with the FFN ``preset`` (:func:`lm_config`), initialised from seed 0,
    on ``device``, in training mode."""
    torch.manual_seed(0)
    config = lm_config(preset, d_model, n_layers, n_heads, context, d_ff)
    return TransformerLM(config).to(device).train()


def byte_tokens(batch: int, context: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Random bytes [batch, context + 1] from seed 0 (inputs and next-token targets): the
    benchmark measures time only."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 256, (batch, context + 1), generator=generator).to(device)


def preset_names(presets: list[str] | None) -> list[str]:
    """``dense`` (the baseline), then ``presets`` (None: every preset); a ValueError naming
    the unknown ones."""
    names = ["dense"] + [p for p in (presets or list(PRESETS)) if p != "dense"]
    unknown = [p for p in names if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown FFN preset(s) {', '.join(unknown)}; presets are "
                         f"{', '.join(PRESETS)}")
    return names


def training_step_fn(model: TransformerLM, tokens: torch.Tensor,
                     autocast_dtype: torch.dtype | None, compile: str = "none"
                     ) -> Callable[[], None]:
    """One training step on ``tokens`` [batch, context + 1]: loss, backward, Adam update
    (with loss scaling in float16, as ``train.fp16`` trains), with the loss's forward
    compiled as ``compile`` says (see :func:`sparseffn.runtime.compiled`). Returns a function
    that runs it (and returns nothing read from the device)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizers = adam_optimizers(model, lr=1e-4)     # as the trainer's
    scaling = LossScaling(tokens.device, enabled=autocast_dtype == torch.float16)
    device_type = tokens.device.type
    loss_of = compiled(model.loss, compile)

    def step():
        new_graph_step(compile)
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = loss_of(inputs, targets) + aux_loss(model)
        scaling.backward(loss)
        scaling.unscale(optimizers)
        scaling.step(optimizers)
    return step


def _ready_step(name: str, model: TransformerLM, tokens: torch.Tensor,
                autocast_dtype: torch.dtype | None, compile: str
                ) -> tuple[Callable[[], None], bool]:
    """The training step to time for one preset's ``model``, and whether it is compiled; it
    has run (twice compiled: warm-up and capture) so that a step that fails raises here,
    before the timed rounds, where it would stop the whole benchmark."""
    step = training_step_fn(model, tokens, autocast_dtype, compile)
    if compile != "none":
        step, ok = first_call_or_eager(
            step, lambda: training_step_fn(model, tokens, autocast_dtype), name)
        if ok:
            return step, True
    step()
    return step, False


def run(presets: list[str] | None = None, d_model: int = 256, n_layers: int = 6,
        n_heads: int = 4, context: int | None = None, batch: int | None = None,
        d_ff: int = 2048, repeats: int = 10, device: str = "cpu", dtype: str = "float32",
        json_path: str | None = None, compile: str = "none",
        deterministic: bool = False, time_limit: float | None = None) -> list[dict]:
    """Time one training step of the LM with each preset (``dense`` always included); print a
    table and return one record per preset. ``compile``: ``"none"``, ``"default"`` or
    ``"reduce-overhead"`` (CUDA graphs) for every model; one that does not compile is timed
    eagerly and its record says so. ``deterministic`` times the steps under
    ``torch.use_deterministic_algorithms(True)``, as ``sparseffn train`` runs by default.

    A preset whose step raises is not timed: its record holds the ``error`` instead (the
    others are timed; ``dense``, the baseline, failing stops the benchmark). Ctrl-C (or
    ``timeout -s INT``) while the models compile times those already ready, and during the
    timed rounds keeps the whole rounds: the table and JSON hold what was measured, and a
    line under the table says what was cut short (a record's ``rounds`` counts its rounds).
    ``time_limit`` (seconds) stops preparing models, as an interrupt would but between two of
    them, before one that would likely be ready past it (:class:`InterruptibleLoop`); the
    timed rounds of those ready come after."""
    check_compile_mode(compile)
    dev = torch.device(device)
    on_gpu = dev.type == "cuda"
    context = context or (256 if on_gpu else 128)
    batch = batch or (64 if on_gpu else 4)
    names = preset_names(presets)
    autocast_dtype = autocast_dtype_of(dtype)
    print(f"sparseffn bench lm: {describe_device(dev)}, {dtype}, d_model {d_model}, {n_layers} blocks, context "
          f"{context}, batch {batch}, FFNs sized to a dense d_ff {d_ff}, torch "
          f"{torch.__version__}, compile {compile}"
          + (", deterministic algorithms" if deterministic else ""), flush=True)
    tokens = byte_tokens(batch, context, dev)
    with deterministic_algorithms(deterministic, dev), compiling_many(), \
            keeping_swallowed_interrupts():
        steps, costs, is_compiled, failed, stopped = {}, {}, {}, {}, ""
        with InterruptibleLoop(names, time_limit) as loop:      # dense first: the baseline
            for name in loop:
                model = lm_model(name, d_model, n_layers, n_heads, context, d_ff, dev)
                costs[name] = model.config.cost()
                try:
                    steps[name], is_compiled[name] = _ready_step(name, model, tokens,
                                                                 autocast_dtype, compile)
                except Exception as error:
                    raise_if_interrupted(error)
                    if name == "dense":          # no baseline, nothing to compare
                        raise
                    failed[name] = error_summary(error)
                    print(f"  {name}: failed ({failed[name]}); not timed", flush=True)
        if loop.left:
            stopped = preparing_stopped(loop)
            print(f"  {stopped}; timing the {len(steps)} ready", flush=True)
        times, stopped = times_kept_on_interrupt(steps, repeats, 2, dev, stopped)
        records = []
        for name in names:
            if name not in costs:           # interrupted before it was built
                continue
            record = {
                "preset": name, "device": str(dev), "dtype": dtype, "d_model": d_model,
                "n_layers": n_layers, "context": context, "batch": batch, "d_ff": d_ff,
                "compile": compile, "compiled": is_compiled.get(name, False),
                "deterministic": deterministic,
                **{key: costs[name][key] for key in
                   ("total_params", "active_params", "flops_per_token")}}
            if name in failed:
                records.append({**record, "error": failed[name]})
            elif name in times:
                ms = statistics.median(times[name])
                records.append({
                    **record, "ms": ms, "tokens_per_s": batch * context / ms * 1e3,
                    "over_dense": paired_ratio(times[name], times["dense"]),
                    "rounds": len(times[name]), "peak_mib": peak_mib(steps[name], dev)})
    if stopped:
        print(f"bench lm: {stopped}")
    print(format_table(records))
    if json_path:
        write_json(records, json_path)
        print(f"wrote {json_path}")
    return records


# The GPU issue's targets for a whole LM training step (H100, bf16): each preset's step time
# over the parameter-equal dense model's at most this (FFF trained soft or sparse alike).
TARGET_OVER_DENSE = {"sigma_moe": 1.0, "switch": 1.0, "sbase": 1.0, "fff": 1.0,
                     "fff_sparse": 1.0, "pkm": 1.5, "peer": 1.5}


def check_targets(records: list[dict]) -> list[str]:
    """The GPU issue's LM-step targets for the presets these records hold, each as a line
    ending in ``ok`` or ``MISSED``. They are stated for an H100 in bf16; the first line says
    what this run was."""
    timed = [r for r in records if r["preset"] in TARGET_OVER_DENSE]
    if not timed:
        return []
    first = timed[0]
    out = [f"targets of the GPU issue (H100, bf16; this run: {first['device']}, "
           f"{first['dtype']}, compile {first['compile']}):"]
    for r in timed:
        limit = TARGET_OVER_DENSE[r["preset"]]
        if "error" in r:
            out.append(f"target: {r['preset']} / dense <= {limit:.1f}: failed "
                       f"({r['error']}): {verdict(False)}")
            continue
        eager = " (timed eagerly: it did not compile)" \
            if r["compile"] != "none" and not r["compiled"] else ""
        out.append(f"target: {r['preset']} / dense <= {limit:.1f}: {r['over_dense']:.2f}{eager}: "
                   f"{verdict(r['over_dense'] <= limit)}")
    return out


def format_table(records: list[dict]) -> str:
    width = max([len("preset")] + [len(r["preset"]) for r in records])
    header = (f"{'preset':{width}s} {'params':>10s} {'active':>10s} {'MFLOP/tok':>10s} "
              f"{'ms/step':>9s} {'/ dense':>8s} {'tokens/s':>10s} {'peak MiB':>9s}")
    lines = [header, "-" * len(header)]
    for r in records:
        sizes = (f"{r['preset']:{width}s} {r['total_params']:10,d} {r['active_params']:10,d} "
                 f"{r['flops_per_token'] / 1e6:10.2f}")
        if "error" in r:
            lines.append(f"{sizes} failed: {r['error']}")
            continue
        peak = "-" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"{sizes} {r['ms']:9.2f} {r['over_dense']:8.2f} "
                     f"{r['tokens_per_s']:10,.0f} {peak:>9s}")
    lines.append("one training step (forward, loss + auxiliary losses, backward, Adam); "
                 "'/ dense' is the median per-round ratio to the parameter-equal dense model")
    return "\n".join(lines + check_targets(records))
