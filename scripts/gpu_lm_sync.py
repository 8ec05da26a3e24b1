"""Check that a whole LM training step makes no host synchronisation on CUDA (not part of the
test suite: CI has no GPU).

    python scripts/gpu_lm_sync.py [--presets a,b] [--batch 8] [--fp32] [--device cuda]

For each FFN preset, the step of ``sparseffn bench lm`` (loss and auxiliary losses under bf16
autocast unless ``--fp32``, backward, the trainer's optimizers from
:func:`sparseffn.adam_optimizers`: fused Adam, SparseAdam for sparse tables) is run twice to warm
up, then once under ``torch.cuda.set_sync_debug_mode("error")``, which raises at the first
operation that would wait for the device. Prints one line per preset (the sparseffn frame that
synchronised, if one did) and exits 1 if any did. The GPU issue asks for this so that a step
can be captured by CUDA graphs; ``tests/layers/test_no_host_sync.py`` checks the layers' ops
on the CPU.
"""

from __future__ import annotations

import argparse
import sys

import torch

from sparseffn.bench.lm_step import byte_tokens, lm_model, training_step_fn
from sparseffn.bench.measure import error_summary, host_sync_in
from sparseffn.models import PRESETS


def check(preset: str, batch: int, dtype: torch.dtype | None, device: torch.device) -> str:
    """``"ok"``, or where the step synchronised and what it said."""
    step = training_step_fn(lm_model(preset, device=device), byte_tokens(batch, 256, device),
                            dtype)
    for _ in range(2):    # lazy initialisation (the optimizer's state) may synchronise once
        step()
    torch.cuda.synchronize(device)
    found = host_sync_in(step, device)
    return "ok" if found is None else f"SYNC at {found}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--fp32", action="store_true")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type != "cuda":
        sys.exit("gpu_lm_sync.py checks CUDA host synchronisation: give a CUDA --device")
    dtype = None if args.fp32 else torch.bfloat16
    failed = 0
    for preset in args.presets.split(","):
        try:
            result = check(preset, args.batch, dtype, device)
        except Exception as error:   # one failing preset does not hide the others
            result = f"FAILED {error_summary(error)}"
        failed += result != "ok"
        print(f"{preset:>12}: {result}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
