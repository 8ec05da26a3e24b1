"""How wide the global memory accesses of the Triton kernels of a training step are on a GPU,
read off their PTX, on a machine without one.

Runs one forward+backward of an LM preset's FFN layer (the byte LM of ``bench lm``: d_model
256, parameter-matched to a dense d_ff of 2048) on the CPU with the Triton kernels in Triton's
interpreter, records every kernel launch with its arguments, and compiles each distinct
launch for a CUDA architecture (sm_90, the H100, by default) with the specialisation those
arguments get on a GPU (integers and pointers divisible by 16). For each kernel it counts the
global loads, stores and asynchronous copies in the PTX by the bytes one instruction moves:
a kernel that moves its tiles 2 bytes at a time where it could move 16 issues eight times the
memory instructions and, for asynchronous copies, cannot pipeline them.

Beside the widths it prints what each kernel asks of an SM, from ``cuobjdump -res-usage`` on
its cubin: registers a thread, bytes a thread spills to local memory, shared memory a program,
and which tensor-core instructions its products use (``wgmma``, Hopper's warp-group products,
or ``mma.sync``, the older warp-level ones that reach about half an H100's rate).

These are static instruction counts (a loop body counts once), not timings; they say which
kernels move data in narrow accesses, spill or miss the Hopper products, not how long those
take. The launches are compiled with each autotuned kernel's untuned tile
(``SPARSEFFN_TRITON_AUTOTUNE=0``), or with every candidate tile under ``--all-tiles``.

    python scripts/ptx_memory_ops.py --lm sigma_moe,pkm
    python scripts/ptx_memory_ops.py --lm sigma_moe --no-padding   # before the hidden padding
    python scripts/ptx_memory_ops.py --lm '' --fig2 512             # bench fig2's σ-MoE
    python scripts/ptx_memory_ops.py --lm sigma_moe --all-tiles     # every autotuned tile
    python scripts/ptx_memory_ops.py --lm sbase,pkm --bf16          # compiled in bf16
    python scripts/ptx_memory_ops.py --lm sigma_moe --bf16 --weight-grad-splits 5   # split-K

Needs Triton (``pip install -e '.[gpu]'``). The step is recorded in fp16 (the interpreter has
no bf16; both are 2 bytes); ``--bf16`` compiles every launch with bf16 where it recorded fp16,
as the layers run under bf16 autocast on a GPU, so a kernel that Triton cannot compile for
bf16 on that architecture fails here rather than on a lent GPU.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile

# Recording runs the kernels in Triton's interpreter; compiling needs real JIT functions, so it
# runs in a child process without it (the variable is read when triton is imported).
_COMPILING = "--compile" in sys.argv
os.environ["TRITON_INTERPRET"] = "0" if _COMPILING else "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import torch  # noqa: E402

import sparseffn  # noqa: E402
from sparseffn.bench.measure import forward_backward_fn  # noqa: E402
from sparseffn.bench.lm_step import lm_ffn  # noqa: E402
from sparseffn.ops import (triton_cvmm, triton_plan, triton_rows, triton_sinkhorn,  # noqa: E402
                           triton_tree)

_ACCESS = re.compile(r"^(?:@!?%p\d+\s+)?(ld\.global|st\.global|cp\.async\.c[ag]\.shared\.global)"
                     r"([.\w:]*)\s+(.*);")


def access_widths(ptx: str) -> dict[str, collections.Counter]:
    """{"load" | "store" | "async copy": Counter(bytes per instruction -> instructions)} of
    the global memory instructions in ``ptx``."""
    found: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for line in ptx.splitlines():
        match = _ACCESS.match(line.strip())
        if not match:
            continue
        op, suffix, operands = match.groups()
        if op.startswith("cp.async"):   # cp.async [dst], [src], cp-size{, src-size}
            found["async copy"][int(operands.split(",")[2].strip(), 0)] += 1
            continue
        vector = re.search(r"\.v(\d)", suffix)
        bits = re.search(r"\.[bufs](\d+)", suffix)
        width = (int(vector.group(1)) if vector else 1) * int(bits.group(1)) // 8
        found["load" if op == "ld.global" else "store"][width] += 1
    return found


def _kernels() -> dict[str, object]:
    """Every Triton kernel of the kernel modules, by name (autotuned ones included)."""
    import triton
    from triton.runtime.interpreter import InterpretedFunction   # what @triton.jit makes there
    kinds = (triton.runtime.JITFunction, triton.runtime.Autotuner, InterpretedFunction)
    found = {}
    for module in (triton_cvmm, triton_plan, triton_rows, triton_sinkhorn, triton_tree):
        for name, value in vars(module).items():
            if isinstance(value, kinds) and name.endswith("_kernel"):
                found[name] = (module, value)
    return found


def _tiles(name: str, every: bool = False) -> list[dict]:
    """The block sizes and launch options of an autotuned kernel: the one it has without
    autotuning (``SPARSEFFN_TRITON_AUTOTUNE=0``), or with ``every`` all its autotuning
    candidates (each one it may pick on a GPU)."""
    if name == "_cvmm_row_tile_kernel":
        rows = triton_cvmm._ROW_TILES if every else [triton_cvmm.ROW_TILE_UNTUNED]
        return [dict(BLOCK_M=m, BLOCK_N=n, num_warps=warps, num_stages=stages)
                for m, n, warps, stages in rows]
    if name == "_cvmm_kernel":
        tiles = triton_cvmm._CVMM_TILES if every else [triton_cvmm.CVMM_UNTUNED]
    else:
        tiles = triton_cvmm._WEIGHT_GRAD_TILES if every else [triton_cvmm.WEIGHT_GRAD_UNTUNED]
    return [dict(BLOCK_M=m, BLOCK_N=n, BLOCK_K=k, num_warps=warps, num_stages=stages)
            for m, n, k, warps, stages in tiles]


class LaunchRecorder:
    """Replaces each kernel of :func:`_kernels` by a proxy that records ``(name, args,
    kwargs)`` at every launch and then launches it (in the interpreter)."""

    def __init__(self):
        self.launches: list[tuple[str, tuple, dict]] = []
        self._saved = []

    def __enter__(self):
        recorder = self
        for name, (module, kernel) in _kernels().items():
            class Proxy:
                def __getitem__(self, grid, _kernel=kernel, _name=name):
                    launch = _kernel[grid]

                    def run(*args, **kwargs):
                        recorder.launches.append((_name, args, kwargs))
                        return launch(*args, **kwargs)
                    return run
            self._saved.append((module, name, kernel))
            setattr(module, name, Proxy())
        return self

    def __exit__(self, *exc):
        for module, name, kernel in self._saved:
            setattr(module, name, kernel)


def describe(value):
    """A launch argument as JSON: a tensor by its dtype and 16-byte alignment (all that
    specialises a kernel), anything else as it is."""
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype).replace("torch.", ""),
                "aligned": value.data_ptr() % 16 == 0}
    return value


def rebuild(value):
    """A stand-in argument for :func:`describe`'s description: a CPU tensor of that dtype,
    16-byte aligned or not."""
    if isinstance(value, dict):
        base = torch.empty(64, dtype=getattr(torch, value["dtype"]))
        return base if value["aligned"] else base[1:]   # one element on: not 16-byte aligned
    return value


def compile_launch(name: str, args: tuple, kwargs: dict, arch: int, tile: dict | None = None):
    """The kernel ``name`` compiled for sm_<arch> as these arguments specialise it on a GPU
    (an autotuned kernel with ``tile``, by default its untuned one)."""
    import triton
    kernel = _kernels()[name][1]
    kwargs = dict(kwargs)
    if isinstance(kernel, triton.runtime.Autotuner):
        kwargs.update(tile or _tiles(name)[0])
        kernel = kernel.fn
    return compile_kernel(kernel, args, kwargs, arch)


def compile_kernel(kernel, args: tuple, kwargs: dict, arch: int):
    """A ``@triton.jit`` kernel compiled for sm_<arch> as a launch with these arguments and
    launch options (``num_warps`` ...) would compile it on a GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    constexpr_names = {p.name for p in kernel.params if p.is_constexpr}
    # launch options (num_warps, num_stages ...) too: left out, every kernel compiled with
    # Triton's defaults (4 warps, 3 stages) whatever its launch or autotuning tile asked for
    option_names = set(backend.parse_options({}).__dict__)
    plain = {k: v for k, v in kwargs.items()
             if k in constexpr_names or k in bound or k in option_names}
    options, signature, constexprs, attrs = kernel._pack_args(backend, plain, bound,
                                                              specialization, options)
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def _key(name: str, args: list, kwargs: dict) -> str:
    """What decides a launch's specialisation: dtypes, alignment, 16-divisibility, flags."""
    def part(a):
        if isinstance(a, int) and not isinstance(a, bool):
            return ["int", a % 16 == 0, a == 1]
        return a
    return json.dumps([name, [part(a) for a in args], sorted(kwargs.items())])


