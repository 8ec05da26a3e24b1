"""Building and loading the fused CPU kernels (``*.c`` beside this file) on first use.

The shared library is built with the system C compiler (``$CC`` or ``cc``) the first time a
kernel is asked for, into ``$SPARSEFFN_CACHE_DIR`` (default ``~/.cache/sparseffn``), keyed
by a hash of the sources, the flags and the machine, written atomically, by one process at
a time (a file lock: the others wait and load it). Without a compiler, a BLAS ``sgemm_`` in
PyTorch, or on another OS, :func:`available` is False (the reason is in
:func:`unavailable_reason`) and the operators run their PyTorch implementations.
``SPARSEFFN_NO_NATIVE=1`` in the environment when sparseffn is imported turns the kernels
off; :func:`set_native_enabled` does so at run time.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from ...runtime import assume_constant_result
from .abi import declare

_SOURCES = [Path(__file__).with_name(name) for name in ("cvmm_cpu.c", "fff_cpu.c", "rows_cpu.c",
                                                              "pairs_cpu.c")]
# included by the sources: part of the build's hash, not compiled on their own
_HEADERS = [Path(__file__).with_name(name) for name in ("bf16.h", "bf16_gemm.h")]
# -ffp-contract=off: no multiply-add fused into an FMA behind the sources' back (GCC's -std=c99
# implies it, Clang's default does not), so a kernel's sums round as its source reads, the same
# bits with either compiler (the row kernels' sums are tested bit for bit against PyTorch's).
# -fno-trapping-math: no kernel reads floating-point exception flags, and without it GCC 12
# cannot turn a select whose arms could trap into a vector blend, so the loops that call the
# tree's sigmoid (fff_cpu.c) ran one float at a time; values are unchanged (same operations,
# same rounding, no reassociation).
_FLAGS = ["-O3", "-fPIC", "-shared", "-fopenmp", "-std=c99", "-ffp-contract=off",
          "-fno-trapping-math"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_bf16 = False       # MKL's bf16 GEMM was found: the CVMM kernels take bf16 too
# Read once, at import: every operator asks, and an environment lookup costs about 0.6 µs.
_ENV_OFF = bool(os.environ.get("SPARSEFFN_NO_NATIVE"))
_enabled = not _ENV_OFF


def set_native_enabled(enabled: bool) -> None:
    """Allow (True) or forbid (False) the fused CPU kernels in this process
    (``SPARSEFFN_NO_NATIVE`` at import forbids them whatever this says)."""
    global _enabled
    _enabled = bool(enabled) and not _ENV_OFF


def native_enabled() -> bool:
    return _enabled


def available() -> bool:
    """True when the fused kernels are built and loaded (building them if needed)."""
    return _enabled and _loaded()


@assume_constant_result
def _loaded() -> bool:
    """Whether the library is loaded, building and loading it on the first call; after that
    call, a constant of the process. ``torch.compile`` runs it, rather than tracing it, where
    it traces a call of :func:`available` (a layer choosing its kernel in Python, as the tree
    router and the inference of a few tokens do): its lock cannot be traced, so a layer
    compiled before any kernel had run broke its graph there, and ``fullgraph=True`` failed.
    ``_enabled`` stays a global the compiled code is guarded on."""
    return _load() is not None


def bf16_available() -> bool:
    """True when the CVMM kernels also take bfloat16 (PyTorch's BLAS is MKL, which has a bf16
    GEMM accumulating in float32)."""
    return available() and _bf16


def bf16_gemm() -> str | None:
    """Which GEMM the CVMM kernels' bf16 products run on: ``"avx512_bf16"`` (the kernels' own,
    ``bf16_gemm.h``: built for AVX-512 BF16 and run on an AMD CPU, where MKL's bf16 GEMM runs
    at its float32 speed), ``"mkl"``, or None without bf16 kernels."""
    if not bf16_available():
        return None
    return "avx512_bf16" if _load().sf_own_bf16_gemm() else "mkl"


def unavailable_reason() -> str | None:
    """Why :func:`available` is False, or None."""
    if not native_enabled():
        return "disabled (set_native_enabled(False) or SPARSEFFN_NO_NATIVE)"
    _load()
    return _reason


def _cache_dir() -> Path:
    root = os.environ.get("SPARSEFFN_CACHE_DIR")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "sparseffn"


def _machine_tag() -> str:
    """The CPU the library is built for (-march=native makes it machine specific)."""
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags")):
                    model += line
    except OSError:
        pass
    return model


def _build_once(compiler: str, flags: list[str], out: Path) -> None:
    """Build ``out`` unless it exists, one process at a time: pytest-xdist workers and
    torchrun ranks on a fresh machine all ask at once, and each would otherwise run the
    compiler (11 s on a slow two-core machine). An exclusive ``flock`` on ``out.lock`` beside
    it serialises them; who waited finds the library built. OSError where the folder is not
    writable."""
    import fcntl   # Linux only, as the kernels are
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # released when the file closes
        if not out.exists():
            _compile(compiler, flags, out)


def _compile(compiler: str, flags: list[str], out: Path) -> None:
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        cmd = [compiler, *flags, *map(str, _SOURCES), "-o", str(tmp_out)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"`{' '.join(cmd)}` failed:\n{proc.stderr.strip()[-2000:]}")
        os.replace(tmp_out, out)   # atomic: concurrent builders never see half a file


def _find_blas() -> tuple[int, int | None, int | None]:
    """Addresses of the Fortran ``sgemm_`` PyTorch uses, MKL's per-thread thread count and
    MKL's ``gemm_bf16bf16f32`` (bf16 operands, float32 accumulation and output; None where
    PyTorch's BLAS is not MKL: bf16 then takes the PyTorch path)."""
    lib_dir = Path(torch.__file__).parent / "lib"
    for name in ("libtorch_cpu.so", "libtorch_cpu.dylib", "libtorch.so"):
        path = lib_dir / name
        if not path.exists():
            continue
        lib = ctypes.CDLL(str(path))
        try:
            sgemm = ctypes.cast(lib.sgemm_, ctypes.c_void_p).value
        except AttributeError:
            continue
        return sgemm, _symbol(lib, "MKL_Set_Num_Threads_Local"), _symbol(lib, "gemm_bf16bf16f32")
    raise RuntimeError("this PyTorch build exports no BLAS sgemm_")


