"""``torch.compile(fullgraph=True)`` of a layer whose first call in the process is the compiled
one, on the CPU.

The fused C kernels are built and loaded on first use, under a lock that ``torch.compile``
cannot trace. The layers that choose a kernel in Python while being traced (the tree router's
expansion, the inference of a few tokens) asked for the library there, so in a process where no
kernel had run yet their graph broke at the lock and ``fullgraph=True`` raised. The other
tests cannot see this: by the time they compile, an earlier test has loaded the library. So
this one compiles in a child process and, before each layer, forgets the loaded library (the
next use goes through the loader and its lock again, reloading the built file).
"""

import json
import subprocess
import sys

_CHILD = r"""
import json
import torch
import sparseffn
from sparseffn.bench.compiled import layer_configs
from sparseffn.ops.native import build

results = {}
for name, config in layer_configs(32).items():
    for mode in ("train", "decode"):
        torch.manual_seed(0)
        layer = sparseffn.build_layer(config).train(mode == "train")
        tokens = 19 if mode == "train" else 2      # 2 tokens: the few-pairs inference path
        x = torch.randn(tokens, 32, requires_grad=mode == "train")
        torch._dynamo.reset()    # layers of one class share code: no recompile limit
        build._lib, build._reason = None, None   # as before any kernel ran in the process
        try:
            compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
            with torch.set_grad_enabled(mode == "train"):
                y = compiled(x)
            if mode == "train":
                y.square().mean().backward()
            with torch.no_grad():
                expected = layer(x)
            close = bool(torch.allclose(y.detach(), expected, rtol=1e-5, atol=1e-6)) \
                if mode == "decode" else bool(torch.isfinite(y).all())
            results[f"{name} {mode}"] = ("ok" if close else "wrong result",
                                         build._lib is not None)
        except Exception as error:
            results[f"{name} {mode}"] = (f"{type(error).__name__}: {str(error).splitlines()[0]}",
                                         build._lib is not None)
print(json.dumps(results))
"""


def test_layers_compile_in_one_graph_before_any_kernel_ran():
    child = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                           timeout=900)
    assert child.returncode == 0, child.stderr[-3000:]
    results = json.loads(child.stdout.strip().splitlines()[-1])
    failed = {name: why for name, (why, _) in results.items() if why != "ok"}
    assert len(results) >= 26 and not failed, failed
    # the loader ran while they compiled (the C kernels serve them on this CPU)
    assert all(results[f"{name} {mode}"][1] for name in ("tree", "fff_soft", "sigma_moe")
               for mode in ("train", "decode")), results
