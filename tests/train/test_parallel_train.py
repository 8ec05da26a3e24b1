"""``sparseffn train`` on two processes (gloo on 127.0.0.1, as torchrun starts them): expert
parallelism computes what one process computes on the same global batches, a run stopped on
one rank stops on both and resumes to the bit on two ranks, and its checkpoint, in the
one-process format, resumes on one process; in fp16 (data-parallel, and with sharded experts,
one rank's experts overflowing alone) the ranks skip the same steps and stay equal; uneven
ranks split into micro-batches train what one process does."""

import functools
import json
import math
import os
import shutil
import socket

import pytest
import torch
import torch.multiprocessing as mp

from sparseffn.train import checkpoint as ckpt
from sparseffn.train import loss_scaling
from sparseffn.train.config import (DataSpec, ModelSpec, RunConfig, TrainSpec,
                                    run_config_from_dict)
from sparseffn.train.parallel import Parallel
from sparseffn.train.trainer import Trainer, load_trained
from tests.train.conftest import CORPUS
from tests.train.test_host_reads import _TrainerReads


def _run(corpus, dropout, steps=6):
    return RunConfig(name="tiny-ep", data=DataSpec(corpus="file", path=corpus),
                     model=ModelSpec(d_model=32, n_layers=2, n_heads=2, context=16,
                                     ffn={"type": "sigma_moe", "num_experts": 4,
                                          "expert_size": 16, "k": 2},
                                     dropout=dropout),
                     train=TrainSpec(steps=steps, batch_size=5, lr=3e-3, eval_every=3,
                                     log_every=1, eval_windows=8, expert_parallel=True))


def _data_parallel_fp16(corpus):
    """Replicated experts in float16 autocast; started from a loss scale of 2^24
    (:data:`FP16_SCALE`) its first steps overflow and are skipped."""
    run = _run(corpus, 0.0, steps=8)
    return run.replace(name="tiny-dp-fp16", train=TrainSpec(
        **{**run.train.__dict__, "expert_parallel": False, "fp16": True}))


def _expert_parallel_fp16(corpus):
    """Sharded experts in float16 autocast, from a loss scale of 2^24 (steps are skipped)."""
    run = _run(corpus, 0.0, steps=8)
    return run.replace(name="tiny-ep-fp16", train=TrainSpec(
        **{**run.train.__dict__, "fp16": True}))


def _fixed_exchange(corpus):
    """Sharded experts exchanged in blocks of a fixed size, roomy enough (factor 2 on two
    ranks) that no pair is dropped."""
    run = _run(corpus, 0.0)
    return run.replace(name="tiny-ep-fixed", train=TrainSpec(
        **{**run.train.__dict__, "exchange_capacity_factor": 2.0}))


def _data_parallel_micro(corpus, micro_batches):
    """A dense LM without dropout, each step's rows split into ``micro_batches`` parts (on two
    ranks each rank's 3 or 2 rows of 5: parts of 2 and 1, and 1 and 1 rows)."""
    run = _run(corpus, 0.0, steps=6)
    return run.replace(name="tiny-dp-micro", model=ModelSpec(
        **{**run.model.__dict__, "ffn": "dense"}), train=TrainSpec(
        **{**run.train.__dict__, "expert_parallel": False, "micro_batches": micro_batches}))


def _data_parallel_sparse_tables(corpus):
    """PEER with sparse-gradient tables (SparseAdam), replicated, without dropout; clipped
    hard enough that every step clips."""
    run = _run(corpus, 0.0, steps=6)
    return run.replace(name="tiny-dp-sparse", model=ModelSpec(
        **{**run.model.__dict__, "ffn": "peer", "ffn_options": {"sparse_grad": True}}),
        train=TrainSpec(**{**run.train.__dict__, "expert_parallel": False, "clip": 0.05}))


