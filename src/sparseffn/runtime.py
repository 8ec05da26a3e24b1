"""Process-level settings: the CPU allocator's tuning, and deterministic algorithms.

glibc serves large allocations with mmap and unmaps them on free, so every training step
page-faults its big temporaries back in: a 64 MB gather measured 25 ms instead of 4 ms. The
``sparseffn`` command calls :func:`tune_cpu_allocator` at start-up so that its users get the
remedy without setting anything; library users can call it once themselves. Set
``SPARSEFFN_NO_ALLOCATOR_TUNING=1`` to leave the allocator alone.

:func:`deterministic_algorithms` turns on ``torch.use_deterministic_algorithms`` the way
``sparseffn train`` does (``train.deterministic``, on by default) and the benchmarks'
``--deterministic`` flag does. :func:`compiling_many` lets one function compile to more
versions than ``torch.compile`` keeps by default, as ``sparseffn compare`` (one model per
variant) and the benchmarks that compile one model per contender need.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
from typing import Iterator

# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_MAX = -4

_tuned: bool | None = None


def assume_constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)``: ``torch.compile`` calls ``fn`` where it
    traces a call of it and keeps the result as a constant of the graph. PyTorch's decorator
    imports Dynamo, which took 1.5 of the 4 s of ``import sparseffn`` in every process,
    compiling or not; this one sets the same mark (tests/test_runtime.py checks that it is
    still PyTorch's)."""
    fn._dynamo_marked_constant = True
    return fn


def tune_cpu_allocator() -> bool:
    """Keep freed memory in the process instead of returning it to the OS after every step.

    Serves large blocks from the heap (``M_MMAP_MAX = 0``) and never trims it
    (``M_TRIM_THRESHOLD = -1``), like a caching allocator. The process keeps its peak memory
    reserved; that is the price. (Trimming above 1 GiB of free space, as before, still
    returned the two 1 GiB dense gradients of a million-expert PEER to the OS on every step:
    its forward+backward took 950 ms in one run and 1,230 ms in the next; without trimming,
    607-622 ms in three runs.) Returns True when applied (glibc on Linux),
    False where it does not apply or was disabled. Idempotent.
    """
    global _tuned
    if _tuned is not None:
        return _tuned
    _tuned = False
    if os.environ.get("SPARSEFFN_NO_ALLOCATOR_TUNING") or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (e.g. musl): nothing to tune
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _tuned = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, -1)) \
        and bool(mallopt(_M_TOP_PAD, 64 << 20))
    return _tuned


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool, device) -> Iterator[None]:
    """``torch.use_deterministic_algorithms(enabled)`` inside the block for work on ``device``
    (a ``torch.device``), the previous setting after. On CUDA cuBLAS needs a fixed workspace
    for it (set here before first use unless the user set one), and the ops with no
    deterministic CUDA kernel warn instead of failing (reported in the warnings, not hidden)."""
    import torch
    previous = (torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled())
    if enabled and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(enabled)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])


COMPILE_MODES = ("none", "default", "reduce-overhead")


def check_compile_mode(mode: str) -> None:
    """A ValueError unless ``mode`` is one of :data:`COMPILE_MODES`: no compile, the default
    ``torch.compile``, or the compile with CUDA graphs."""
    if mode not in COMPILE_MODES:
        raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}, got {mode!r}")


def compiled(fn, mode: str, fullgraph: bool = False):
    """``fn`` (a module or a function) under ``torch.compile`` as ``mode`` says: ``"none"``
    gives ``fn`` itself, ``"default"`` the default compile, ``"reduce-overhead"`` the compile
    with CUDA graphs (start each step with ``torch.compiler.cudagraph_mark_step_begin()``).
    Shapes are static (``dynamic=False``): a function run at several shapes gets a graph
    specialised to each, as a user's fixed-shape step does, not one made dynamic at the second
    shape. ``fullgraph``: a graph break is an error rather than a split graph. Compile
    several models under :func:`compiling_many`."""
    import torch
    check_compile_mode(mode)
    if mode == "none":
        return fn
    return torch.compile(fn, mode=None if mode == "default" else mode, fullgraph=fullgraph,
                         dynamic=False)


# How many compiled versions of one function compiling_many lets torch.compile keep.
COMPILED_VERSIONS = 64


def compiling_many():
    """A context in which one function compiles to up to ``COMPILED_VERSIONS`` versions, and
    one more raises instead of running eagerly.

    ``torch.compile`` keeps at most ``torch._dynamo.config.recompile_limit`` versions of a
    function (8 by default) and runs it eagerly past that, with only a logged warning. The
    models of ``bench lm`` all run ``TransformerLM.loss``, a new version for each FFN, so the
    ninth model timed was the eager one while the benchmark called it compiled; the variants
    of ``sparseffn compare`` with ``train.compile`` are the same case."""
    import torch
    config = torch._dynamo.config
    limit = recompile_limit_name()
    fail = ("fail_on_recompile_limit_hit" if limit == "recompile_limit"
            else "fail_on_cache_limit_hit")
    return config.patch(**{name: value for name, value in ((limit, COMPILED_VERSIONS),
                                                           (fail, True))
                           if hasattr(config, name)})


def recompile_limit_name() -> str:
    """Dynamo's setting for the versions of a function it keeps: ``recompile_limit``, named
    ``cache_size_limit`` before PyTorch 2.7."""
    import torch
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


# Dynamo's setting that skips replaying a checkpointed function's side effects (PyTorch 2.10+)
_SKIP_REPLAY = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def checkpointed_sparse_layers_trace_in_one_graph() -> bool:
    """Whether this PyTorch's Dynamo can trace a sparse layer under a non-reentrant activation
    checkpoint without a graph break (with :func:`compiling_checkpointed_sparse_layers`):
    2.10 and later. Before, the checkpointed layer runs eagerly between two graphs, with the
    same results, and ``fullgraph=True`` fails there."""
    import torch
    return hasattr(torch._dynamo.config, _SKIP_REPLAY)


def compiling_checkpointed_sparse_layers():
    """A context in which ``torch.compile`` traces a non-reentrant activation checkpoint
    around sparse layers in one graph: it skips replaying the forward's side effects (a
    layer's aux-loss record and usage update) in the recomputation, as the layers do eagerly
    (docs/architecture.md, "Checkpointing inside torch.compile"). Without it the compiled
    block breaks its graph at each sparse layer and runs it eagerly. Process-wide while it
    lasts, so for code that owns every checkpointed block (the trainer's LM); nothing on a
    PyTorch without the setting."""
    import torch
    config = torch._dynamo.config
    return config.patch(**{_SKIP_REPLAY: True} if hasattr(config, _SKIP_REPLAY) else {})
