"""The package without Triton: it imports, reports the GPU kernels unavailable and trains every
layer on the PyTorch and C paths.

CI installs Triton (the kernels' interpreter tests need it), so this test hides it from a child
process (``sys.modules["triton"] = None`` makes ``import triton`` raise ImportError, as on a
machine where it is not installed) and runs there. A whole suite run that way passed (1,914
tests, the Triton tests skipped); this test keeps the import guards and the fallbacks honest
in every CI run at the cost of a few seconds.

The same holds for a Triton installed but unable to define the kernels: up to 3.3,
``@triton.autotune`` asks the GPU driver for a benchmarker as it decorates a kernel, and on a
machine without a GPU Triton 3.2 (PyTorch 2.6's) raises "0 active drivers" at import. The
second case makes ``triton.autotune`` raise that error in the child.
"""

import json
import subprocess
import sys

import pytest

# how the child makes Triton unusable before it imports sparseffn
_HIDE = {
    "not_installed": 'sys.modules["triton"] = None\n',
    "no_driver": ("import triton\n"
                  "def autotune(*args, **kwargs):   # Triton 3.2 on a machine without a GPU\n"
                  "    raise RuntimeError('0 active drivers ([]). There should only be one.')\n"
                  "triton.autotune = autotune\n"),
}

_CHILD = r"""
import importlib, json, pkgutil, sys
import torch
import sparseffn
from sparseffn.bench.compiled import layer_configs
from sparseffn.ops import triton_cvmm

modules = [m.name for m in pkgutil.walk_packages(sparseffn.__path__, "sparseffn.")
           if not m.name.endswith("__main__")]            # that one runs the command line
for name in modules:                              # no module imports triton unguarded
    importlib.import_module(name)
trained = {}
for name, config in layer_configs(32).items():
    torch.manual_seed(0)
    layer = sparseffn.build_layer(config).train()
    x = torch.randn(19, 32, requires_grad=True)
    y = layer(x)
    (y.square().mean() + sparseffn.aux_loss(layer)).backward()
    grads = [p.grad for p in layer.parameters() if p.grad is not None]
    trained[name] = (tuple(y.shape) == (19, 32) and bool(torch.isfinite(y).all())
                     and x.grad is not None and bool(torch.isfinite(x.grad).all())
                     and len(grads) > 0)
print(json.dumps({"triton_imported": sys.modules["triton"] is not None,
                  "reason": triton_cvmm.UNUSABLE_REASON,
                  "available": triton_cvmm.available(),
                  "enabled": triton_cvmm.triton_enabled(),
                  "modules": len(modules), "trained": trained}))
"""


@pytest.mark.parametrize("how", _HIDE)
def test_every_layer_trains_without_triton(how):
    if how == "no_driver":
        pytest.importorskip("triton")
    child = subprocess.run([sys.executable, "-c", "import sys\n" + _HIDE[how] + _CHILD],
                           capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    if how == "not_installed":
        assert not report["triton_imported"] and report["reason"] is None
    else:
        assert report["reason"].startswith("Triton ") and "0 active drivers" in report["reason"]
    assert report["available"] is False and report["enabled"] is False
    assert report["modules"] > 50
    assert report["trained"] and all(report["trained"].values()), report["trained"]
