"""What the benchmarks report when they are cut short or a contender fails.

A GPU stage runs them under ``timeout -s INT`` (scripts/gpu_session.sh): a benchmark stopped
while it still compiles, or in its timed rounds, must print and write what it measured, not
lose every number; a preset whose step raises must not stop the others. Interrupts are
raised from inside the steps here, where a SIGINT would land. `bench lm`, `fig2` and
`generate` keep whole timed rounds; `bench layers`, `routers`, `productkeys`, `compile`,
`onnx`, `distributed` and `tokenizers` keep whole configs, depths, cases, layers, process
counts and vocabulary sizes (one loop, `InterruptibleLoop`).
"""

import json
import os
import signal
import threading
import time

import pytest
import torch

from sparseffn import cli
from sparseffn.bench import (compiled, distributed, fig2, generation, layers, lm_step, measure,
                             product_keys,
                             tokenizers, tree_routers)
from sparseffn.bench.measure import (InterruptibleLoop, RoundsInterrupted, first_call_or_eager,
                                     interleaved_times, keeping_swallowed_interrupts,
                                     raise_if_interrupted, raise_swallowed_interrupt)

LM_SIZES = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--context", "8",
            "--batch", "2", "--d-ff", "256", "--device", "cpu"]


def interrupted_on_call(n: int, then=KeyboardInterrupt):
    """A step that raises ``then`` on its n-th call (1-based) and only then."""
    calls = []

    def step():
        calls.append(1)
        if len(calls) == n:
            raise then()
    return step


def interrupt(*args, **kwargs):
    """A stand-in for a benchmark's step that a SIGINT stops at once."""
    raise KeyboardInterrupt


def interrupt_where(monkeypatch, owner, name: str, stops) -> None:
    """Patch ``owner.name`` (a benchmark's step over configs, widths, depths or layers) to
    raise KeyboardInterrupt when ``stops(its first argument)``, and run as before otherwise."""
    original = getattr(owner, name)

    def patched(first, *args, **kwargs):
        if stops(first):
            raise KeyboardInterrupt
        return original(first, *args, **kwargs)
    monkeypatch.setattr(owner, name, patched)


def test_interleaved_times_keeps_the_whole_rounds_when_asked():
    fns = {"a": lambda: None, "b": interrupted_on_call(2 + 3)}   # 2 warm-up calls, round 3
    with pytest.raises(RoundsInterrupted) as cut:
        interleaved_times(fns, repeats=5, warmup=2, keep_on_interrupt=True)
    assert (cut.value.rounds, cut.value.repeats) == (2, 5)
    assert {name: len(ts) for name, ts in cut.value.times.items()} == {"a": 2, "b": 2}
    assert str(cut.value) == "interrupted after 2 of 5 timed rounds"
    # not asked, or before a whole round: the interrupt goes through
    with pytest.raises(KeyboardInterrupt):
        interleaved_times({"a": interrupted_on_call(3)}, repeats=5, warmup=0)
    with pytest.raises(KeyboardInterrupt):
        interleaved_times({"a": lambda: None, "b": interrupted_on_call(1)}, repeats=5,
                          warmup=0, keep_on_interrupt=True)
    with pytest.raises(KeyboardInterrupt):     # in the warm-up
        interleaved_times({"a": interrupted_on_call(1)}, repeats=5, warmup=1,
                          keep_on_interrupt=True)


class _InterruptedFinalizer:
    """An object whose finalizer gets the KeyboardInterrupt, as a SIGINT landing in a weakref
    callback or ``__del__`` during compilation does: Python cannot raise it from there."""

    def __del__(self):
        raise KeyboardInterrupt


def drop_an_interrupt():
    _InterruptedFinalizer()        # collected at once: the interrupt goes to the hook


def test_a_dropped_interrupt_is_kept_for_the_next_boundary(monkeypatch):
    reported = []
    monkeypatch.setattr("sys.unraisablehook", lambda unraisable: reported.append(
        unraisable.exc_type))
    with keeping_swallowed_interrupts():
        drop_an_interrupt()                        # nothing raised here...
        with pytest.raises(KeyboardInterrupt):     # ...but at the next boundary, once
            raise_swallowed_interrupt()
        raise_swallowed_interrupt()
        obj = type("Broken", (), {"__del__": lambda self: 1 / 0})()
        del obj                                    # other errors: reported as before
        assert reported == [ZeroDivisionError]
        drop_an_interrupt()                        # kept, then forgotten at the exit
    raise_swallowed_interrupt()
    drop_an_interrupt()                            # outside: Python's behaviour
    raise_swallowed_interrupt()
    assert reported == [ZeroDivisionError, KeyboardInterrupt]


def test_interleaved_times_raises_an_interrupt_dropped_in_a_timed_call():
    calls = []

    def dropping():
        calls.append(1)
        if len(calls) == 2 + 3:                    # 2 warm-ups, round 3
            drop_an_interrupt()
    with keeping_swallowed_interrupts(), pytest.raises(RoundsInterrupted) as cut:
        interleaved_times({"a": dropping, "b": lambda: None}, repeats=5, warmup=2,
                          keep_on_interrupt=True)
    assert cut.value.rounds == 2


