"""``sparseffn bench generate``: greedy text generation with each FFN preset, one token at a
time against the KV cache, running the window for every token, and in the fixed-shape steps
of :class:`~sparseffn.models.generate.Decoder` (compiled as ``compile`` says: with
``"reduce-overhead"``, replayed from CUDA graphs), on any device.

The models are :func:`~sparseffn.bench.lm_step.lm_model`'s (``bench lm``'s byte-level LM, each
FFN sized to a dense MLP of ``d_ff``), in evaluation mode and untrained: only the time is
measured. One call generates ``tokens`` tokens after a prompt of ``prompt`` random bytes
(:func:`sparseffn.models.generate.generate`, greedy). Every (preset, mode) call is timed in
rotation, one of each per round (CUDA events on a GPU, the wall clock on a CPU), after one
call of each that compiles and warms up; ratios are medians of per-round ratios.
``same tokens`` says whether the modes drew the same tokens, which they do unless two
logits tie to within rounding.

``onnx=True`` (CPU, float32) adds a fourth mode: the model's decoding program exported with
:func:`sparseffn.decoder_to_onnx` and generated from in ONNX Runtime
(:class:`sparseffn.OnnxDecoder`, as many intra-op threads as PyTorch uses), timed in the same
rotation; its export is part of the preset's preparation.
"""

from __future__ import annotations

import statistics
import tempfile

import torch

from ..models.generate import Decoder, generate
from ..runtime import check_compile_mode
from .lm_step import byte_tokens, lm_model, preset_names
from .measure import (InterruptibleLoop, autocast_dtype_of, cudagraph_skips, describe_device,
                      keeping_swallowed_interrupts, paired_ratio, preparing_stopped,
                      skipped_graphs_note, times_kept_on_interrupt, write_json)

# the KV cache (generate), the window for every token, Decoder's fixed-shape steps
MODES = ("cache", "window", "static")


def run(presets: list[str] | None = None, d_model: int = 256, n_layers: int = 6,
        n_heads: int = 4, context: int | None = None, d_ff: int = 2048, batch: int = 1,
        prompt: int = 16, tokens: int | None = None, repeats: int = 3, device: str = "cpu",
        dtype: str = "float32", compile: str = "none", onnx: bool = False,
        json_path: str | None = None) -> list[dict]:
    """Time generating ``tokens`` tokens (default: up to the context) after a ``prompt``-token
    prompt, ``batch`` sequences at once, with each preset (``dense`` always included) in the
    three modes, the static one compiled as ``compile`` says (``"none"``, ``"default"``,
    ``"reduce-overhead"``), and in ONNX Runtime where ``onnx``; print a table and return one
    record per preset.

    Each preset's three modes are called once (their warm-up, which compiles the static
    steps) before the next preset is built. Ctrl-C (or ``timeout -s INT``) there times the
    presets already warmed up (dense first: before it is ready the interrupt goes through);
    in the timed rounds it keeps the whole ones. A line says what was cut short, and a
    record's ``rounds`` counts its rounds. Another says, for a preset whose static steps
    Inductor compiled without CUDA graphs under ``"reduce-overhead"`` (a CPU tensor or a host
    read in a step), how many graphs; its record's ``static_cudagraph_skips`` holds the count
    (0 for none)."""
    check_compile_mode(compile)
    dev = torch.device(device)
    context = context or (256 if dev.type == "cuda" else 128)
    tokens = context - prompt if tokens is None else tokens
    names = preset_names(presets)
    if not 1 <= prompt <= context or tokens < 1:
        raise ValueError(f"the prompt must hold 1..context ({context}) tokens and at least one "
                         f"token must be generated, got prompt {prompt}, tokens {tokens}")
    autocast_dtype = autocast_dtype_of(dtype)
    if onnx:
        _check_onnx_runtime(dev, dtype)
    modes = MODES + ("onnx",) if onnx else MODES
    print(f"sparseffn bench generate: {describe_device(dev)}, {dtype}, d_model {d_model}, "
          f"{n_layers} blocks, context {context}, batch {batch}, prompt {prompt}, {tokens} new "
          f"tokens (greedy), FFNs sized to a dense d_ff {d_ff}, static steps compiled: "
          f"{compile}, torch {torch.__version__}", flush=True)
    start = byte_tokens(batch, prompt - 1, dev)
    outputs: dict[str, torch.Tensor] = {}
    exports = tempfile.TemporaryDirectory(prefix="sparseffn-bench-generate-")

    def call(name: str, model, mode: str):
        if mode == "onnx":
            decoder = _onnx_decoder(model, f"{exports.name}/{name.split('/')[0]}.onnx")

            def generate_in_onnx_runtime():
                outputs[name] = decoder.generate(start, tokens, temperature=0)
            return generate_in_onnx_runtime
        autocast = torch.autocast(dev.type, dtype=autocast_dtype,
                                  enabled=autocast_dtype is not None)
        with autocast:     # the static cache takes autocast's dtype
            decoder = Decoder(model, batch, compile) if mode == "static" else None

        def generate_once():
            with autocast:
                outputs[name] = (decoder.generate(start, tokens, temperature=0) if decoder
                                 else generate(model, start, tokens, temperature=0,
                                               use_cache=mode == "cache"))
        return generate_once

    fns, stopped = {}, ""
    skips: dict[str, int] = {}     # graphs Inductor compiled without CUDA graphs, per preset
    with exports, keeping_swallowed_interrupts():
        with InterruptibleLoop(names) as loop:      # dense first: the baseline
            for name in loop:
                model = lm_model(name, d_model, n_layers, n_heads, context, d_ff, dev).eval()
                warmed = {f"{name}/{mode}": call(f"{name}/{mode}", model, mode)
                          for mode in modes}
                skipped_before = cudagraph_skips()      # (only the static steps compile)
                for fn in warmed.values():
                    fn()
                skips[name] = cudagraph_skips() - skipped_before
                if skips[name]:
                    print(f"  {name}: static steps compiled{skipped_graphs_note(skips[name])}",
                          flush=True)
                fns.update(warmed)
        if loop.left:
            stopped = preparing_stopped(loop)
        times, stopped = times_kept_on_interrupt(fns, repeats, 0, dev, stopped)
    if stopped:
        print(f"bench generate: {stopped}", flush=True)
    records = []
    for name in names:
        if f"{name}/cache" not in times:        # interrupted before it was ready
            continue
        cache, window, static = (times[f"{name}/{mode}"] for mode in MODES)
        drawn = [outputs[f"{name}/{mode}"] for mode in modes]
        records.append({
            "preset": name, "device": str(dev), "dtype": dtype, "d_model": d_model,
            "n_layers": n_layers, "context": context, "batch": batch, "prompt": prompt,
            "tokens": tokens, "compile": compile, "rounds": len(cache),
            "cache_ms_per_token": statistics.median(cache) / tokens,
            "window_ms_per_token": statistics.median(window) / tokens,
            "static_ms_per_token": statistics.median(static) / tokens,
            "window_over_cache": paired_ratio(window, cache),
            "static_over_cache": paired_ratio(static, cache),
            "cache_over_dense": paired_ratio(cache, times["dense/cache"]),
            "static_over_dense": paired_ratio(static, times["dense/static"]),
            "static_cudagraph_skips": skips[name],
            "same_tokens": all(torch.equal(drawn[0], other) for other in drawn[1:])})
        if onnx:
            in_onnx_runtime = times[f"{name}/onnx"]
            records[-1].update({
                "onnx_ms_per_token": statistics.median(in_onnx_runtime) / tokens,
                "onnx_over_cache": paired_ratio(in_onnx_runtime, cache),
                "onnx_over_dense": paired_ratio(in_onnx_runtime, times["dense/onnx"])})
    print(format_table(records))
    if json_path:
        write_json(records, json_path)
        print(f"wrote {json_path}")
    return records