def _cell(counter: collections.Counter) -> str:
    return " ".join(f"{count}x{width}B" for width, count in sorted(counter.items())) or "-"


def as_bf16(value):
    """A :func:`describe`'d argument with bf16 in place of fp16."""
    if isinstance(value, dict) and value.get("dtype") == "float16":
        return {**value, "dtype": "bfloat16"}
    return value


def report(preset: str, build, tokens: int, arch: int, padding: bool,
           all_tiles: bool = False, bf16: bool = False) -> int:
    """Print the table for the layer ``build()`` makes (its launches compiled with bf16 for
    fp16 under ``bf16``); returns its kernels' 2-byte global loads and stores."""
    expert_mlp = importlib.import_module("sparseffn.ops.expert_mlp")
    saved_multiple = expert_mlp.HIDDEN_MULTIPLE
    if not padding:
        expert_mlp.HIDDEN_MULTIPLE = 1
    try:
        torch.manual_seed(0)
        layer = build().half().train()
        x = torch.randn(tokens, layer.config.d_model).half()
        step = forward_backward_fn(layer, x, sparseffn.aux_loss)
        with LaunchRecorder() as recorder:
            step()
    finally:
        expert_mlp.HIDDEN_MULTIPLE = saved_multiple
    distinct: dict[str, list] = {}
    cast = as_bf16 if bf16 else (lambda value: value)
    for name, args, kwargs in recorder.launches:
        launch = [name, [cast(describe(a)) for a in args],
                  {k: cast(describe(v)) for k, v in kwargs.items()}]
        distinct.setdefault(_key(*launch), launch)
    print(f"\n{preset}: {len(recorder.launches)} launches, {len(distinct)} distinct "
          f"(sm_{arch}, {'padded' if padding else 'unpadded'} hidden units"
          f"{', compiled in bf16' if bf16 else ''})", flush=True)
    child = subprocess.run([sys.executable, os.path.abspath(__file__), "--compile",
                            "--arch", str(arch), *(["--all-tiles"] if all_tiles else [])],
                           input=json.dumps(list(distinct.values())),
                           capture_output=True, text=True, check=False)
    if child.returncode:
        raise RuntimeError(f"compiling for sm_{arch} failed:\n{child.stderr[-3000:]}")
    print(f"  {'kernel':26s} {'loads':28s} {'stores':22s} {'async copies':16s} "
          f"{'mma':8s} {'regs':>4s} {'spill':>5s} {'smem':>6s} {'warps':>5s} {'stages':>6s}")
    narrow = 0
    for name, widths, used in json.loads(child.stdout):
        widths = {kind: collections.Counter({int(w): c for w, c in counts.items()})
                  for kind, counts in widths.items()}
        narrow += sum(widths.get(kind, {}).get(2, 0) for kind in ("load", "store"))
        print(f"  {name:26s} {_cell(widths.get('load', {})):28s} "
              f"{_cell(widths.get('store', {})):22s} {_cell(widths.get('async copy', {})):16s} "
              f"{used['mma']:8s} {_number(used['regs']):>4s} {_number(used['spill']):>5s} "
              f"{_number(used['smem']):>6s} {_number(used['warps']):>5s} "
              f"{_number(used['stages']):>6s}")
    return narrow