def run_loop(items, body):
    """Iterate an :class:`InterruptibleLoop` over ``items`` running ``body(item)``; returns
    the loop and the items whose body finished."""
    done = []
    with InterruptibleLoop(items) as loop:
        for item in loop:
            body(item)
            done.append(item)
    return loop, done


def interrupt_at(stop):
    def body(item):
        if item == stop:
            raise KeyboardInterrupt
    return body


def test_an_interruptible_loop_ends_at_an_interrupt_after_its_first_item():
    loop, done = run_loop("abcd", interrupt_at("c"))
    assert (done, loop.left, loop.finished) == (["a", "b"], ["c", "d"], 2)
    loop, done = run_loop("abcd", interrupt_at("d"))          # in the last item: kept too
    assert (done, loop.left) == (["a", "b", "c"], ["d"])
    loop, done = run_loop("abcd", interrupt_at(None))
    assert (done, loop.left, loop.finished) == (list("abcd"), [], 4)


class FakeClock:
    """``time`` for :mod:`sparseffn.bench.measure` whose ``monotonic()`` moves only when a
    loop's body says how long its item took."""

    def __init__(self):
        self.now = 100.0

    def monotonic(self):
        return self.now

    def run(self, seconds, limit, cost=None):
        """An :class:`InterruptibleLoop` over ``seconds`` (item -> the seconds its body takes)
        with ``time_limit=limit`` and ``cost``; returns the loop and the items done."""
        done = []
        with InterruptibleLoop(seconds, time_limit=limit, cost=cost) as loop:
            for item in loop:
                self.now += seconds[item]
                done.append(item)
        return loop, done


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(measure, "time", clock)
    return clock


def test_an_interruptible_loop_stops_before_an_item_likely_to_end_past_its_time_limit(clock):
    seconds = {"a": 3.0, "b": 5.0, "c": 1.0, "d": 1.0, "e": 1.0}
    # c starts at 8 s; the longest item so far took 5: 13 > 12, so it is not begun
    loop, done = clock.run(seconds, 12.0)
    assert (done, loop.left, loop.out_of_time) == (["a", "b"], ["c", "d", "e"], True)
    assert loop.cause == "time limit of 12 s"
    loop, done = clock.run(seconds, 13.0)   # 13 is not past 13: c runs; d at 9 + 5 = 14 does not
    assert (done, loop.left) == (["a", "b", "c"], ["d", "e"])
    loop, done = clock.run(seconds, 0.5)    # the first item always runs
    assert (done, loop.left) == (["a"], ["b", "c", "d", "e"])
    loop, done = clock.run(seconds, 100.0)
    assert (done, loop.left, loop.out_of_time) == (list("abcde"), [], False)
    loop, done = clock.run(seconds, None)
    assert (done, loop.left, loop.out_of_time) == (list("abcde"), [], False)
    assert run_loop("abc", interrupt_at("b"))[0].cause == "interrupted"


def test_an_interruptible_loop_estimates_an_item_by_its_cost_when_given_one(clock):
    """Widths that take time in proportion: after 512 (2 s) and 1024 (4 s), 2048 is
    estimated at 8 s, the slowest rate so far (4 ms a unit) times its cost."""
    widths = {512: 2.0, 1024: 4.0, 2048: 8.0}
    # 2048 would start at 6 s and end at 14
    assert clock.run(widths, 13.0, cost=float)[1] == [512, 1024]
    assert clock.run(widths, 14.0, cost=float)[1] == [512, 1024, 2048]
    # without a cost, the estimate is the longest item (4 s): 2048 would have been begun
    assert clock.run(widths, 13.0)[0].left == []
    # the slowest rate counts: 512 at 3 s (5.9 ms a unit) makes 1024 an estimated 6 s
    assert clock.run({512: 3.0, 1024: 1.0}, 8.0, cost=float)[1] == [512]


def test_bench_lm_and_fig2_stop_at_their_time_limit_and_report_what_they_measured(
        tmp_path, capsys):
    path = tmp_path / "lm.json"
    assert cli.main(["bench", "lm", "--presets", "sigma_moe", "pkm", *LM_SIZES,
                     "--repeats", "2", "--time-limit", "1e-6", "--json", str(path)]) == 0
    (record,) = json.loads(path.read_text())
    assert record["preset"] == "dense" and record["rounds"] == 2
    out = capsys.readouterr().out
    assert ("bench lm: time limit of 1e-06 s before preparing sigma_moe: not timed: "
            "sigma_moe, pkm\n") in out
    path = tmp_path / "fig2.json"
    assert cli.main(["bench", "fig2", "--d-models", "128,256", *FIG2_SIZES,
                     "--time-limit", "1e-6", "--json", str(path)]) == 0
    (record,) = json.loads(path.read_text())
    assert record["d_model"] == 128 and record["rounds"] == 3 and "interrupted" not in record
    assert "bench fig2: time limit of 1e-06 s before d_model 256: not timed: 256" in \
        capsys.readouterr().out