FP16_SCALE = 2.0 ** 24


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank, world, port, jobs):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    loss_scaling.INITIAL_LOSS_SCALE = FP16_SCALE     # for the fp16 job (the others are fp32)
    for run_dict, out, resume, stop_after, read_every_step in jobs:
        trainer = Trainer(run_config_from_dict(run_dict), out, progress=False,
                          read_every_step=read_every_step)
        if stop_after and rank == 0:       # a Ctrl-C that only rank 0 saw
            original = trainer._batch

            def batch(step, trainer=trainer, original=original, stop_after=stop_after):
                if step == stop_after - 1:
                    trainer._stop_requested = True
                return original(step)
            trainer._batch = batch
        with pytest.MonkeyPatch.context() as patch:
            if run_dict["name"] == "tiny-ep-fp16" and rank == 0:
                _overflow_own_experts_at(patch, trainer, step=7)
            # the training package's host reads inside a step, and the expert exchange's
            reads = _TrainerReads(patch, ("train/", "distributed/")) \
                if read_every_step is False else None
            try:
                trainer.train(resume=resume)
            except KeyboardInterrupt:
                assert stop_after
        if reads is not None:
            (out / f"step_reads{rank}-{int(resume)}.json").write_text(
                json.dumps([where for inside, _, where in reads.found if inside]))
        if trainer.loss_scaling.enabled:   # what each rank ends with, to compare the ranks
            torch.save({"model": trainer.model.state_dict(),
                        "loss_scaling": trainer.loss_scaling.state()}, out / f"rank{rank}.pt")
    torch.distributed.barrier()
    os._exit(0)      # see tests/layers/test_distributed_usage.py


def _stop_flags(rank, world, init_file, out_dir):
    """Two series of five calls of ``any_later``, each answer with whether flags are left in
    flight: rank 0's flag set at the third call of the first, rank 1's at the last call of
    the second, then collected by ``settle_later``."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                                         world_size=world)
    parallel = Parallel(rank, world)
    calls = {}
    for series, (setter, at) in enumerate(((0, 2), (1, 4))):
        calls[series] = [(parallel.any_later(rank == setter and call == at),
                          parallel._pending is not None) for call in range(5)]
    settled = parallel.settle_later()
    json.dump({"calls": calls, "settled": settled, "left": parallel._pending is not None,
               "again": parallel.settle_later()}, open(f"{out_dir}/flags{rank}.json", "w"))
    torch.distributed.barrier()
    os._exit(0)      # see tests/layers/test_distributed_usage.py


def test_the_ranks_agree_on_a_stop_one_call_later_and_leave_nothing_in_flight(tmp_path):
    """A flag set on one rank reaches every rank at the next call (its all-reduce runs in the
    background meanwhile), the same answer on both; after a True nothing is in flight (the
    run stops there), and settling collects the last call's flags. One process answers at
    once."""
    mp.spawn(_stop_flags, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2,
             join=True)
    in_flight = [False, True]
    for rank in range(2):
        got = json.loads((tmp_path / f"flags{rank}.json").read_text())
        assert got == {"calls": {"0": [in_flight] * 3 + [[True, False], in_flight],
                                 "1": [in_flight] * 5},
                       "settled": True, "left": False, "again": False}, rank
    one = Parallel()
    assert [one.any_later(flag) for flag in (False, True, False)] == [False, True, False]
    assert one.settle_later() is False


def _overflow_own_experts_at(patch, trainer, step):
    """An inf in this rank's first expert gradient after step ``step``'s gradient sync, as
    when only this rank's experts overflow (the replicated gradients stay finite)."""
    sync = Parallel.sync

    def sync_then_overflow(parallel, model):
        sync(parallel, model)
        if trainer.step + 1 == step:
            grad = next(p.grad for name, p in model.named_parameters()
                        if name.endswith("store.local.w1"))
            grad.view(-1)[0] = math.inf
    patch.setattr(Parallel, "sync", sync_then_overflow)


def _curve(folder):
    return [(m["kind"], m["step"], m["loss"])
            for m in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())]