def _check_onnx_runtime(device: torch.device, dtype: str) -> None:
    """A ValueError unless the run is on the CPU in float32 (ONNX Runtime's CPU provider),
    MissingDependency without onnxruntime or the exporter's packages."""
    if device.type != "cpu" or dtype != "float32":
        raise ValueError(f"--onnx runs ONNX Runtime's CPU provider in float32, not on "
                         f"{device.type} in {dtype}")
    from ..onnx_export import require_onnx_packages, require_onnxruntime
    require_onnxruntime("this benchmark")
    require_onnx_packages()


def _onnx_decoder(model, path: str):
    """The model's decoding program, exported to ``path``, as an OnnxDecoder whose session
    uses as many intra-op threads as PyTorch."""
    from ..onnx_decoding import OnnxDecoder, decoder_to_onnx
    from ..onnx_export import cpu_session
    decoder_to_onnx(model).save(path)
    return OnnxDecoder(cpu_session(path, torch.get_num_threads()))


def format_table(records: list[dict]) -> str:
    width = max([len("preset")] + [len(r["preset"]) for r in records])
    header = (f"{'preset':{width}s} {'cache ms/tok':>12s} {'window ms/tok':>13s} "
              f"{'static ms/tok':>13s} {'window/cache':>12s} {'static/cache':>12s} "
              f"{'cache/dense':>11s} {'static/dense':>12s}")
    onnx = bool(records) and "onnx_ms_per_token" in records[0]
    if onnx:
        header += f" {'onnx ms/tok':>11s} {'onnx/cache':>10s} {'onnx/dense':>10s}"
    header += f" {'same tokens':>11s}"
    lines = [header, "-" * len(header)]
    for r in records:
        line = (f"{r['preset']:{width}s} {r['cache_ms_per_token']:12.3f} "
                f"{r['window_ms_per_token']:13.3f} {r['static_ms_per_token']:13.3f} "
                f"{r['window_over_cache']:12.2f} {r['static_over_cache']:12.2f} "
                f"{r['cache_over_dense']:11.2f} {r['static_over_dense']:12.2f}")
        if onnx:
            line += (f" {r['onnx_ms_per_token']:11.3f} {r['onnx_over_cache']:10.2f} "
                     f"{r['onnx_over_dense']:10.2f}")
        lines.append(f"{line} {'yes' if r['same_tokens'] else 'NO':>11s}")
    compile = records[0]["compile"] if records else "none"
    lines.append(f"ms per generated token (batch sequences at once); static: Decoder's "
                 f"fixed-shape steps, compile {compile};"
                 f"{' onnx: OnnxDecoder in ONNX Runtime;' if onnx else ''} ratios are "
                 f"medians of per-round ratios")
    return "\n".join(lines)