def test_an_interruptible_loop_lets_through_what_it_cannot_keep():
    with pytest.raises(KeyboardInterrupt):                     # nothing measured yet
        run_loop("abc", interrupt_at("a"))
    with pytest.raises(ZeroDivisionError):                     # not an interrupt
        run_loop("abc", lambda item: item == "b" and 1 / 0)
    with pytest.raises(KeyboardInterrupt), InterruptibleLoop("ab") as loop:
        for _ in loop:
            pass
        raise KeyboardInterrupt                                # after the loop: not its own
    assert run_loop([], interrupt_at(None))[0].left == []


def test_an_interrupt_inside_a_compilation_leaves_eager_ops_working():
    """A Ctrl-C between the entry and the exit of PyTorch's Python dispatcher context (inside
    a compilation) leaves its dispatch key set, and every eager op after it failed an
    internal assert (seen once in ``bench lm --compile default``, interrupted): the loop
    clears it, whether it keeps the interrupt or lets it through."""
    key = torch._C.DispatchKey.PythonDispatcher

    def leaking(stop):
        def body(item):
            if item == stop:
                torch._C._dispatch_tls_set_dispatch_key_included(key, True)
                raise KeyboardInterrupt
        return body
    try:
        loop, _ = run_loop("abc", leaking("b"))
        assert loop.left == ["b", "c"]
        assert not torch._C._dispatch_tls_is_dispatch_key_included(key)
        assert torch.equal(torch.ones(2) + 1, torch.full((2,), 2.0))
        with pytest.raises(KeyboardInterrupt):
            run_loop("abc", leaking("a"))
        assert not torch._C._dispatch_tls_is_dispatch_key_included(key)
    finally:
        torch._C._dispatch_tls_set_dispatch_key_included(key, False)


def test_an_interruptible_loop_raises_a_dropped_interrupt_before_the_next_item():
    with keeping_swallowed_interrupts():
        loop, done = run_loop("abc", lambda item: item == "a" and drop_an_interrupt())
    assert (done, loop.left) == (["a"], ["b", "c"])


def interrupt_turned_into_an_error():
    """What PyTorch 2.9's Dynamo does with a SIGINT that lands while it compiles a frame:
    its ``finally`` reads a variable the interrupted ``try`` never set, and the
    UnboundLocalError replaces the KeyboardInterrupt (which stays as its context); Dynamo
    may wrap such an error again, ``from None``."""
    try:
        raise KeyboardInterrupt
    finally:
        try:
            raise UnboundLocalError("cannot access local variable 'tracer_output'")
        except UnboundLocalError as error:
            raise RuntimeError("InternalTorchDynamoError: wrapped") from error


def test_an_error_raised_while_an_interrupt_was_handled_is_the_interrupt():
    with pytest.raises(KeyboardInterrupt):
        try:
            interrupt_turned_into_an_error()
        except RuntimeError as error:
            raise_if_interrupted(error)
    try:                                     # the KeyboardInterrupt two links back, from None
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ValueError("cleanup failed") from None
    except ValueError as error:
        with pytest.raises(KeyboardInterrupt):
            raise_if_interrupted(error)
    for error in (RuntimeError("plain"), ValueError("with a cause")):
        error.__cause__ = TypeError("no interrupt anywhere")
        raise_if_interrupted(error)          # returns: a real failure is reported as before


def test_a_compile_stopped_by_an_interrupt_is_not_timed_eagerly():
    def make_eager():
        raise AssertionError("an interrupted compile fell back to the eager step")
    with pytest.raises(KeyboardInterrupt):
        first_call_or_eager(interrupt_turned_into_an_error, make_eager, "sigma_moe")
    step, compiled = first_call_or_eager(lambda: 1 / 0, lambda: "eager", "sigma_moe")
    assert (step, compiled) == ("eager", False)


def test_bench_lm_stops_preparing_when_an_interrupt_became_an_error(monkeypatch, tmp_path,
                                                                    capsys):
    """pkm's step raises the error PyTorch 2.9's Dynamo makes of a SIGINT: pkm is not
    reported as failed, and peer is not prepared; the models ready before are timed."""
    def interrupted(model):
        def loss(inputs, targets):
            interrupt_turned_into_an_error()
        return loss
    patched_lm_model(monkeypatch, "pkm", loss=interrupted)
    path = tmp_path / "lm.json"
    assert cli.main(["bench", "lm", "--presets", "sigma_moe", "pkm", "peer", *LM_SIZES,
                     "--repeats", "2", "--json", str(path)]) == 0
    assert [r["preset"] for r in json.loads(path.read_text())] == ["dense", "sigma_moe"]
    out = capsys.readouterr().out
    assert "bench lm: interrupted while preparing pkm: not timed: pkm, peer\n" in out
    assert "failed" not in out


