"""Where each layer's training step spends its device time: the top kernels by self time.

    python scripts/gpu_profile.py [--layers sigma_moe,pkm] [--tokens 16384] [--d-model 256]
                                  [--fp32] [--top 8] [--device cuda]

For each layer of ``sparseffn bench compile`` (at ``--d-model``, bf16 autocast unless
``--fp32``), one warmed-up forward+backward is profiled with ``torch.profiler``; prints the
step's total device time and the ``--top`` kernels by self device time with their share. A
tool for finding what to speed up, not a benchmark (``sparseffn bench`` does the timing).
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import sparseffn
from sparseffn.bench.compiled import layer_configs
from sparseffn.bench.measure import forward_backward_fn


def profile_layer(name, config, tokens, device, dtype, top):
    torch.manual_seed(0)
    layer = sparseffn.build_layer(config).to(device).train()
    x = torch.randn(tokens, config.d_model, device=device)
    step = forward_backward_fn(layer, x, sparseffn.aux_loss, dtype)
    for _ in range(3):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    attr = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr, 0) > 0]
    if device.type == "cuda":   # kernels only (no CPU-side operator rows)
        events = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(getattr(e, attr) for e in events) or 1.0
    events.sort(key=lambda e: -getattr(e, attr))
    print(f"{name}: {total / 1e3:.2f} ms device time, {len(events)} kernel kinds")
    for e in events[:top]:
        share = getattr(e, attr) / total
        print(f"   {share:6.1%} {getattr(e, attr) / 1e3:8.3f} ms  x{e.count:<4d} {e.key[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", default=None)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--d-model", type=int, default=256)
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    configs = layer_configs(args.d_model)
    names = args.layers.split(",") if args.layers else list(configs)
    dtype = None if args.fp32 else torch.bfloat16
    for name in names:
        try:
            profile_layer(name, configs[name], args.tokens, torch.device(args.device), dtype,
                          args.top)
        except Exception as error:   # one failing layer does not hide the others
            print(f"{name}: FAILED {type(error).__name__}: {str(error).splitlines()[0][:200]}")


if __name__ == "__main__":
    main()