def _symbol(lib: ctypes.CDLL, name: str) -> int | None:
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except AttributeError:
        return None


def _load() -> ctypes.CDLL | None:
    global _lib, _reason, _bf16
    if _lib is not None or _reason is not None:
        return _lib
    with _lock:
        if _lib is not None or _reason is not None:
            return _lib
        if not sys.platform.startswith("linux"):   # not an error: the PyTorch path runs
            _reason = "the fused kernels are built on Linux only"
            return None
        try:
            compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
            if not compiler:
                raise RuntimeError("no C compiler found (set CC or install gcc)")
            flags = [*_FLAGS, "-march=native"] if platform.machine() in ("x86_64", "AMD64") \
                else list(_FLAGS)
            key = hashlib.sha256(
                b"".join(src.read_bytes() for src in [*_SOURCES, *_HEADERS])
                + repr((flags, compiler, _machine_tag())).encode()
            ).hexdigest()[:16]
            name = f"sparseffn_cpu-{key}.so"
            path = _cache_dir() / name
            if not path.exists():
                try:
                    _build_once(compiler, flags, path)
                except OSError:   # cache dir not writable: build into the temp dir instead
                    path = Path(tempfile.gettempdir()) / f"sparseffn-{os.getuid()}" / name
                    _build_once(compiler, flags, path)
            sgemm, local, gemm_bf16 = _find_blas()
            lib = ctypes.CDLL(str(path))
            declare(lib)
            lib.sf_init(ctypes.c_void_p(sgemm), ctypes.c_void_p(local) if local else None,
                        ctypes.c_void_p(gemm_bf16) if gemm_bf16 else None)
            _bf16 = gemm_bf16 is not None
            _lib = lib
        except (OSError, RuntimeError) as err:
            _reason = str(err)
            warnings.warn(f"sparseffn: fused CPU kernels unavailable, using the PyTorch path "
                          f"({_reason})", RuntimeWarning, stacklevel=3)
    return _lib