def patched_lm_model(monkeypatch, preset: str, loss=None, build_raises=None):
    """bench lm's models, with ``preset``'s loss replaced by ``loss(model)`` or its building
    raising ``build_raises``."""
    original = lm_step.lm_model

    def lm_model(name, *args, **kwargs):
        if name == preset and build_raises is not None:
            raise build_raises()
        model = original(name, *args, **kwargs)
        if name == preset and loss is not None:
            model.loss = loss(model)
        return model
    monkeypatch.setattr(lm_step, "lm_model", lm_model)


def test_bench_lm_reports_a_failing_preset_and_times_the_others(monkeypatch, tmp_path, capsys):
    def broken(model):
        def loss(inputs, targets):
            raise RuntimeError("Triton: no kernel for sm_90\nsecond line")
        return loss
    patched_lm_model(monkeypatch, "pkm", loss=broken)
    path = tmp_path / "lm.json"
    assert cli.main(["bench", "lm", "--presets", "sigma_moe", "pkm", "peer", *LM_SIZES,
                     "--repeats", "2", "--json", str(path)]) == 0
    records = {r["preset"]: r for r in json.loads(path.read_text())}
    assert list(records) == ["dense", "sigma_moe", "pkm", "peer"]
    assert records["pkm"]["error"] == "RuntimeError: Triton: no kernel for sm_90"
    assert "ms" not in records["pkm"] and records["pkm"]["total_params"] > 0
    for name in ("dense", "sigma_moe", "peer"):
        assert records[name]["ms"] > 0 and records[name]["rounds"] == 2
    out = capsys.readouterr().out
    assert "  pkm: failed (RuntimeError: Triton: no kernel for sm_90); not timed" in out
    assert "failed: RuntimeError: Triton: no kernel for sm_90" in out        # the table's row
    assert "target: pkm / dense <= 1.5: failed (RuntimeError: " in out and "MISSED" in out
    assert "target: peer / dense <= 1.5: " in out


def test_bench_lm_reports_a_failure_without_a_message(monkeypatch, capsys):
    """A bare ``assert`` in a compiler raises an error with no message; reporting it must not
    itself fail (the first line of an empty message does not exist)."""
    def broken(model):
        def loss(inputs, targets):
            raise AssertionError
        return loss
    patched_lm_model(monkeypatch, "pkm", loss=broken)
    records = lm_step.run(["sigma_moe", "pkm"], d_model=32, n_layers=1, n_heads=2, context=8,
                          batch=2, d_ff=256, repeats=1)
    assert [(r["preset"], r.get("error")) for r in records] == [
        ("dense", None), ("sigma_moe", None), ("pkm", "AssertionError")]
    assert "  pkm: failed (AssertionError); not timed" in capsys.readouterr().out


def test_bench_lm_stops_when_dense_fails(monkeypatch):
    def broken(model):
        def loss(inputs, targets):
            raise RuntimeError("no baseline")
        return loss
    patched_lm_model(monkeypatch, "dense", loss=broken)
    with pytest.raises(RuntimeError, match="no baseline"):
        lm_step.run(["sigma_moe"], d_model=32, n_layers=1, n_heads=2, context=8, batch=2,
                    d_ff=256, repeats=1)


