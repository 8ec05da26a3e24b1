"""Timing and memory measurement shared by the benchmarks."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Generic, Iterable, Iterator, TypeVar

import torch
from torch import nn


def error_summary(error: BaseException, width: int = 200) -> str:
    """``Type: first line of the message`` (cut at ``width`` characters), or ``Type`` alone
    for an error without a message (a bare ``assert`` in a compiler), for a benchmark that
    reports a contender's failure in one line and goes on."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:width]}" if lines else type(error).__name__


_swallowed_interrupt = False


@contextlib.contextmanager
def keeping_swallowed_interrupts() -> Iterator[None]:
    """A context in which a Ctrl-C that Python dropped is kept for
    :func:`raise_swallowed_interrupt`.

    SIGINT raises KeyboardInterrupt wherever the main thread is. Compiling runs many weakref
    callbacks and finalizers, and an exception raised inside one of those cannot propagate:
    Python prints "Exception ignored in: ..." (``sys.unraisablehook``) and goes on. A
    ``bench lm`` stopped that way compiled and timed every model regardless (seen in a cold
    run of the suite). Inside this context the hook keeps such a KeyboardInterrupt instead of
    printing it, and the benchmarks raise it at their next boundary: before they prepare a
    model, and after each call they time."""
    global _swallowed_interrupt
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        global _swallowed_interrupt
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type,
                                                          KeyboardInterrupt):
            _swallowed_interrupt = True
        else:
            previous(unraisable)
    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        _swallowed_interrupt = False


def raise_swallowed_interrupt() -> None:
    """Raise KeyboardInterrupt if one was dropped since the last call (inside
    :func:`keeping_swallowed_interrupts`; nothing outside it)."""
    global _swallowed_interrupt
    if _swallowed_interrupt:
        _swallowed_interrupt = False
        raise KeyboardInterrupt


Item = TypeVar("Item")


class InterruptibleLoop(Generic[Item]):
    """A benchmark's items (configs, cases, widths, depths, models to prepare) iterated inside
    ``with`` the loop, which a Ctrl-C (SIGINT: also what ``timeout -s INT`` sends) after the
    first finished item ends: the ``with`` block is left, ``left`` holds the items not
    finished (the one cut short first), and the benchmark reports what it measured. During
    the first item nothing was measured and the KeyboardInterrupt goes through, as it does
    after the last one (the ``with`` block should hold just the loop).

    Each item first raises a Ctrl-C that Python dropped while the last one compiled
    (:func:`raise_swallowed_interrupt`; a no-op outside :func:`keeping_swallowed_interrupts`)::

        with InterruptibleLoop(configs) as loop:
            for config in loop:
                records += measure(config)
        if loop.left:
            print(f"{loop.cause}: not timed: {', '.join(map(str, loop.left))}")

    ``time_limit`` (seconds from the loop's first item) ends it the same way, without a
    signal, before an item that would likely end past the limit: one whose start is later
    than the limit less its estimated time, the longest item's so far, or with ``cost`` (an
    item's relative cost, such as a width), the most seconds per unit of cost so far times
    the item's cost. The first item always runs. A stop between items cannot land inside a
    compiler or a CUDA-graph recording, which a SIGINT can (on an H200, ``bench lm`` stopped
    while it prepared one model under CUDA graphs failed on the next model's first timed
    step, in PyTorch's CUDA-graph trees: "assert len(node.tensor_weakrefs) ==
    len(node.stack_traces)").
    """

    def __init__(self, items: Iterable[Item], time_limit: float | None = None,
                 cost: Callable[[Item], float] | None = None) -> None:
        self.items = list(items)
        self.finished = 0           # how many items the loop's body has finished
        self.left: list[Item] = []
        self.time_limit = time_limit
        self.out_of_time = False    # ended by time_limit, not by an interrupt
        self._cost = cost or (lambda item: 1.0)
        self._begun: float | None = None
        self._rate = 0.0            # the most seconds per unit of cost of an item finished

    @property
    def cause(self) -> str:
        """Why the loop ended early: "interrupted" or "time limit of S s"."""
        return f"time limit of {self.time_limit:g} s" if self.out_of_time else "interrupted"

    def __iter__(self) -> Iterator[Item]:
        if self._begun is None:
            self._begun = time.monotonic()
        for item in self.items[self.finished:]:
            raise_swallowed_interrupt()
            started = time.monotonic()
            if (self.finished and self.time_limit is not None and started - self._begun
                    + self._rate * self._cost(item) > self.time_limit):
                self.out_of_time, self.left = True, self.items[self.finished:]
                return
            yield item
            self._rate = max(self._rate, (time.monotonic() - started) / self._cost(item))
            self.finished += 1      # resumed: the body finished the item

    def __enter__(self) -> "InterruptibleLoop[Item]":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if kind is None or not issubclass(kind, KeyboardInterrupt):
            return False
        clear_leaked_python_dispatcher()
        if not 0 < self.finished < len(self.items):
            return False
        self.left = self.items[self.finished:]
        return True


