"""Check every layer on a CUDA device against the CPU, and for what the GPU work relies on.

    python scripts/gpu_check.py [--tokens N] [--layers a,b] [--json PATH] [--device cpu]

Per layer (the set of ``sparseffn bench compile``, at a small width):
  - fp32 forward and every gradient on CUDA equal the CPU's given the same weights (routers
    with noise or sampling run in eval mode for this comparison);
  - a training forward+backward under bf16 autocast runs and is finite;
  - no host synchronisation in an eager fp32 or bf16 training step
    (``torch.cuda.set_sync_debug_mode("error")``);
  - ``torch.compile(fullgraph=True)`` on CUDA gives the eager output and gradients.
Prints one line per layer and check, and exits 1 if any check failed. It is not part of the
test suite (CI has no GPU). ``--device cpu`` runs the same checks on the CPU, comparing the
fused C kernels with the PyTorch implementations of the operators (no synchronisation checks).
"""

from __future__ import annotations

import argparse
import copy
import json
import sys

import torch

import sparseffn
from sparseffn.bench.compiled import layer_configs
from sparseffn.bench.measure import host_sync_in
from sparseffn.ops import native

_NOISY = {"noisy_topk", "gshard", "switch"}   # noise, sampling or jitter in training


def _step(layer, x, grad, dtype=None):
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        y = layer(x)
        loss = (y.float() * grad).sum() + sparseffn.aux_loss(layer)
    loss.backward()
    grads = {name: p.grad for name, p in layer.named_parameters() if p.grad is not None}
    return y.detach(), x.grad, grads


def _close(a, b, tol):
    a, b = a.detach().float().cpu(), b.detach().float().cpu()
    if a.is_sparse:
        a, b = a.to_dense(), b.to_dense()
    scale = max(1.0, b.abs().max().item()) if b.numel() else 1.0
    err = (a - b).abs().max().item() if a.numel() else 0.0
    return err <= tol * scale, err


def check_layer(name, config, tokens, results, device="cuda"):
    def record(check, ok, detail=""):
        results.append({"layer": name, "check": check, "ok": bool(ok), "detail": detail})
        print(f"{name:12s} {check:22s} {'ok' if ok else 'FAIL'} {detail}", flush=True)

    torch.manual_seed(0)
    cpu_layer = sparseffn.build_layer(config)
    cuda_layer = copy.deepcopy(cpu_layer).to(device)
    if name in _NOISY:
        cpu_layer.eval()
        cuda_layer.eval()
    x = torch.randn(tokens, config.d_model)
    grad = torch.randn(tokens, getattr(config, "output_width", config.d_model))
    try:
        if device == "cpu":        # the reference is the PyTorch implementation of each operator
            native.set_native_enabled(False)
        y_cpu, gx_cpu, g_cpu = _step(cpu_layer, x, grad)
        native.set_native_enabled(True)
        y_gpu, gx_gpu, g_gpu = _step(cuda_layer, x.to(device), grad.to(device))
        worst = 0.0
        ok = set(g_cpu) == set(g_gpu)
        for a, b in [(y_gpu, y_cpu), (gx_gpu, gx_cpu)] + [(g_gpu[k], g_cpu[k]) for k in g_cpu
                                                          if k in g_gpu]:
            good, err = _close(a, b, 1e-3)
            ok, worst = ok and good, max(worst, err)
        record("fp32 vs reference", ok, f"max abs err {worst:.2e}")
    except Exception as error:
        record("fp32 vs reference", False, f"{type(error).__name__}: {error}"[:300])

    cuda_layer.train()
    xg, gg = x.to(device), grad.to(device)
    try:
        y, gx, grads = _step(cuda_layer, xg, gg, torch.bfloat16)
        finite = bool(torch.isfinite(y.float()).all()) and bool(torch.isfinite(gx.float()).all())
        finite = finite and all(bool(torch.isfinite(g.coalesce().values() if g.is_sparse else g).all())
                                for g in grads.values())
        record("bf16 autocast step", finite, f"out {y.dtype}")
    except Exception as error:
        record("bf16 autocast step", False, f"{type(error).__name__}: {error}"[:300])

    for label, dtype in (() if device == "cpu" else
                         (("no host sync fp32", None), ("no host sync bf16", torch.bfloat16))):
        _step(cuda_layer, xg, gg, dtype)     # warm up: lazy inits may synchronise once
        torch.cuda.synchronize()
        found = host_sync_in(lambda: _step(cuda_layer, xg, gg, dtype), xg.device)
        record(label, found is None, f"at {found}" if found else "")

    try:
        if name in _NOISY:
            cuda_layer.eval()
        torch._dynamo.reset()
        compiled = torch.compile(cuda_layer, fullgraph=True)
        y_e, gx_e, g_e = _step(cuda_layer, xg, gg)
        y_c, gx_c, g_c = _step(compiled, xg, gg)
        ok, worst = True, 0.0
        for a, b in [(y_c, y_e), (gx_c, gx_e)] + [(g_c[k], g_e[k]) for k in g_e if k in g_c]:
            good, err = _close(a, b, 1e-3)
            ok, worst = ok and good, max(worst, err)
        record("compile fullgraph", ok, f"max abs err vs eager {worst:.2e}")
    except Exception as error:
        record("compile fullgraph", False, f"{type(error).__name__}: {str(error).splitlines()[0]}"[:300])
    finally:
        torch._dynamo.reset()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--layers", help="comma-separated layer names (default: all)")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device")
        return 2
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"gpu_check: {where}, torch {torch.__version__}")
    results = []
    configs = layer_configs(args.d_model)
    for name in args.layers.split(",") if args.layers else configs:
        check_layer(name, configs[name], args.tokens, results, args.device)
    failed = [r for r in results if not r["ok"]]
    print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
