"""``sparseffn bench onnx``: every layer exported with :func:`sparseffn.to_onnx` and run in
ONNX Runtime, beside its PyTorch inference forward and the dense MLP in both.

For each layer of :func:`~.compiled.layer_configs`: the export's seconds, the forward's
milliseconds in PyTorch (eager, ``no_grad``) and in ONNX Runtime (CPU execution provider,
as many intra-op threads as PyTorch uses), and the ratios read from the same timed rounds:
ONNX Runtime over PyTorch, and each runtime's time over the dense MLP's in that runtime
(timed in rotation with the layer, so the machine's drift cancels). The largest absolute
difference between the two runtimes' outputs says the graph computes what the layer does.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from ..onnx_export import cpu_session, require_onnxruntime
from .compiled import layer_configs
from .measure import (InterruptibleLoop, error_summary, interleaved_times, paired_ratio,
                      raise_if_interrupted, write_json)


class _Exported:
    """A layer exported with a dynamic token count, as an ONNX Runtime session."""

    def __init__(self, layer: torch.nn.Module, d_model: int, folder: str, name: str,
                 threads: int) -> None:
        from .. import to_onnx
        start = time.perf_counter()
        tokens = torch.export.Dim("tokens", min=2)
        program = to_onnx(layer, (torch.randn(37, d_model),), dynamic_shapes=({0: tokens},))
        self.export_s = time.perf_counter() - start
        path = Path(folder) / f"{name}.onnx"
        program.save(str(path))
        self.session = cpu_session(str(path), threads)
        self.input = self.session.get_inputs()[0].name

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.session.run(None, {self.input: x.numpy()})[0])


def run(tokens: int = 1024, d_model: int = 256, repeats: int = 10,
        names: list[str] | None = None, json_path: str | None = None) -> list[dict]:
    """Each layer of :func:`~.compiled.layer_configs` (or ``names``) in PyTorch and in ONNX
    Runtime on ``tokens`` tokens; one row printed per layer as it is measured, the records
    written to ``json_path``. Ctrl-C after the first layer keeps the layers measured."""
    ort = require_onnxruntime("this benchmark")
    configs = layer_configs(d_model)
    names = names or list(configs)
    threads = torch.get_num_threads()
    print(f"sparseffn bench onnx: {tokens} tokens, d_model {d_model}, fp32, {threads} threads, "
          f"torch {torch.__version__}, onnxruntime {ort.__version__}")
    print(f"{'layer':12s} {'export s':>8s} {'torch ms':>9s} {'ORT ms':>8s} {'ORT/torch':>9s} "
          f"{'torch/dense':>11s} {'ORT/dense':>9s} {'max |diff|':>10s}")
    records: list[dict] = []
    with tempfile.TemporaryDirectory() as folder:
        dense = _prepared("dense", configs["dense"], d_model, folder, threads)
        with InterruptibleLoop(names) as loop:
            for name in loop:
                records.append(_measure(name, configs[name], dense, tokens, d_model, repeats,
                                        folder, threads))
    if loop.left:
        print(f"bench onnx: interrupted: not measured: {', '.join(loop.left)}", flush=True)
    if json_path:
        write_json(records, json_path)
    return records


def _prepared(name: str, config, d_model: int, folder: str, threads: int):
    from .. import build_layer
    torch.manual_seed(0)
    layer = build_layer(config).eval()
    return layer, _Exported(layer, d_model, folder, name, threads)


def _measure(name: str, config, dense, tokens: int, d_model: int, repeats: int, folder: str,
             threads: int) -> dict:
    """One layer's record, its row printed (a failed export is reported, not fatal)."""
    record = {"layer": name, "tokens": tokens, "d_model": d_model, "threads": threads}
    try:
        layer, exported = _prepared(name, config, d_model, folder, threads)
    except Exception as error:
        raise_if_interrupted(error)
        print(f"{name:12s} export failed: {error_summary(error)}", flush=True)
        return record | {"error": error_summary(error)}
    x = torch.randn(tokens, d_model)
    dense_layer, dense_exported = dense
    with torch.no_grad():
        difference = float((exported(x) - layer(x)).abs().max()) if tokens else 0.0
        times = interleaved_times({"torch": lambda: layer(x), "ort": lambda: exported(x),
                                   "dense_torch": lambda: dense_layer(x),
                                   "dense_ort": lambda: dense_exported(x)}, repeats)
    row = {"export_s": exported.export_s,
           "torch_ms": statistics.median(times["torch"]),
           "ort_ms": statistics.median(times["ort"]),
           "ort_over_torch": paired_ratio(times["ort"], times["torch"]),
           "torch_over_dense": paired_ratio(times["torch"], times["dense_torch"]),
           "ort_over_dense": paired_ratio(times["ort"], times["dense_ort"]),
           "max_abs_difference": difference}
    print(f"{name:12s} {row['export_s']:8.1f} {row['torch_ms']:9.2f} {row['ort_ms']:8.2f} "
          f"{row['ort_over_torch']:9.2f} {row['torch_over_dense']:11.2f} "
          f"{row['ort_over_dense']:9.2f} {difference:10.1e}", flush=True)
    return record | row