def clear_leaked_python_dispatcher() -> None:
    """Undo what a Ctrl-C inside PyTorch's compiler can leave behind: landing between the
    entry and the exit of its Python dispatcher context, it leaves the dispatch key set for
    this thread with no dispatcher, and the next eager op fails PyTorch's internal assert "Hit
    PythonDispatcher dispatch key but PythonDispatcherTLS was not set" (seen once, in ``bench
    lm --compile default`` stopped while it compiled, on a loaded machine). Outside a
    compilation the key is never meant to be set."""
    key = torch._C.DispatchKey.PythonDispatcher
    if torch._C._dispatch_tls_is_dispatch_key_included(key):
        torch._C._dispatch_tls_set_dispatch_key_included(key, False)


def preparing_stopped(loop: InterruptibleLoop[str]) -> str:
    """The note of a benchmark whose ``loop`` over the models to prepare (build, compile,
    warm up) ended early: interrupted while it prepared the first of ``loop.left``, or at its
    time limit before it; those models are not timed."""
    where = "while" if not loop.out_of_time else "before"
    return (f"{loop.cause} {where} preparing {loop.left[0]}: not timed: "
            f"{', '.join(loop.left)}")


class RoundsInterrupted(Exception):
    """Ctrl-C (SIGINT: also what ``timeout -s INT`` sends) during the timed rounds of
    :func:`interleaved_times` after at least one whole round: ``times`` holds the whole
    rounds (the same count for every contender), ``rounds`` their number of ``repeats``."""

    def __init__(self, times: dict[str, list[float]], rounds: int, repeats: int) -> None:
        super().__init__(f"interrupted after {rounds} of {repeats} timed rounds")
        self.times, self.rounds, self.repeats = times, rounds, repeats


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 2,
                      device: torch.device | str | None = None,
                      keep_on_interrupt: bool = False) -> dict[str, list[float]]:
    """Milliseconds of each function per round, timed in rotation (one run of each per
    round) so that a slow spell of a noisy machine hits every contender alike. On a CUDA
    ``device`` each run is timed by CUDA events around it (the GPU's own time, synchronised).

    ``keep_on_interrupt``: a KeyboardInterrupt in a timed round after the first whole one
    raises :class:`RoundsInterrupted` with the whole rounds (the part-round is dropped), for
    a benchmark that reports what it measured before it was stopped; before that, the
    KeyboardInterrupt goes through."""
    timed = _cuda_ms if device is not None and torch.device(device).type == "cuda" else _wall_ms
    for _ in range(warmup):
        for fn in fns.values():
            fn()
            raise_swallowed_interrupt()
    times: dict[str, list[float]] = {name: [] for name in fns}
    rounds = 0
    try:
        for rounds in range(repeats):
            for name, fn in fns.items():
                times[name].append(timed(fn))
                raise_swallowed_interrupt()
    except KeyboardInterrupt:
        if not keep_on_interrupt or rounds == 0:
            raise
        raise RoundsInterrupted({name: ts[:rounds] for name, ts in times.items()},
                                rounds, repeats) from None
    return times


def times_kept_on_interrupt(fns: dict[str, Callable[[], object]], repeats: int, warmup: int,
                            device: torch.device | str | None,
                            stopped: str = "") -> tuple[dict[str, list[float]], str]:
    """:func:`interleaved_times`, keeping the whole rounds if interrupted in the timed ones
    (a KeyboardInterrupt before the first whole round goes through). Returns the times and
    ``stopped``, the benchmark's note of what was cut short, with the rounds' note added."""
    try:
        return interleaved_times(fns, repeats, warmup, device, keep_on_interrupt=True), stopped
    except RoundsInterrupted as cut:
        return cut.times, "; ".join(filter(None, [stopped, str(cut)]))