def test_expert_parallel_training_on_two_ranks(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(CORPUS)
    exact, noisy = _run(str(corpus), 0.0), _run(str(corpus), 0.1)
    fp16 = _data_parallel_fp16(str(corpus)).to_dict()
    ep_fp16 = _expert_parallel_fp16(str(corpus)).to_dict()
    micro = _data_parallel_micro(str(corpus), 2)
    fixed = _fixed_exchange(str(corpus)).to_dict()
    sparse_tables = _data_parallel_sparse_tables(str(corpus))
    # (run, folder, resume, the step during which rank 0 asks to stop, read_every_step)
    jobs = [(exact.to_dict(), tmp_path / "ep", False, None, None),
            (exact.to_dict(), tmp_path / "ep_stopped", False, 3, None),
            (noisy.to_dict(), tmp_path / "noisy", False, None, None),
            (noisy.to_dict(), tmp_path / "noisy_resumed", False, 3, None),
            (noisy.to_dict(), tmp_path / "noisy_resumed", True, None, None),
            (noisy.to_dict(), tmp_path / "noisy_deferred", False, 3, False),
            (noisy.to_dict(), tmp_path / "noisy_deferred", True, None, False),
            (fp16, tmp_path / "dp_fp16", False, None, None),
            (fp16, tmp_path / "dp_fp16_deferred", False, None, False),
            (ep_fp16, tmp_path / "ep_fp16", False, None, None),
            (micro.to_dict(), tmp_path / "dp_micro", False, None, None),
            (fixed, tmp_path / "ep_fixed", False, None, False),
            (sparse_tables.to_dict(), tmp_path / "dp_sparse", False, None, None)]
    mp.spawn(_rank, args=(2, _free_port(), jobs), nprocs=2, join=True)

    # 1. two ranks with sharded experts = one process on the same global batches
    single = Trainer(exact, tmp_path / "single", progress=False).train()
    ep = json.loads((tmp_path / "ep" / "summary.json").read_text())
    assert ep["processes"] == 2 and ep["expert_parallel"] and single["processes"] == 1
    for (kind, step, a), (kind_b, step_b, b) in zip(_curve(tmp_path / "ep"),
                                                    _curve(tmp_path / "single"), strict=True):
        assert (kind, step) == (kind_b, step_b) and a == pytest.approx(b, rel=1e-4, abs=1e-5)
    assert ep["val"]["loss"] == pytest.approx(single["val"]["loss"], rel=1e-4)
    # ... in the one-process checkpoint format: same keys and shapes, near-equal weights
    ep_state = ckpt.load(tmp_path / "ep" / "checkpoint.pt")
    one_state = ckpt.load(tmp_path / "single" / "checkpoint.pt")
    assert ep_state["model"].keys() == one_state["model"].keys()
    for key, value in one_state["model"].items():
        torch.testing.assert_close(ep_state["model"][key], value, atol=1e-4, rtol=1e-3, msg=key)
    for a, b in zip(ep_state["optimizers"][0]["state"].values(),
                    one_state["optimizers"][0]["state"].values()):
        assert a["exp_avg"].shape == b["exp_avg"].shape
    assert len(ep_state["rng_ranks"]) == 2
    # ... written as shards: each rank's experts in its own file, named by the checkpoint
    raw = torch.load(tmp_path / "ep" / "checkpoint.pt", weights_only=True)
    expert_keys = {k for k in one_state["model"] if k.endswith(("store.w1", "store.w2"))}
    assert expert_keys and not expert_keys & raw["model"].keys()
    assert raw["expert_shards"]["files"] == [f"checkpoint.pt.experts-step6-rank{r}-of-2"
                                             for r in range(2)]
    shard = torch.load(tmp_path / "ep" / raw["expert_shards"]["files"][1], weights_only=True)
    assert all(shard["model"][k].shape[0] == 2 for k in expert_keys)      # 2 of 4 experts
    assert load_trained(tmp_path / "ep" / "checkpoint.pt")[3] is not None   # sparseffn eval

    # 2. a stop seen by rank 0 only, during step 3, stopped both after step 4 (agreed on in
    #    the background during step 4); resumed on 2 ranks, the run continues to the bit
    #    (dropout and all)
    assert _curve(tmp_path / "noisy_resumed") == _curve(tmp_path / "noisy")
    a = ckpt.load(tmp_path / "noisy" / "checkpoint.pt")["model"]
    b = ckpt.load(tmp_path / "noisy_resumed" / "checkpoint.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [f.name for f in ckpt.shard_files(tmp_path / "noisy_resumed" / "checkpoint.pt")] == \
        [f"checkpoint.pt.experts-step6-rank{r}-of-2" for r in range(2)]   # step 4's removed

    # ... and the same with the losses read at the boundaries only, as on a GPU: the ranks
    #    average the same losses there, and stop at the same step
    assert _curve(tmp_path / "noisy_deferred") == _curve(tmp_path / "noisy")
    # ... and no step read the device on the host in the training package's code (the
    #     gradient clipping over the sharded experts included); the expert exchange read its
    #     sizes
    for name in ("step_reads0-0", "step_reads1-0", "step_reads0-1", "step_reads1-1"):
        reads = json.loads((tmp_path / "noisy_deferred" / f"{name}.json").read_text())
        assert reads and all(where.startswith("distributed/") for where in reads), reads

    # 3. the 2-rank checkpoint of step 4 resumes on one process
    stopped = tmp_path / "ep_stopped"
    assert ckpt.load(stopped / "checkpoint.pt")["step"] == 4
    shutil.copytree(stopped, tmp_path / "one", dirs_exist_ok=True)
    resumed = Trainer(exact, tmp_path / "one", progress=False).train(resume=True)
    assert resumed["steps"] == 6 and resumed["processes"] == 1
    assert resumed["val"]["loss"] == pytest.approx(single["val"]["loss"], rel=1e-4)
    assert ckpt.shard_files(tmp_path / "one" / "checkpoint.pt") == []    # one file again

    # 4. data-parallel fp16: every rank unscales the averaged gradients, so all see the same
    #    overflow, skip the same steps and keep equal replicas; a skipped step leaves the
    #    initial model, whose losses are one process's
    ranks = [torch.load(tmp_path / "dp_fp16" / f"rank{r}.pt", weights_only=True)
             for r in range(2)]
    assert ranks[0]["loss_scaling"] == ranks[1]["loss_scaling"]
    assert all(torch.equal(ranks[0]["model"][k], ranks[1]["model"][k]) for k in ranks[0]["model"])
    records = [m for m in map(json.loads, (tmp_path / "dp_fp16" / "metrics.jsonl")
                              .read_text().splitlines()) if m["kind"] == "train"]
    skipped = [m["skipped_steps"] for m in records]
    deferred = [m for m in map(json.loads, (tmp_path / "dp_fp16_deferred" / "metrics.jsonl")
                               .read_text().splitlines()) if m["kind"] == "train"]
    assert [(m["loss"], m["aux_loss"], m["loss_scale"], m["skipped_steps"]) for m in deferred] \
        == [(m["loss"], m["aux_loss"], m["loss_scale"], m["skipped_steps"]) for m in records]
    assert 0 < ranks[0]["loss_scaling"]["skipped"] == sum(skipped) < 8 and skipped[0] == 1
    previous, loss_scaling.INITIAL_LOSS_SCALE = loss_scaling.INITIAL_LOSS_SCALE, FP16_SCALE
    try:
        Trainer(_data_parallel_fp16(str(corpus)), tmp_path / "one_fp16", progress=False).train()
    finally:
        loss_scaling.INITIAL_LOSS_SCALE = previous
    one = [m for m in map(json.loads, (tmp_path / "one_fp16" / "metrics.jsonl")
                          .read_text().splitlines()) if m["kind"] == "train"]
    # up to the first step either took, both computed their losses with the initial model
    # (a rank's mean is over half the tokens: its activations' gradients are twice one
    # process's, so the ranks overflow down to a scale one process does not)
    before = min(skipped.index(0), [m["skipped_steps"] for m in one].index(0)) + 1
    assert [m["loss"] for m in records][:before] == pytest.approx(
        [m["loss"] for m in one][:before], rel=1e-3)

    # 5. fp16 with sharded experts: the ranks agree on every skipped step (each checks its
    #    own experts' gradients; at step 7 only rank 0's overflow), so they hold the same
    #    scale and replicated weights, and the run trains past the overflowing start
    ranks = [torch.load(tmp_path / "ep_fp16" / f"rank{r}.pt", weights_only=True)
             for r in range(2)]
    assert ranks[0]["loss_scaling"] == ranks[1]["loss_scaling"]
    replicated = [k for k in ranks[0]["model"]
                  if not k.endswith(("store.local.w1", "store.local.w2"))]
    assert replicated and all(torch.equal(ranks[0]["model"][k], ranks[1]["model"][k])
                              for k in replicated)
    assert not torch.equal(ranks[0]["model"]["blocks.0.ffn.store.local.w1"],
                           ranks[1]["model"]["blocks.0.ffn.store.local.w1"])   # own experts
    records = [m for m in map(json.loads, (tmp_path / "ep_fp16" / "metrics.jsonl")
                              .read_text().splitlines()) if m["kind"] == "train"]
    assert 0 < ranks[0]["loss_scaling"]["skipped"] == sum(m["skipped_steps"] for m in records) < 8
    assert records[6]["step"] == 7 and records[6]["skipped_steps"] == 1    # rank 0's overflow
    assert all(math.isfinite(m["loss"]) for m in records)

    # 6. micro-batches of uneven ranks: each part's mean loss weighted by its share of the
    #    global batch, so two ranks of two parts each train what one process does whole
    Trainer(_data_parallel_micro(str(corpus), 1), tmp_path / "one_whole", progress=False).train()
    for (kind, step, a), (kind_b, step_b, b) in zip(_curve(tmp_path / "dp_micro"),
                                                    _curve(tmp_path / "one_whole"), strict=True):
        assert (kind, step) == (kind_b, step_b) and a == pytest.approx(b, rel=1e-5)
    parts = ckpt.load(tmp_path / "dp_micro" / "checkpoint.pt")["model"]
    whole = ckpt.load(tmp_path / "one_whole" / "checkpoint.pt")["model"]
    for key, value in whole.items():
        torch.testing.assert_close(parts[key], value, atol=1e-5, rtol=1e-4, msg=key)

    # 7. the fixed-size exchange with blocks that hold every pair: one process's run, and
    #    no step read the device on the host, in the exchange or in the training package
    for (kind, step, a), (kind_b, step_b, b) in zip(_curve(tmp_path / "ep_fixed"),
                                                    _curve(tmp_path / "single"), strict=True):
        assert (kind, step) == (kind_b, step_b) and a == pytest.approx(b, rel=1e-4, abs=1e-5)
    for rank in range(2):
        assert json.loads((tmp_path / "ep_fixed" / f"step_reads{rank}-0.json").read_text()) == []
    # ... whose records say what it dropped (nothing); the sized exchange's have no such field
    fixed_records = [m for m in map(json.loads, (tmp_path / "ep_fixed" / "metrics.jsonl")
                                    .read_text().splitlines()) if m["kind"] == "train"]
    assert len(fixed_records) == 6
    assert all(m["exchange_dropped_fraction"] == 0.0 for m in fixed_records)
    assert not any("exchange_dropped_fraction" in json.loads(line) for line in
                   (tmp_path / "ep" / "metrics.jsonl").read_text().splitlines())

    # 8. sparse-gradient tables on two ranks (their rows all-gathered, not all-reduced: NCCL
    #    has no sparse all-reduce) and clipped with the rest: one process's run
    Trainer(sparse_tables, tmp_path / "one_sparse", progress=False).train()
    for (kind, step, a), (kind_b, step_b, b) in zip(_curve(tmp_path / "dp_sparse"),
                                                    _curve(tmp_path / "one_sparse"), strict=True):
        assert (kind, step) == (kind_b, step_b) and a == pytest.approx(b, rel=1e-5)
    two = ckpt.load(tmp_path / "dp_sparse" / "checkpoint.pt")["model"]
    one = ckpt.load(tmp_path / "one_sparse" / "checkpoint.pt")["model"]
    assert any(k.endswith("store.w_in") for k in one)
    for key, value in one.items():
        torch.testing.assert_close(two[key], value, atol=1e-5, rtol=1e-4, msg=key)

    # 9. a missing shard is named
    (tmp_path / "ep" / "checkpoint.pt.experts-step6-rank1-of-2").unlink()
    with pytest.raises(ckpt.CheckpointError, match="rank1-of-2 is missing"):
        ckpt.load(tmp_path / "ep" / "checkpoint.pt")


def _compiled_rank(rank, world, port, jobs, backend):
    """:func:`_rank`, failing at any recompilation within a job (one graph set must serve
    every step), and writing the graph breaks Dynamo met in each job to
    ``graph_breaks{rank}`` in its folder. ``backend``: the ``torch.compile`` backend of every
    job that compiles."""
    from torch._dynamo.utils import counters
    torch._dynamo.config.error_on_recompile = True
    original, torch_compile = Trainer.train, torch.compile

    def train(trainer, *args, **kwargs):
        torch._dynamo.reset()    # each job in a fresh process, as a user's run is
        before = sum(counters["graph_break"].values())
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(torch, "compile", functools.partial(torch_compile, backend=backend))
                return original(trainer, *args, **kwargs)
        finally:
            breaks = sum(counters["graph_break"].values()) - before
            (trainer.out / f"graph_breaks{rank}").write_text(str(breaks))
    Trainer.train = train
    _rank(rank, world, port, jobs)


def test_compiled_expert_parallel_training_follows_the_eager_run(tmp_path):
    """``train.compile`` with sharded experts: the exchange of sizes runs eagerly (it reads
    its sizes; traced, each step would compile again), the rest compiled; the fixed exchange
    (``exchange_capacity_factor``) compiles into the step's graph, without a graph break.
    Both log the eager run's losses on the two ranks and compile nothing twice.

    Both compile with ``aot_eager``: what this tests (where Dynamo breaks, that nothing
    compiles twice, the losses) is Dynamo's and AOTAutograd's, and Inductor compiling each
    graph on both ranks took most of its time (alone on 2 cores: 55 s with the fixed run in
    Inductor, 26 s without). ``test_expert_parallel`` compiles the fixed exchange with
    Inductor, in a layer's training step on two ranks."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(CORPUS)
    eager = _run(str(corpus), 0.0, steps=8)     # (compiled dropout draws other numbers)
    compiled = eager.replace(train=TrainSpec(**{**eager.train.__dict__, "compile": True}))
    fixed = compiled.replace(train=TrainSpec(**{**compiled.train.__dict__,
                                                "exchange_capacity_factor": 2.0}))
    jobs = [(eager.to_dict(), tmp_path / "eager", False, None, None),
            (compiled.to_dict(), tmp_path / "compiled", False, None, None),
            (fixed.to_dict(), tmp_path / "fixed", False, None, None)]
    mp.spawn(_compiled_rank, args=(2, _free_port(), jobs, "aot_eager"), nprocs=2, join=True)
    for run in ("compiled", "fixed"):
        for (kind, step, a), (kind_b, step_b, b) in zip(_curve(tmp_path / run),
                                                        _curve(tmp_path / "eager"), strict=True):
            assert (kind, step) == (kind_b, step_b) and a == pytest.approx(b, rel=1e-5), run
    for rank in range(2):
        assert int((tmp_path / "compiled" / f"graph_breaks{rank}").read_text()) > 0
        assert int((tmp_path / "fixed" / f"graph_breaks{rank}").read_text()) == 0
    records = [json.loads(line) for line in (tmp_path / "fixed" / "metrics.jsonl").read_text()
               .splitlines()]
    assert all(m["exchange_dropped_fraction"] == 0.0 for m in records if m["kind"] == "train")


def test_compare_under_torchrun_is_refused_with_what_to_do(tmp_path, monkeypatch):
    from sparseffn.train.compare import compare
    from sparseffn.train.config import ConfigError
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="one by one with sparseffn train"):
        compare({"name": "c", "data": {"corpus": "pydoc"}, "compare": {"variants": ["dense"]}},
                tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_fixed_exchange_is_sized_for_the_largest_micro_batch_of_a_rank():
    """5 rows on 2 ranks: 3 and 2; in 2 micro-batches: parts of 2 and 1 rows, so blocks for
    2 rows of 16 tokens on every rank."""
    from sparseffn.train.config import ConfigError
    parallel = Parallel(rank=1, world=2, expert_parallel=True)
    fixed = parallel.fixed_exchange(1.5, rows=5, micro_batches=2, tokens_per_row=16)
    assert (fixed.tokens, fixed.capacity_factor) == (32, 1.5)
    assert fixed.capacity(k=2, world=2) == math.ceil(1.5 * 32 * 2 / 2)
    assert parallel.fixed_exchange(None, rows=5, micro_batches=2, tokens_per_row=16) is None
    assert TrainSpec(expert_parallel=True, exchange_capacity_factor=1).exchange_capacity_factor \
        == 1.0
    for bad in (0, -1.0, float("inf"), "2"):
        with pytest.raises(ConfigError, match="train.exchange_capacity_factor must be a finite "
                                              "number"):
            TrainSpec(expert_parallel=True, exchange_capacity_factor=bad)
    with pytest.raises(ConfigError, match="it needs train.expert_parallel = true"):
        TrainSpec(exchange_capacity_factor=1.25)
