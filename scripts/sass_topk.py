"""Warp instructions per row of the product-key top-k kernels, read off their sm_90 SASS on a
machine without a GPU: the keyed kernel (``ops/triton_rows.py``) against the k-way merge it
replaced (kept in ``scripts/gpu_rows_calls.py`` for a GPU's A/B).

    python scripts/sass_topk.py [--shapes 62:32,38:8]

Each kernel is compiled as its launch at the LM's shapes (sub-keys a half : k; 65,536 rows)
compiles it, with its own block of rows and warps (``ptxas`` and ``cuobjdump`` come with
Triton; no device is needed). The keyed kernel is straight-line code apart from the rounds of
the exact selection that a block with a tie at the k-th sum takes, which random scores never
do: their loop is left out of the count. The merge loops over k rounds for each half and for
its grid: each loop's body counts times its trip count. Both counts include the exact branch's
straight code once (an overcount of a few hundred). ``SHFL`` counts the cross-lane shuffles of
the reductions and swaps. Counts are a proxy, not a time: ``gpu_session.sh rows`` times both.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys

# Compiling needs real JIT functions: Triton reads this when a kernel is decorated, so it is
# set before the kernel modules are imported (ptx_memory_ops sets it to "1" for recording).
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from sparseffn.ops import triton_rows   # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_rows_calls   # noqa: E402
import ptx_memory_ops   # noqa: E402

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass(kernel) -> list[tuple[int, str, str]]:
    """(address, opcode, text) of each instruction of a compiled kernel."""
    text = ptx_memory_ops.cuobjdump(kernel, "-sass")
    if text is None:
        raise RuntimeError("this Triton has no cuobjdump")
    code = []
    for match in _LINE.finditer(text):
        ins = re.sub(r"^@!?U?P\w+\s+", "", match.group(2).strip())
        code.append((int(match.group(1), 16), ins.split()[0].split(".")[0], ins))
    return code


def loops(code) -> list[tuple[int, int]]:
    """Address ranges closed by a backward branch, in program order."""
    found = []
    for addr, op, ins in code:
        target = re.search(r"0x([0-9a-f]+)", ins) if op == "BRA" else None
        if target and int(target.group(1), 16) < addr:
            found.append((int(target.group(1), 16), addr))
    return found


def launch_of(module, kernel_name: str, launcher, *args):
    """The (kernel, args, kwargs) that ``launcher(*args)`` passes to ``module.<kernel_name>``,
    recorded instead of launched."""
    launches = []
    kernel = getattr(module, kernel_name)

    class Record:
        def __getitem__(self, grid):
            return lambda *a, **kw: launches.append((a, kw))
    setattr(module, kernel_name, Record())
    try:
        launcher(*args)
    finally:
        setattr(module, kernel_name, kernel)
    return kernel, *launches[0]


def per_row(n: int, k: int, rows: int, module, kernel_name: str, launcher,
            rounds: int = 0, **options) -> tuple[float, float]:
    """Warp instructions and shuffles a row of the kernel ``launcher`` launches at n sub-keys a
    half: its straight code, plus its first loops' bodies ``rounds`` times each (the loops
    after them, the exact selection's rounds, are not run on random scores)."""
    kernel, args, kwargs = launch_of(module, kernel_name, launcher, torch.empty(rows, n),
                                     torch.empty(rows, n), k)
    code = sass(ptx_memory_ops.compile_kernel(kernel, args, dict(kwargs, **options), 90))
    found = loops(code)
    if len(found) < rounds:
        raise RuntimeError(f"expected {rounds} loops before the exact selection's, found "
                           f"{len(found)}")
    run, skipped = found[:rounds], found[rounds:]      # the skipped ones may nest

    def times(addr: int) -> int:
        if any(lo <= addr <= hi for lo, hi in skipped):
            return 0
        return k if any(lo <= addr <= hi for lo, hi in run) else 1
    counted = collections.Counter()
    for addr, op, _ in code:
        counted[op] += times(addr)
    scale = kwargs["num_warps"] / kwargs["BLOCK_R"]
    return sum(counted.values()) * scale, counted["SHFL"] * scale


def keyed(n: int, k: int, rows: int) -> tuple[float, float]:
    """The keyed kernel, straight-line code but for the exact selection, as on a GPU (with
    ``tl.topk`` where this Triton has it, not the interpreter's network)."""
    return per_row(n, k, rows, triton_rows, "_product_key_topk_kernel",
                   triton_rows._product_key_topk_launch, TL_TOPK=triton_rows._TL_TOPK)


def merge_before(n: int, k: int, rows: int) -> tuple[float, float]:
    """The k-way merge kernel it replaced: k rounds for each half and k for the merge."""
    return per_row(n, k, rows, gpu_rows_calls, "_merge_topk_before_kernel",
                   gpu_rows_calls._merge_topk_before, rounds=3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="62:32,38:8",
                        help="sub-keys a half : k, comma-separated (default: PKM's and PEER's)")
    parser.add_argument("--rows", type=int, default=65536)
    args = parser.parse_args()
    print(f"{'n:k':>6s} {'kernel':14s} {'warp instructions/row':>22s} {'SHFL/row':>9s}")
    for shape in args.shapes.split(","):
        n, k = (int(v) for v in shape.split(":"))
        for name, fn in (("merge before", merge_before), ("keyed", keyed)):
            total, shuffles = fn(n, k, args.rows)
            print(f"{shape:>6s} {name:14s} {total:22.0f} {shuffles:9.0f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