def _wall_ms(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _cuda_ms(fn: Callable[[], object]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def paired_ratio(numerator: list[float], denominator: list[float]) -> float:
    """Median over rounds of the per-round time ratio. Both runs of a round are adjacent in
    time, so this cancels the machine's drift better than a ratio of two medians."""
    return statistics.median(a / b for a, b in zip(numerator, denominator))


def verdict(ok: bool | None, why: str = "") -> str:
    """How a benchmark's target line ends: ``ok``, ``MISSED``, or ``n/a`` (with ``why``, where
    the run cannot tell)."""
    if ok is None:
        return "n/a" + (f" ({why})" if why else "")
    return "ok" if ok else "MISSED"


def autocast_dtype_of(name: str) -> torch.dtype | None:
    """The autocast dtype a benchmark's ``--dtype`` names: None (no autocast) for "float32"."""
    return None if name == "float32" else getattr(torch, name)


def dtype_name(autocast_dtype: torch.dtype | None) -> str:
    """The inverse of :func:`autocast_dtype_of`, for records: "float32" without autocast."""
    return "float32" if autocast_dtype is None else str(autocast_dtype).replace("torch.", "")


def describe_device(device: torch.device) -> str:
    """The GPU's name, or the CPU with its thread count, for a benchmark's header line."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu, {torch.get_num_threads()} threads"


def forward_fn(layer: nn.Module, x: torch.Tensor,
               autocast_dtype: torch.dtype | None = None) -> Callable[[], object]:
    """Inference forward (no autograd graph), under autocast with ``autocast_dtype``."""
    def run():
        with torch.no_grad(), torch.autocast(x.device.type, dtype=autocast_dtype,
                                             enabled=autocast_dtype is not None):
            return layer(x)
    return run


def new_graph_step(mode: str) -> None:
    """Under ``"reduce-overhead"``, start a new CUDA-graph step (the previous step's outputs
    may be overwritten); call it at the start of each training step."""
    if mode == "reduce-overhead":
        torch.compiler.cudagraph_mark_step_begin()


def raise_if_interrupted(error: BaseException) -> None:
    """Raise KeyboardInterrupt if ``error`` was raised while a KeyboardInterrupt was being
    handled (anywhere in its chain of causes and contexts): a Ctrl-C that a library's cleanup
    turned into another exception. PyTorch 2.9's Dynamo does that to a SIGINT that lands while
    it compiles a frame (its ``finally`` reads a variable the interrupted ``try`` never set:
    "UnboundLocalError: cannot access local variable 'tracer_output'"); a benchmark that
    reports a failing contender would otherwise time it eagerly and carry on."""
    chain, seen = [error], set()
    while chain:
        link = chain.pop()
        if link is None or id(link) in seen:
            continue
        seen.add(id(link))
        if isinstance(link, KeyboardInterrupt):
            raise KeyboardInterrupt from error
        chain += [link.__cause__, link.__context__]


def first_call_or_eager(step: Callable[[], object], make_eager: Callable[[], Callable[[], object]],
                        what: str) -> tuple[Callable[[], object], bool]:
    """Run ``step`` (a compiled step) twice; if it fails, report it and return the eager step
    ``make_eager()`` builds (only then). Returns (the step to time, whether it is the
    compiled one). Twice, because under ``"reduce-overhead"`` the first call warms up and the
    second records the CUDA graph: a step that cannot be captured (a host read or a copy from
    host memory in it, as in ScatterMoE) fails only at the second.

    Prints one line either way, with the seconds the two calls took: a benchmark that compiles
    every contender before timing any shows in its log how far it got if it is cut off. The
    line also counts the graphs Inductor compiled without CUDA graphs in those calls
    (``cudagraph_skips``: a CPU tensor or a host read in the step), which ``"reduce-overhead"``
    otherwise does silently; ``TORCH_LOGS=cudagraphs`` (``perf_hints`` on older releases) gives the
    reasons."""
    start = time.perf_counter()
    skipped_before = cudagraph_skips()
    try:
        for _ in range(2):
            step()
    except Exception as error:
        raise_if_interrupted(error)
        print(f"  {what}: does not compile ({error_summary(error, 160)}); timed eagerly",
              flush=True)
        torch._dynamo.reset()
        return make_eager(), False
    skipped = cudagraph_skips() - skipped_before
    print(f"  {what}: compiled in {time.perf_counter() - start:.0f} s"
          f"{skipped_graphs_note(skipped)}", flush=True)
    return step, True


def cudagraph_skips() -> int:
    """How many compiled graphs Inductor has run without CUDA graphs in this process."""
    from torch._dynamo.utils import counters
    return counters["inductor"]["cudagraph_skips"]


def skipped_graphs_note(skipped: int) -> str:
    """What a benchmark appends to a contender's line when ``skipped`` of its compiled graphs
    ran without CUDA graphs ("" for none)."""
    if not skipped:
        return ""
    return (f"; CUDA graphs skipped for {skipped} graph{'s' * (skipped != 1)} "
            f"(TORCH_LOGS=cudagraphs says why)")


def forward_backward_fn(layer: nn.Module, x: torch.Tensor, extra_loss=None,
                        autocast_dtype: torch.dtype | None = None,
                        autocast_cache: bool = True) -> Callable[[], object]:
    """Forward, then backward from a fixed random gradient of the output into the input and
    the parameters, as kernel benchmarks do (``out.backward(dout)``). ``extra_loss(layer)``
    (e.g. the auxiliary losses) is back-propagated with it; with ``autocast_dtype`` the
    forward runs under autocast. A layer that returns ``(output, loss)`` (the σ-MoE of
    Csordás et al.'s own code) is timed on its output.

    The output gradient is made once, in the output's dtype (bf16 under bf16 autocast, what
    the next layer's backward would hand over). A scalar loss ``(out.float() * dout).sum()``
    gives the same gradient but adds four passes over [tokens, d_model] to every contender's
    step (the float copy, the product, the sum and the product's backward): about 1 ms at
    32,768 tokens and d_model 2048 on an H100, more than half of the dense MLP of active
    width's memory traffic there.

    The gradient reaches a detached copy of ``x``, or ``x`` itself when it is a leaf that
    requires grad (for a caller that reads ``x.grad``). ``autocast_cache=False`` for steps
    captured as CUDA graphs, which must not keep autocast's cast weights between calls. Each
    call returns the layer's output."""
    if not (x.is_leaf and x.requires_grad):
        x = x.detach().requires_grad_(True)
    grad = torch.randn_like(x)
    grad_in: dict[torch.dtype, torch.Tensor] = {}

    def run():
        layer.zero_grad(set_to_none=True)
        x.grad = None
        with torch.autocast(x.device.type, dtype=autocast_dtype,
                            enabled=autocast_dtype is not None, cache_enabled=autocast_cache):
            out = layer(x)
            if isinstance(out, tuple):
                out = out[0]
            extra = extra_loss(layer) if extra_loss is not None else None
        if out.dtype not in grad_in:   # once: the output's dtype does not change
            grad_in[out.dtype] = grad.to(out.dtype)
        outputs, grads = [out], [grad_in[out.dtype]]
        if extra is not None and extra.requires_grad:
            outputs.append(extra)
            grads.append(None)
        torch.autograd.backward(outputs, grads)
        return out
    return run


def saved_bytes(layer: nn.Module, x: torch.Tensor, extra_loss=None) -> int:
    """Bytes kept for backward by one training forward, counted over distinct storages with
    ``torch.autograd.graph.saved_tensors_hooks`` (parameters included: every layer saves its
    weights too)."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    x = x.detach().requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
        if extra_loss is not None:
            out = out.sum() + extra_loss(layer)
    del out
    gc.collect()
    return sum(storages.values())


def host_sync_in(step: Callable[[], object], device: torch.device) -> str | None:
    """None when ``step()`` runs on the CUDA ``device`` without a host synchronisation, else
    the first one: ``file:line`` of the innermost frame in the sparseffn package (``?`` if
    none) and the error's first line. The step runs under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises at any operation that would wait
    for the device (what CUDA graphs cannot capture); warm the step up first, since lazy
    initialisation may synchronise once."""
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        return None
    except RuntimeError as error:
        package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        where = next((f"{os.path.relpath(f.filename, package)}:{f.lineno}"
                      for f in reversed(traceback.extract_tb(error.__traceback__))
                      if f.filename.startswith(package + os.sep) and f.filename != __file__),
                     "?")
        return f"{where}: {str(error).splitlines()[0][:150]}"
    finally:
        torch.cuda.set_sync_debug_mode(previous)
        torch.cuda.synchronize(device)


def write_json(records: list[dict], path: str) -> None:
    """Write atomically (temp file + rename)."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(records, f, indent=2)
    os.replace(tmp, path)


def cuda_peak_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes the CUDA allocator's peak rose during one call of ``fn`` above what was allocated
    before it (see :func:`peak_bytes` for the CPU)."""
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def peak_mib(fn: Callable[[], object], device: torch.device) -> float | None:
    """:func:`cuda_peak_bytes` in MiB on a CUDA device; None on other devices."""
    return cuda_peak_bytes(fn, device) / 2 ** 20 if device.type == "cuda" else None


def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak bytes of PyTorch CPU tensor memory allocated during one call of ``fn``, above what
    was allocated when it started (so parameters and inputs are not counted; memory the call
    leaves allocated, such as new gradients, is). Read from the profiler's allocation events;
    memory that C code mallocs itself is not seen."""
    from torch.profiler import ProfilerActivity, profile
    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    del result
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    total = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        total += event.nbytes()
        peak = max(peak, total)
    return peak


def kernel_script_device(parser, name: str) -> tuple[torch.device, str]:
    """The device of a kernel-timing script (``scripts/gpu_*_calls.py``) and how to name it:
    a CUDA device, or the CPU in Triton's interpreter (``TRITON_INTERPRET=1``, a check that
    the script works, not a measurement). Anything else is a ``parser.error``."""
    from ..ops import triton_cvmm
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            parser.error("no CUDA device (use --device cpu with TRITON_INTERPRET=1 to check "
                         "the script in Triton's interpreter)")
    else:
        if not triton_cvmm.interpreting():
            parser.error("--device cpu runs the kernels in Triton's interpreter: set "
                         "TRITON_INTERPRET=1")
        triton_cvmm.set_interpreter_for_cpu(True)
    if not triton_cvmm.triton_enabled():
        parser.error("Triton is not installed (or SPARSEFFN_TRITON=0)")
    where = (torch.cuda.get_device_name(device) if device.type == "cuda"
             else "CPU (Triton interpreter)")
    return device, where


def per_call_times(fns: dict[str, Callable[[], object]], rounds: int, calls: int,
                   device: torch.device | str | None = None) -> dict[str, list[float]]:
    """Per-round ms per call of each function: a loop of ``calls`` calls timed as one, in
    rotation (:func:`interleaved_times`), after one warm-up round (compile, autotune). For
    kernels too short to time one call at a time."""
    loops = {name: (lambda fn=fn: [fn() for _ in range(calls)]) for name, fn in fns.items()}
    times = interleaved_times(loops, rounds, warmup=1, device=device)
    return {name: [ms / calls for ms in per_round] for name, per_round in times.items()}


def capture_calls(fn: Callable[[], object], calls: int) -> Callable[[], None]:
    """``calls`` calls of ``fn`` recorded as one CUDA graph; returns the graph's replay.

    ``fn`` runs three times first on a side stream, as PyTorch's CUDA-graph notes prescribe:
    what cannot happen inside a capture (compiling and autotuning a Triton kernel, cuBLAS
    creating its workspace, the autograd engine's first use) happens there. A function that
    synchronises with the host or copies from host memory raises here, as the capture does.
    """
    if calls < 1:
        raise ValueError(f"calls must be at least 1, got {calls}")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return graph.replay     # the bound method keeps the graph (and its memory pool) alive


def graph_call_times(fns: dict[str, Callable[[], object]], rounds: int,
                     calls: dict[str, int], device: torch.device | str
                     ) -> tuple[dict[str, list[float]], dict[str, str]]:
    """Per-round ms per call of each function on a CUDA ``device``, its ``calls[name]`` calls
    captured as one CUDA graph (:func:`capture_calls`) and the replays timed in rotation
    (:func:`interleaved_times`): the device's own time per call, with none of the host's
    launch cost between kernels, as a step replayed by CUDA graphs (``torch.compile``'s
    ``"reduce-overhead"``) pays it.

    Returns (times, failures): a function that cannot be captured is left out of the times,
    and ``failures[name]`` says why (the error's first line)."""
    replays, failures = {}, {}
    for name, fn in fns.items():
        try:
            replays[name] = capture_calls(fn, calls[name])
        except Exception as error:   # a host read or copy in the function: report, go on
            torch.cuda.synchronize(device)
            first_line = (str(error).splitlines() or [""])[0][:160]
            failures[name] = f"{type(error).__name__}: {first_line}"
    times = interleaved_times(replays, rounds, warmup=1, device=device) if replays else {}
    per_call = {name: [ms / calls[name] for ms in ts] for name, ts in times.items()}
    return per_call, failures
