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
import subprocess
import sys
import tempfile

# Compiling needs real JIT functions: Triton reads this when a kernel is decorated, so it is
# set before the kernel modules are imported (ptx_memory_ops sets it to "1" for recording).
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

from sparseffn.ops import triton_cvmm, triton_rows   # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpu_rows_calls   # noqa: E402
import ptx_memory_ops   # noqa: E402

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def sass(kernel) -> list[tuple[int, str, str]]:
    """(address, opcode, text) of each instruction of a compiled kernel."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        text = subprocess.run([tool, "-sass", cubin.name], capture_output=True, text=True,
                              check=True).stdout
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


def ops(code, lo: int = 0, hi: int = 1 << 62) -> collections.Counter:
    return collections.Counter(op for addr, op, _ in code if lo <= addr <= hi)


def keyed(n: int, k: int, rows: int) -> tuple[float, float]:
    """The keyed kernel at n sub-keys a half, with its launch's block and warps."""
    launches = []
    real = triton_rows._product_key_topk_kernel

    class Record:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((args, kwargs))
    triton_rows._product_key_topk_kernel = Record()
    try:
        triton_rows._product_key_topk_launch(torch.empty(rows, n), torch.empty(rows, n), k)
    finally:
        triton_rows._product_key_topk_kernel = real
    args, kwargs = launches[0]
    kwargs = dict(kwargs, TL_TOPK=triton_rows._TL_TOPK)    # as on a GPU, not interpreted
    code = sass(ptx_memory_ops.compile_kernel(real, args, kwargs, 90))
    per_row = kwargs["num_warps"] / kwargs["BLOCK_R"]
    straight = ops(code)
    for lo, hi in loops(code):      # the exact selection's rounds, not run
        straight -= ops(code, lo, hi)
    return sum(straight.values()) * per_row, straight["SHFL"] * per_row


def merge_before(n: int, k: int, rows: int) -> tuple[float, float]:
    """The k-way merge kernel it replaced, at the same shapes."""
    p2 = triton_cvmm.next_power_of_2
    held = max(p2(k) ** 2, p2(n))
    block_r, warps = max(1, min(8, 2048 // held)), max(1, held // 2048)
    a = torch.empty(rows, n)
    code = sass(ptx_memory_ops.compile_kernel(
        gpu_rows_calls._merge_topk_before_kernel,
        (a, a, torch.empty(rows, k, dtype=torch.int64), rows, n, n, k, k, k, n, n),
        dict(BLOCK_R=block_r, NA=p2(n), NB=p2(n), KA=p2(k), KB=p2(k), K=p2(k),
             BIG=float(torch.finfo(torch.float32).max / 4), num_warps=warps), 90))
    found = loops(code)
    if len(found) < 3:
        raise RuntimeError(f"expected the halves' and the merge's loops, found {found}")
    body = [ops(code, lo, hi) for lo, hi in found]
    in_loops = sum(sum(c.values()) for c in body)
    straight = sum(ops(code).values()) - in_loops        # includes the exact branch: an upper
    total = sum(sum(c.values()) * k for c in body[:3]) + straight      # bound of what runs
    shuffles = sum(c["SHFL"] * k for c in body[:3]) + ops(code)["SHFL"] - sum(
        c["SHFL"] for c in body)
    return total * warps / block_r, shuffles * warps / block_r


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