def _number(value) -> str:
    return "?" if value is None else str(value)


def resources(kernel) -> dict:
    """What one compiled kernel asks of an SM, and how it multiplies its tiles: ``mma``
    ("wgmma": Hopper's asynchronous warp-group products; "mma.sync": the older warp-level
    ones, about half the tensor-core rate on an H100; "-": no tensor-core product), ``regs``
    (registers a thread), ``spill`` (local-memory bytes a thread: registers spilled) and
    ``smem`` (dynamic shared memory a program, bytes), read with ``cuobjdump -res-usage``;
    ``warps`` and ``stages``, the launch options it was compiled with."""
    ptx = kernel.asm["ptx"]
    mma = ("wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "-")
    found = {"mma": mma, "regs": None, "spill": None, "smem": kernel.metadata.shared,
             "warps": kernel.metadata.num_warps, "stages": kernel.metadata.num_stages}
    match = re.search(r"REG:(\d+).*?LOCAL:(\d+)", cuobjdump(kernel, "-res-usage") or "")
    if match:
        found["regs"], found["spill"] = int(match.group(1)), int(match.group(2))
    return found


def cuobjdump(kernel, flag: str) -> str | None:
    """``cuobjdump <flag>`` (the copy that comes with Triton) on a compiled kernel's cubin; None
    where this Triton has no cuobjdump."""
    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([tool, flag, cubin.name], capture_output=True, text=True,
                              check=True).stdout


def compile_all(arch: int, all_tiles: bool = False) -> int:
    """The child process: compile the launches described on stdin, print their widths and
    resources as JSON on stdout."""
    import triton
    out = []
    for name, args, kwargs in json.load(sys.stdin):
        tuned = isinstance(_kernels()[name][1], triton.runtime.Autotuner)
        for tile in (_tiles(name, every=True) if all_tiles and tuned else [None]):
            kernel = compile_launch(name, tuple(rebuild(a) for a in args),
                                    {k: rebuild(v) for k, v in kwargs.items()}, arch, tile)
            label = name if tile is None else f"{name} {tuple(tile.values())}"
            out.append([label, access_widths(kernel.asm["ptx"]), resources(kernel)])
    json.dump(out, sys.stdout)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lm", default="sigma_moe",
                        help="LM presets, comma-separated (default sigma_moe; '' for none)")
    parser.add_argument("--fig2", default="",
                        help="d_models of bench fig2's σ-MoE (experts of 128), e.g. 512,2048")
    parser.add_argument("--tokens", type=int, default=16,
                        help="tokens in the step (16: a multiple of 16, as the LM's 16,384)")
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90)")
    parser.add_argument("--no-padding", action="store_true",
                        help="keep odd expert sizes unpadded (as before HIDDEN_MULTIPLE)")
    parser.add_argument("--all-tiles", action="store_true",
                        help="compile every autotuning candidate of the tiled kernels, not only "
                             "the untuned tile")
    parser.add_argument("--bf16", action="store_true",
                        help="compile with bf16 where the step (recorded in fp16) had fp16")
    parser.add_argument("--weight-grad-splits", type=int, default=None,
                        help="cut each expert's weight gradient into this many ranges while "
                             "recording (the CPU's heuristic picks 1; an H100 picks 5 at the "
                             "LM's shapes), so the split variant, which adds its parts in the "
                             "kernel, is compiled")
    parser.add_argument("--compile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile:
        return compile_all(args.arch, args.all_tiles)
    if importlib.util.find_spec("triton") is None:
        parser.error("needs Triton: pip install -e '.[gpu]'")
    triton_cvmm.set_interpreter_for_cpu(True)
    triton_cvmm.WEIGHT_GRAD_SPLITS = args.weight_grad_splits
    from sparseffn.bench.fig2 import fig2_sigma_moe
    layers = [(p, lambda p=p: sparseffn.build_layer(lm_ffn(p))) for p in args.lm.split(",") if p]
    layers += [(f"fig2 σ-MoE, d_model {d}", lambda d=int(d): fig2_sigma_moe(d))
               for d in args.fig2.split(",") if d]
    total = 0
    for name, build in layers:
        total += report(name, build, args.tokens, args.arch, not args.no_padding,
                        args.all_tiles, args.bf16)
    print(f"\n2-byte global loads and stores in all: {total}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