def test_bench_lm_interrupted_while_preparing_times_the_ready_models(monkeypatch, tmp_path,
                                                                     capsys):
    patched_lm_model(monkeypatch, "pkm", build_raises=KeyboardInterrupt)
    path = tmp_path / "lm.json"
    assert cli.main(["bench", "lm", "--presets", "sigma_moe", "pkm", "peer", *LM_SIZES,
                     "--repeats", "2", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [r["preset"] for r in records] == ["dense", "sigma_moe"]
    assert records[1]["over_dense"] > 0 and records[1]["rounds"] == 2
    out = capsys.readouterr().out
    assert "interrupted while preparing pkm: not timed: pkm, peer; timing the 2 ready" in out
    assert "bench lm: interrupted while preparing pkm: not timed: pkm, peer\n" in out
    assert "target: sigma_moe / dense <= 1.0: " in out
    patched_lm_model(monkeypatch, "dense", build_raises=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):       # nothing to compare with: stop
        lm_step.run(["sigma_moe"], d_model=32, n_layers=1, n_heads=2, context=8, batch=2,
                    d_ff=256, repeats=1)


def test_bench_lm_stops_before_the_next_preset_after_a_dropped_interrupt(monkeypatch, tmp_path,
                                                                      capsys):
    """A SIGINT while pkm compiled landed in a finalizer: pkm is timed (it got ready), peer
    is not. The suite's SIGINT test below failed this way once on CI: every preset timed."""
    def dropping(model):
        real, calls = model.loss, []

        def loss(inputs, targets):
            calls.append(1)
            if len(calls) == 1:                # its first step, run while it gets ready
                drop_an_interrupt()
            return real(inputs, targets)
        return loss
    patched_lm_model(monkeypatch, "pkm", loss=dropping)
    path = tmp_path / "lm.json"
    assert cli.main(["bench", "lm", "--presets", "sigma_moe", "pkm", "peer", *LM_SIZES,
                     "--repeats", "2", "--json", str(path)]) == 0
    assert [r["preset"] for r in json.loads(path.read_text())] == ["dense", "sigma_moe", "pkm"]
    assert "bench lm: interrupted while preparing peer: not timed: peer\n" in \
        capsys.readouterr().out


def test_bench_lm_interrupted_in_its_rounds_keeps_the_whole_ones(monkeypatch, tmp_path, capsys):
    def stops_on_call(n):
        def loss(model):
            calls, real = [], model.loss

            def counted(inputs, targets):
                calls.append(1)
                if len(calls) == n:
                    raise KeyboardInterrupt
                return real(inputs, targets)
            return counted
        return loss
    # its step's calls: 1 to check it runs, 2 warm-ups, then rounds 1, 2 and (6) 3
    patched_lm_model(monkeypatch, "sigma_moe", loss=stops_on_call(6))
    path = tmp_path / "lm.json"
    assert cli.main(["bench", "lm", "--presets", "sigma_moe", "switch", *LM_SIZES,
                     "--repeats", "5", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["preset"], r["rounds"]) for r in records] == [
        ("dense", 2), ("sigma_moe", 2), ("switch", 2)]
    assert "bench lm: interrupted after 2 of 5 timed rounds\n" in capsys.readouterr().out


FIG2_SIZES = ["--tokens", "32", "--dtype", "float32", "--device", "cpu", "--repeats", "3"]


def test_bench_fig2_interrupted_at_a_later_width_keeps_the_earlier(monkeypatch, tmp_path,
                                                                   capsys):
    interrupt_where(monkeypatch, fig2, "bench_width", lambda d_model: d_model == 256)
    path = tmp_path / "fig2.json"
    assert cli.main(["bench", "fig2", "--d-models", "128,256,384", *FIG2_SIZES,
                     "--json", str(path)]) == 0
    (record,) = json.loads(path.read_text())
    assert record["d_model"] == 128 and record["rounds"] == 3 and "interrupted" not in record
    out = capsys.readouterr().out
    assert "bench fig2: interrupted at d_model 256: not timed: 256, 384" in out
    assert "target: sparseffn / dense_param <= " not in out     # no target at d_model 128
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(fig2, "bench_width", interrupted)
    with pytest.raises(KeyboardInterrupt):       # at the first width: nothing to report
        fig2.run([128], tokens=32, repeats=1, device="cpu", dtype="float32")


def test_bench_fig2_interrupted_while_preparing_peers_times_what_is_ready(monkeypatch, tmp_path,
                                                                          capsys):
    """An interrupt while a peer compiles (Liger's took minutes a width on an H100): σ-MoE and
    the dense MLPs are timed, that width ends the run and says so."""
    def interrupting(d_model, num_experts):
        raise KeyboardInterrupt
    monkeypatch.setattr(fig2, "portable_peer_builders",
                        lambda dtype=None, device="cpu": {"slow_peer": interrupting})
    path = tmp_path / "fig2.json"
    assert cli.main(["bench", "fig2", "--d-models", "128,256", *FIG2_SIZES, "--peers",
                     "--json", str(path)]) == 0
    (record,) = json.loads(path.read_text())
    assert list(record["ms"]) == ["sparseffn", "dense_param", "dense_active"]
    assert record["interrupted"] == "interrupted while preparing d_model 128's contenders"
    assert record["rounds"] == 3 and record["over_dense_param"]["sparseffn"] > 0
    out = capsys.readouterr().out
    assert "  d_model 128: interrupted while preparing d_model 128's contenders (timed " \
           "rounds: 3)" in out
    assert "bench fig2: not timed: 256" in out


def test_bench_fig2_stops_before_the_next_contender_after_a_dropped_interrupt(monkeypatch,
                                                                            tmp_path):
    """Dropped while the first peer got ready: it is timed, the second peer is not."""
    def dropping(d_model, num_experts):
        drop_an_interrupt()
        return torch.nn.Linear(d_model, d_model)

    def never(d_model, num_experts):
        raise AssertionError("prepared after the interrupt")
    monkeypatch.setattr(fig2, "portable_peer_builders",
                        lambda dtype=None, device="cpu": {"first": dropping, "second": never})
    path = tmp_path / "fig2.json"
    assert cli.main(["bench", "fig2", "--d-models", "128,256", *FIG2_SIZES, "--peers",
                     "--json", str(path)]) == 0
    (record,) = json.loads(path.read_text())
    assert list(record["ms"]) == ["sparseffn", "dense_param", "dense_active", "first"]
    assert record["interrupted"] == "interrupted while preparing d_model 128's contenders"


def test_bench_fig2_interrupted_before_dense_is_ready_stops(monkeypatch):
    original = fig2.timed_step

    def timed_step(module, *args, **kwargs):
        if isinstance(module, fig2.DenseMLP):
            raise KeyboardInterrupt
        return original(module, *args, **kwargs)
    monkeypatch.setattr(fig2, "timed_step", timed_step)
    with pytest.raises(KeyboardInterrupt):
        fig2.run([128], tokens=32, repeats=1, device="cpu", dtype="float32")


def test_bench_fig2_interrupted_in_its_rounds_keeps_the_whole_ones(monkeypatch, tmp_path,
                                                                   capsys):
    original = fig2.timed_step

    def timed_step(module, *args, **kwargs):
        step, ok = original(module, *args, **kwargs)
        if not isinstance(module, fig2.DenseMLP) or module.config.d_ff != 4 * 128:
            return step, ok
        stop = interrupted_on_call(3 + 2)     # 3 warm-up rounds, then the 2nd timed round

        def stepped():
            stop()
            return step()
        return stepped, ok
    monkeypatch.setattr(fig2, "timed_step", timed_step)
    path = tmp_path / "fig2.json"
    assert cli.main(["bench", "fig2", "--d-models", "128", *FIG2_SIZES, "--json",
                     str(path)]) == 0
    (record,) = json.loads(path.read_text())
    assert record["rounds"] == 1 and record["interrupted"] == \
        "interrupted after 1 of 3 timed rounds"
    assert torch.isfinite(torch.tensor(record["over_dense_param"]["sparseffn"]))
    assert "d_model 128: interrupted after 1 of 3 timed rounds (timed rounds: 1)" in \
        capsys.readouterr().out


def test_bench_layers_interrupted_at_a_later_config_keeps_the_earlier(monkeypatch, tmp_path,
                                                                     capsys):
    interrupt_where(monkeypatch, layers, "bench_config", lambda cfg: cfg.name == "b")
    path = tmp_path / "layers.json"
    assert cli.main(["bench", "layers", "--tokens", "32", "--repeats", "1", "--configs", "a",
                     "b", "c", "--json", str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["config"], r["pass"]) for r in records] == [("a", "forward"),
                                                           ("a", "forward_backward")]
    out = capsys.readouterr().out
    assert "bench layers: interrupted: not timed: config b, c" in out
    assert "routers at config a" not in out          # stopped: not started after the table
    monkeypatch.setattr(layers, "bench_config", interrupt)
    with pytest.raises(KeyboardInterrupt):           # in the first config: nothing to report
        layers.run(tokens=32, repeats=1, configs=["a", "b"])


def test_bench_layers_interrupted_in_the_routers_keeps_the_configs(monkeypatch, tmp_path,
                                                                   capsys):
    from sparseffn.bench import moe_routers
    monkeypatch.setattr(moe_routers, "bench_routers", interrupt)
    path = tmp_path / "layers.json"
    assert cli.main(["bench", "layers", "--tokens", "32", "--repeats", "1", "--configs", "a",
                     "--json", str(path)]) == 0
    assert [r["config"] for r in json.loads(path.read_text())] == ["a", "a"]
    assert "bench layers: interrupted: the routers not timed" in capsys.readouterr().out


def test_bench_routers_interrupted_in_a_later_depth_keeps_the_whole_depths(monkeypatch,
                                                                           tmp_path, capsys):
    def progress(line):          # called after each pass: depth 2's forward records are in
        if line.startswith("depth  2 forward "):
            raise KeyboardInterrupt
    with pytest.raises(tree_routers.DepthsInterrupted) as cut:
        tree_routers.bench_tree_routers([1, 2, 3], batch=8, dim=16, repeats=1,
                                        progress=progress)
    assert {r["depth"] for r in cut.value.records} == {1} and cut.value.left == [2, 3]
    assert {r["pass"] for r in cut.value.records} == {"forward", "forward_backward"}
    with pytest.raises(KeyboardInterrupt) as first:   # in the first depth: nothing to keep
        tree_routers.bench_tree_routers([1, 2], batch=8, dim=16, repeats=1, progress=interrupt)
    assert type(first.value) is KeyboardInterrupt

    interrupt_where(monkeypatch, tree_routers, "_bench_depth", lambda depth: depth == 3)
    path = tmp_path / "routers.json"
    assert cli.main(["bench", "routers", "--depths", "1-4", "--batch", "8", "--dim", "16",
                     "--repeats", "1", "--json", str(path)]) == 0
    assert {r["depth"] for r in json.loads(path.read_text())} == {1, 2}
    out = capsys.readouterr().out
    assert "bench routers: interrupted: not timed: depths 3, 4" in out and "Table 2" in out


def test_bench_productkeys_interrupted_in_a_later_case_reports_the_earlier(monkeypatch,
                                                                           tmp_path, capsys):
    monkeypatch.setattr(product_keys, "peer_1m", interrupt)
    path = tmp_path / "pk.json"
    assert cli.main(["bench", "productkeys", "--exponents", "6,7", "--scaling-tokens", "16",
                     "--tokens", "16", "--repeats", "1", "--cases", "scaling", "peer_1m",
                     "pkm", "--json", str(path)]) == 0
    assert {r["case"] for r in json.loads(path.read_text())} == {"scaling"}
    out = capsys.readouterr().out
    assert "bench productkeys: interrupted: not run: peer_1m, pkm" in out
    assert "scaling" in out.split("interrupted")[1]      # the table, after the line
    monkeypatch.setattr(product_keys, "scaling", interrupt)
    assert cli.main(["bench", "productkeys", "--exponents", "6", "--cases", "scaling"]) == 130


def test_bench_compile_interrupted_at_a_later_layer_writes_the_earlier(monkeypatch, tmp_path,
                                                                      capsys):
    interrupt_where(monkeypatch, compiled, "_measure_layer", lambda name: name == "sigma_moe")
    path = tmp_path / "compile.json"
    assert cli.main(["bench", "compile", "--layers", "dense", "sigma_moe", "pkm", "--tokens",
                     "16", "--d-model", "32", "--repeats", "1", "--json", str(path)]) == 0
    (record,) = json.loads(path.read_text())
    assert record["layer"] == "dense" and record["fullgraph"]
    assert "bench compile: interrupted: not measured: sigma_moe, pkm" in capsys.readouterr().out
    monkeypatch.setattr(compiled, "_measure_layer", interrupt)
    with pytest.raises(KeyboardInterrupt):           # in the first layer: nothing to write
        compiled.run(tokens=16, d_model=32, repeats=1, names=["dense"])


def test_bench_onnx_interrupted_at_a_later_layer_writes_the_earlier(monkeypatch, tmp_path,
                                                                   capsys):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxscript")
    from sparseffn.bench import onnx_runtime
    interrupt_where(monkeypatch, onnx_runtime, "_measure", lambda name: name == "pkm")
    path = tmp_path / "onnx.json"
    # (the dense MLP first: the cheapest export, each sparse layer's takes seconds)
    assert cli.main(["bench", "onnx", "--layers", "dense", "pkm", "switch", "--tokens", "16",
                     "--d-model", "16", "--repeats", "1", "--json", str(path)]) == 0
    assert [r["layer"] for r in json.loads(path.read_text())] == ["dense"]
    assert "bench onnx: interrupted: not measured: pkm, switch" in capsys.readouterr().out


def test_bench_distributed_interrupted_at_a_later_process_count_writes_the_earlier(
        monkeypatch, tmp_path, capsys):
    interrupt_where(monkeypatch, distributed, "_bench_world", lambda world: world == 2)
    path = tmp_path / "dist.json"
    assert cli.main(["bench", "distributed", "--processes", "1", "2", "4", "--tokens", "64",
                     "--d-model", "16", "--num-experts", "4", "--expert-size", "8", "--k", "2",
                     "--repeats", "1", "--json", str(path)]) == 0
    assert [r["processes"] for r in json.loads(path.read_text())] == [1]
    assert "bench distributed: interrupted: not timed: processes 2, 4" in capsys.readouterr().out
    monkeypatch.setattr(distributed, "_bench_world", interrupt)
    with pytest.raises(KeyboardInterrupt):           # at the first count: nothing to write
        distributed.run(processes=(1, 2), json_path=str(path))


def test_bench_tokenizers_interrupted_at_a_later_vocabulary_writes_the_earlier(
        monkeypatch, tmp_path, capsys):
    interrupt_where(monkeypatch, tokenizers, "_bench_vocab", lambda vocab: vocab == 320)
    path = tmp_path / "bpe.json"
    assert cli.main(["bench", "tokenizers", "--megabytes", "0.02", "--vocab-sizes", "300",
                     "320", "--json", str(path)]) == 0
    assert {r["vocab_size"] for r in json.loads(path.read_text())} == {300}
    assert "bench tokenizers: interrupted: not timed: vocabulary sizes 320" in \
        capsys.readouterr().out


def _sleeping_rank(rank: int, pid_dir: str) -> None:
    with open(os.path.join(pid_dir, f"{rank}.pid"), "w") as file:
        file.write(str(os.getpid()))
    time.sleep(300)


def test_ranks_still_running_when_an_interrupt_comes_are_terminated(tmp_path):
    """A real SIGINT to the waiting main thread (as Ctrl-C would send), once both ranks run."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    main = threading.main_thread().ident

    def interrupt_when_both_run():
        while len(list(tmp_path.glob("*.pid"))) < 2:
            time.sleep(0.05)
        time.sleep(0.2)                              # the pid written; now the main waits
        signal.pthread_kill(main, signal.SIGINT)
    watcher = threading.Thread(target=interrupt_when_both_run, daemon=True)
    watcher.start()
    start = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            distributed.spawn_ranks(_sleeping_rank, 2, (str(tmp_path),))
    finally:
        signal.signal(signal.SIGINT, previous)
    watcher.join()
    assert time.perf_counter() - start < 120         # not the ranks' 300 s sleep
    for pid_file in tmp_path.glob("*.pid"):
        with pytest.raises(ProcessLookupError):      # terminated and reaped
            os.kill(int(pid_file.read_text()), 0)


def test_bench_generate_keeps_the_whole_rounds_and_the_presets_ready(monkeypatch, tmp_path,
                                                                      capsys):
    calls, stop_at = [], 2 + 2 + 1
    original = generation.Decoder.generate

    def generate(self, *args, **kwargs):    # the static mode's calls, one a preset a round:
        calls.append(self)                  # dense and pkm warm up, round 1, then round 2
        if len(calls) == stop_at:
            raise KeyboardInterrupt
        return original(self, *args, **kwargs)
    monkeypatch.setattr(generation.Decoder, "generate", generate)
    path = tmp_path / "generate.json"
    sizes = ["--d-model", "32", "--n-layers", "1", "--n-heads", "2", "--context", "8",
             "--d-ff", "256", "--prompt", "3", "--repeats", "3", "--device", "cpu"]
    assert cli.main(["bench", "generate", "--presets", "pkm", *sizes, "--json",
                     str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["preset"], r["rounds"]) for r in records] == [("dense", 1), ("pkm", 1)]
    assert "bench generate: interrupted after 1 of 3 timed rounds" in capsys.readouterr().out

    calls.clear()
    stop_at = 2                             # pkm's warm-up: dense alone is timed, wholly
    assert cli.main(["bench", "generate", "--presets", "pkm", "peer", *sizes, "--json",
                     str(path)]) == 0
    records = json.loads(path.read_text())
    assert [(r["preset"], r["rounds"]) for r in records] == [("dense", 3)]
    assert ("bench generate: interrupted while preparing pkm: not timed: pkm, peer"
            in capsys.readouterr().out)
    calls.clear()
    stop_at = 1                             # dense's warm-up: nothing to compare with
    with pytest.raises(KeyboardInterrupt):
        generation.run(["pkm"], d_model=32, n_layers=1, n_heads=2, context=8, d_ff=256,
                       prompt=3)


@pytest.mark.parametrize("module", ["sparseffn", "sparseffn.cli"])
def test_python_m_sparseffn_exits_with_its_status_after_an_interrupt_inside_a_string_exec(
        module, tmp_path):
    """CPython marks a process stopped by Ctrl-C when a KeyboardInterrupt passes through a
    string ``exec`` (Dynamo and Inductor run their generated code so), even if the benchmark
    catches it; under ``python -m`` it then ends the process by SIGINT, not with the status
    ``main`` returned. That is how `bench lm` stopped by a real SIGINT while Inductor compiled
    once wrote its table and JSON and still died by SIGINT (return code -2). Here the
    interrupt is raised inside a string ``exec`` in `bench layers`' second config (a
    ``sitecustomize`` first on the path patches the benchmark in the child process)."""
    import os
    import subprocess
    import sys
    (tmp_path / "sitecustomize.py").write_text(
        "from sparseffn.bench import layers\n"
        "original = layers.bench_config\n"
        "def bench_config(cfg, *args, **kwargs):\n"
        "    if cfg.name == 'b':\n"
        "        exec('raise KeyboardInterrupt')\n"
        "    return original(cfg, *args, **kwargs)\n"
        "layers.bench_config = bench_config\n")
    path = tmp_path / "layers.json"
    command = [sys.executable, "-m", module, "bench", "layers", "--tokens", "32",
               "--repeats", "1", "--configs", "a", "b", "--json", str(path)]
    paths = [str(tmp_path), os.environ.get("PYTHONPATH", "")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "bench layers: interrupted: not timed: config b" in done.stdout
    assert {r["config"] for r in json.loads(path.read_text())} == {"a"}


def test_bench_lm_stopped_by_a_real_sigint_while_inductor_compiles(tmp_path):
    """The GPU stage's case end to end: `bench lm --compile default` in its own process gets
    a SIGINT while it compiles a later preset (a second after the dense model compiled),
    and still prints and writes the model compiled before it, exiting normally. (What it
    prints of the targets then is tested above, with interrupts that cost no compile.)

    The benchmark gets Python's own SIGINT handler whatever this process has: a suite started
    as a background job (``pytest ... &`` in a script) inherits SIGINT ignored from the shell,
    and so would the benchmark (it then compiled and timed every preset). ``timeout``, which
    sends the GPU stages their SIGINT, resets it for its command the same way."""
    import os
    import signal
    import subprocess
    import sys
    path = tmp_path / "lm.json"
    presets = ["sigma_moe", "pkm"]
    command = [sys.executable, "-m", "sparseffn", "bench", "lm", "--presets", *presets,
               *LM_SIZES, "--repeats", "2", "--compile", "default", "--json", str(path)]

    def default_sigint():      # in the child, before it runs Python
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                               preexec_fn=default_sigint)
    lines = []
    for line in process.stdout:
        lines.append(line)
        if "dense: compiled in" in line:
            time.sleep(1.0)              # into the next preset's compilation
            process.send_signal(signal.SIGINT)
    assert process.wait(timeout=300) == 0, "".join(lines)
    out = "".join(lines)
    timed = [r["preset"] for r in json.loads(path.read_text())]
    assert timed[:1] == ["dense"] and len(timed) < 3, out
    cut = (["dense"] + presets)[len(timed)]          # the one compiling when it came
    assert f"bench lm: interrupted while preparing {cut}: not timed: {cut}" in out
