"""The product-key top-k and the PEER step at the LM's shapes, each timed against what it
replaced in the same rounds.

    python scripts/gpu_rows_calls.py [--tokens 16384] [--rounds 10]

The shapes are those of ``sparseffn bench lm`` (d_model 256, each FFN sized to a dense
d_ff 2048 MLP; a batch of 64 × 256 tokens): the ``pkm`` and ``peer`` presets.

- ``topk``: ``product_key_topk`` on [tokens·heads, n] score halves, per layer's shape:
  ``merge`` (random scores: every block takes the k-way merge), ``exact`` (integer scores,
  all ties: every block takes the exact selection over the k_a·k_b candidates, which is what
  the kernel did for every block before the merge), and the PyTorch sort path.
- ``peer``: one PEER layer's forward and backward under bf16 autocast: ``one sort`` (the
  reverse index shared by both table gradients) against ``two sorts`` (each table gradient
  sorting the pairs itself, as before).
- ``gather_sum backward``: a PKM and a PEER layer's forward and backward under bf16
  autocast: ``fused`` (``scatter_rows_dot``: the table's and the weights' gradients of
  ``gather_sum`` from one pass over the pairs) against ``two kernels`` (``scatter_rows`` and
  ``gather_dot``, as before).

A tool for finding what to speed up; ``sparseffn bench lm`` times the whole step. With
``--device cpu`` (and ``TRITON_INTERPRET=1``) it runs the kernels in Triton's interpreter at
small sizes: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics

import torch

from sparseffn import build_layer
from sparseffn.bench.lm_step import lm_ffn
from sparseffn.bench.measure import kernel_script_device, per_call_times
from sparseffn.ops import kernels, native, triton_cvmm, triton_rows
from sparseffn.stores import rows as row_stores


def _median_ms(fns: dict, rounds: int, calls: int, device: torch.device) -> dict[str, float]:
    """Median ms per call of each function (loops of ``calls`` calls, timed in rotation)."""
    return {name: statistics.median(times)
            for name, times in per_call_times(fns, rounds, calls, device).items()}


@contextlib.contextmanager
def _torch_path():
    triton_cvmm.set_triton_enabled(False)
    native.set_native_enabled(False)
    try:
        yield
    finally:
        triton_cvmm.set_triton_enabled(True)
        native.set_native_enabled(True)


@contextlib.contextmanager
def _two_kernels():
    """gather_sum's two gradients from scatter_rows and gather_dot, as before scatter_rows_dot."""
    fused = kernels.scatter_rows_dot
    kernels.scatter_rows_dot = kernels.scatter_rows_and_gather_dot
    try:
        yield
    finally:
        kernels.scatter_rows_dot = fused


@contextlib.contextmanager
def _two_sorts():
    """PEER as before the shared reverse index: each table gradient sorts the pairs."""
    shared = row_stores.shared_row_index
    row_stores.shared_row_index = lambda *args, **kwargs: None
    try:
        yield
    finally:
        row_stores.shared_row_index = shared


def _topk(preset: str, tokens: int, rounds: int, calls: int, device: torch.device) -> None:
    cfg = lm_ffn(preset)
    n = cfg.num_subkeys if preset == "pkm" else round(cfg.num_experts ** 0.5)
    rows = tokens * cfg.heads
    gen = torch.Generator(device=device).manual_seed(0)
    s_a, s_b = (torch.randn(rows, n, device=device, generator=gen) for _ in range(2))
    tied_a, tied_b = s_a.round(), s_b.round()

    def torch_sort():
        with _torch_path():
            return kernels.product_key_topk(s_a, s_b, cfg.k)

    fns = {"merge": lambda: triton_rows.product_key_topk_indices(s_a, s_b, cfg.k),
           "exact": lambda: triton_rows.product_key_topk_indices(tied_a, tied_b, cfg.k),
           "torch sort": torch_sort}
    merged = triton_rows.product_key_topk_indices(s_a, s_b, cfg.k)[1].float().mean().item()
    tied = triton_rows.product_key_topk_indices(tied_a, tied_b, cfg.k)[1].float().mean().item()
    ms = _median_ms(fns, rounds, calls, device)
    print(f"topk {preset}: [{rows}, {n}] halves, k {cfg.k} (rows merged: random "
          f"{merged:.0%}, integer {tied:.0%})", flush=True)
    for name, t in ms.items():
        print(f"  {name:10s} {t:8.3f} ms   / exact {t / ms['exact']:.2f}", flush=True)


def _layer_step(preset: str, tokens: int, device: torch.device):
    """One forward+backward of the preset's layer (bf16 autocast on CUDA), and its config."""
    cfg = lm_ffn(preset)
    layer = build_layer(cfg).to(device).train()
    x = torch.randn(tokens, cfg.d_model, device=device, requires_grad=True)
    grad = torch.randn(tokens, cfg.d_model, device=device)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def step():
        layer.zero_grad(set_to_none=True)
        with autocast:
            y = layer(x)
        y.float().backward(grad)
    return step, cfg


def _peer(tokens: int, rounds: int, calls: int, device: torch.device) -> None:
    step, cfg = _layer_step("peer", tokens, device)

    def step_two_sorts():
        with _two_sorts():
            step()

    ms = _median_ms({"one sort": step, "two sorts": step_two_sorts}, rounds, calls, device)
    print(f"peer: {cfg.num_experts} experts, heads {cfg.heads}, k {cfg.k}, {tokens} tokens, "
          f"forward+backward", flush=True)
    for name, t in ms.items():
        print(f"  {name:10s} {t:8.3f} ms   / two sorts {t / ms['two sorts']:.2f}", flush=True)


def _gather_sum_backward(preset: str, tokens: int, rounds: int, calls: int,
                         device: torch.device) -> None:
    step, _ = _layer_step(preset, tokens, device)

    def step_two_kernels():
        with _two_kernels():
            step()

    ms = _median_ms({"fused": step, "two kernels": step_two_kernels}, rounds, calls, device)
    print(f"gather_sum backward, {preset}: {tokens} tokens, forward+backward", flush=True)
    for name, t in ms.items():
        print(f"  {name:11s} {t:8.3f} ms   / two kernels {t / ms['two kernels']:.2f}",
              flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=None,
                        help="tokens per call (default 16384 on CUDA, 64 on the CPU)")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10, help="calls per timed loop")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device, where = kernel_script_device(parser, args.device)
    tokens = args.tokens or (16384 if device.type == "cuda" else 64)
    print(f"gathered-row calls at the LM's shapes: {where}, {tokens} tokens", flush=True)
    for preset in ("pkm", "peer"):
        _topk(preset, tokens, args.rounds, args.calls, device)
    _peer(tokens, args.rounds, args.calls, device)
    for preset in ("pkm", "peer"):
        _gather_sum_backward(preset, tokens, args.rounds, args.calls, device)


if __name__ == "__main__":
    main()
