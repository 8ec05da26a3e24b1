"""Expert parallelism on gloo (2 and 4 processes on 127.0.0.1): on the same weights and the
same per-rank batches, outputs, losses and every gradient equal one process holding every
expert; uneven and empty batches, an expert no token reaches, capacity drops, N -> M
checkpoints, and a rank that fails mid-step."""

import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.checkpoint

from sparseffn import (ExpertChoiceRouterConfig, MoE, MoEConfig, SigmaMoE, SwitchRouterConfig,
                       aux_loss)
from sparseffn.distributed import (ExpertParallelMLP, ddp_ignore_expert_parameters,
                                   expert_parameters, gathered_state_dict,
                                   scale_expert_gradients, shard_experts, sync_gradients)
from sparseffn.requirements import torch_release
from torch.nn.parallel import DistributedDataParallel

D = 12


def _sigma(seed=0):
    """σ-MoE, 8 experts, k = 2; expert 7 is never chosen (its router row opposes the
    always-positive coordinate 0 of _batch), so one rank has an expert with no token."""
    torch.manual_seed(seed)
    layer = SigmaMoE(d_model=D, num_experts=8, expert_size=5, k=2)
    with torch.no_grad():
        layer.router.weight[7] = 0.0
        layer.router.weight[7, 0] = -10.0
    return layer


def _switch(seed=0):
    """Switch (top-1) with capacity 1.0: some tokens are dropped on every rank."""
    torch.manual_seed(seed)
    return MoE(MoEConfig(d_model=D, num_experts=4, expert_size=6, k=1,
                         router=SwitchRouterConfig(capacity_factor=1.0), gated=True,
                         activation="silu"))


def _switch_dropless(seed=0):
    torch.manual_seed(seed)
    return MoE(MoEConfig(d_model=D, num_experts=4, expert_size=6, k=1,
                         router=SwitchRouterConfig(capacity_factor=None, z_loss_weight=0.1)))


def _expert_choice(seed=0):
    """Expert choice (Zhou et al. 2022): each expert takes ceil(2 T / 8) of its rank's tokens,
    so a token gets from 0 to 8 experts."""
    torch.manual_seed(seed)
    return MoE(MoEConfig(d_model=D, num_experts=8, expert_size=5, k=2,
                         router=ExpertChoiceRouterConfig()))


def _shared(seed=0):
    """Softmax top-2 with two shared experts (DeepSeekMoE), replicated on every rank."""
    torch.manual_seed(seed)
    return MoE(MoEConfig(d_model=D, num_experts=8, expert_size=5, k=2, router="softmax",
                         shared_experts=2))


LAYERS = {"sigma": _sigma, "switch": _switch, "switch_dropless": _switch_dropless,
          "expert_choice": _expert_choice, "shared": _shared}
# run name: (layer, batch statistics, wrapper of the replicated part: none, DDP or FSDP2)
RUNS = {"sigma": ("sigma", "local", False), "switch": ("switch", "local", False),
        "sigma_ddp": ("sigma", "local", "ddp"), "sigma_fsdp": ("sigma", "global", "fsdp2"),
        "sigma_global": ("sigma", "global", False),
        "switch_global": ("switch_dropless", "global", False),
        "expert_choice": ("expert_choice", "local", False),
        "shared_ddp": ("shared", "local", "ddp")}


def _batch(rank, world):
    """Uneven batches: rank r has 3 + 4r tokens, except the last rank of 4, which has none."""
    tokens = 0 if (world == 4 and rank == 3) else 3 + 4 * rank
    x = torch.randn(tokens, D, generator=torch.Generator().manual_seed(50 + rank))
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _loss(layer, x):
    return layer(x).pow(2).sum() / 10 + aux_loss(layer)


def _init(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=20))


def _rank_main(rank, world, init_file, out_dir, checkpoint_in):
    _init(rank, world, init_file)
    results = {}
    for name, (layer_name, statistics, ddp) in RUNS.items():
        layer = LAYERS[layer_name]()
        assert shard_experts(layer, batch_statistics=statistics) == [""]
        assert isinstance(layer.store, ExpertParallelMLP)
        x = _batch(rank, world).requires_grad_()
        y = layer(x)
        if ddp == "fsdp2":   # FSDP2 shards and averages the router; experts stay local
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            fully_shard(layer.router, mesh=init_device_mesh("cpu", (world,)))
            loss = _loss(layer, x)
            loss.backward()
            scale_expert_gradients(layer)
        elif ddp:   # DDP averages the rest; the experts stay out of it
            # (the shared experts are replicated: DDP averages them with the router)
            assert ddp_ignore_expert_parameters(layer) == ["store.local.w1", "store.local.w2",
                                                           "store.exchange_counts"]
            model = DistributedDataParallel(layer, broadcast_buffers=False)
            loss = model(x).pow(2).sum() / 10 + aux_loss(layer)
            loss.backward()
            scale_expert_gradients(layer)
        else:
            loss = _loss(layer, x)
            loss.backward()
            sync_gradients(layer)
        results[name] = {
            "y": y.detach(), "loss": loss.detach(), "x_grad": x.grad,
            "grads": {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor")
                          else p.grad.clone()) for n, p in layer.named_parameters()},
            "first_expert": layer.store.first_expert,
            "expert_params": [n for n, p in layer.named_parameters()
                              if any(p is q for q in expert_parameters(layer))],
            "counts": layer.routing_stats["counts"]}
        torch.optim.SGD(layer.parameters(), lr=0.1).step()
        if ddp != "fsdp2":      # its state dict holds sharded DTensors
            results[name]["after_step"] = gathered_state_dict(layer)
    if checkpoint_in:          # written by a run with another number of ranks
        layer = _sigma()
        layer.load_state_dict(torch.load(checkpoint_in))
        shard_experts(layer)
        results["resharded_y"] = layer(_batch(rank, world)).detach()
        try:
            shard_experts(MoE(d_model=D, num_experts=5, expert_size=2, k=1))
        except ValueError as error:
            results["indivisible"] = str(error)
    torch.save(results, f"{out_dir}/rank{rank}.pt")
    dist.barrier()
    os._exit(0)      # see test_distributed_usage: gloo's teardown may abort a finished rank


def _reference(layer_name, statistics, world):
    """One process, every expert, then the same SGD step. Local statistics: each rank's batch
    through the full layer, the gradient of the mean of the ranks' losses. Global: the ranks'
    batches as one batch, the aux losses once."""
    layer = LAYERS[layer_name]()
    ys, losses, x_grads = [], [], []
    if statistics == "local":
        for rank in range(world):
            x = _batch(rank, world).requires_grad_()
            loss = _loss(layer, x)
            ys.append(layer(x).detach())
            (loss / world).backward()
            losses.append(loss.detach())
            x_grads.append(x.grad * world)
    else:
        xs = [_batch(rank, world).requires_grad_() for rank in range(world)]
        y = layer(torch.cat(xs))
        aux = aux_loss(layer)
        ys = list(torch.split(y.detach(), [x.shape[0] for x in xs]))
        (y.pow(2).sum() / (10 * world) + aux).backward()
        losses = [part.pow(2).sum() / 10 + aux.detach() for part in ys]
        x_grads = [x.grad * world for x in xs]
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    return ys, losses, x_grads, grads, layer.state_dict()


def _spawn(world, tmp, checkpoint_in=None):
    mp.spawn(_rank_main, args=(world, os.path.join(tmp, f"init{world}"), tmp, checkpoint_in),
             nprocs=world, join=True)
    return [torch.load(f"{tmp}/rank{r}.pt") for r in range(world)]


# PyTorch 2.7 and 2.8 with gloo: FSDP2 sums the gradients it should average (PyTorch issue
# 162338; docs/distributed.md), so the router's come out ``world`` times one process's
FSDP2_SUMS_GLOO_GRADIENTS = torch_release(torch.__version__) < (2, 9)


def _check_against_reference(got, world):
    for name, (layer_name, statistics, _) in RUNS.items():
        ys, losses, x_grads, grads, state = _reference(layer_name, statistics, world)
        for rank, result in enumerate(got):
            r = result[name]
            torch.testing.assert_close(r["y"], ys[rank], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(r["loss"], losses[rank], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(r["x_grad"], x_grads[rank], atol=1e-5, rtol=1e-5)
            first = r["first_expert"]
            for pname, grad in r["grads"].items():
                if pname in r["expert_params"]:        # this rank's slice of the experts
                    full = grads[pname.replace("local.", "")]
                    want = full if pname.endswith("b_out") else full[first:first + grad.shape[0]]
                else:
                    want = grads[pname]
                    if RUNS[name][2] == "fsdp2" and FSDP2_SUMS_GLOO_GRADIENTS:
                        want = want * world
                torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5,
                                           msg=f"{name} rank {rank} {pname}")
            after = r.get("after_step")
            if after is None:
                continue
            assert after.keys() == state.keys()
            for key, value in state.items():
                torch.testing.assert_close(after[key], value, atol=1e-5, rtol=1e-5, msg=key)


def test_two_and_four_ranks_equal_one_process_and_checkpoints_move_between_them():
    with tempfile.TemporaryDirectory() as tmp:
        got4 = _spawn(4, tmp)
        _check_against_reference(got4, 4)
        # the 4-rank run's checkpoint (gathered after one step) loads on 2 ranks and on 1
        checkpoint = os.path.join(tmp, "sigma4.pt")
        torch.save(got4[0]["sigma"]["after_step"], checkpoint)
        got2 = _spawn(2, tmp, checkpoint)
        _check_against_reference(got2, 2)
    one = _sigma()
    one.load_state_dict(got4[0]["sigma"]["after_step"])
    for rank in range(2):
        torch.testing.assert_close(got2[rank]["resharded_y"], one(_batch(rank, 2)),
                                   atol=1e-5, rtol=1e-5)
    # the cases the test means to cover did occur
    assert all(got4[r]["sigma"]["counts"][7] == 0 for r in range(4))        # an idle expert
    assert got4[3]["sigma"]["y"].shape == (0, D)                             # an empty rank
    assert "5 experts, not a multiple of the 2 ranks" in got2[0]["indivisible"]


def _failing_main(rank, world, init_file, out_dir, compiled):
    from sparseffn.distributed import FixedExchange
    _init(rank, world, init_file)
    layer = _sigma()
    shard_experts(layer, fixed_exchange=FixedExchange(tokens=7) if compiled else None)
    # aot_eager: the graph calls the same functional collectives as Inductor's code would
    step = torch.compile(layer, fullgraph=True, backend="aot_eager") if compiled else layer
    if rank == 1:
        raise RuntimeError("rank 1 fails before its all-to-all")
    try:
        step(_batch(rank, world))
        message = "no error"
    except Exception as error:     # what a user's training loop would see
        message = f"{type(error).__name__}: {error}"
    with open(f"{out_dir}/failed{rank}.txt", "w") as f:
        f.write(message)
    os._exit(0)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled_fixed"])
def test_a_rank_that_fails_mid_step_makes_the_others_fail_with_a_clear_error(compiled):
    """Eagerly an ExchangeError naming the exchange and the rank; inside a compiled step
    (the fixed exchange traced) the transport's own error, as docs/distributed.md says:
    either way the other rank fails at once rather than hanging: its error is gloo's
    "Connection closed by peer", not the 20 s timeout. (Not a bound on seconds: compiled, those
    included the compilation, 37 s with Inductor and a cold cache beside another test worker.)"""
    with tempfile.TemporaryDirectory() as tmp:
        # not join=True: spawn would then terminate rank 0 as soon as rank 1 died
        context = mp.spawn(_failing_main, args=(2, os.path.join(tmp, "init"), tmp, compiled),
                           nprocs=2, join=False)
        for process in context.processes:
            process.join(timeout=60)
        exit_codes = [p.exitcode for p in context.processes]
        with open(f"{tmp}/failed0.txt") as file:
            message = file.read()
    assert exit_codes[0] == 0 and exit_codes[1] not in (0, None)
    assert "Connection closed by peer" in message, message
    if compiled:
        assert message.startswith("RuntimeError"), message
    else:
        assert message.startswith("ExchangeError: expert-parallel") and "rank 0 of 2" in message, \
            message


def test_sharding_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard_experts(_sigma())


def test_an_unpickled_sharded_store_keeps_its_sized_exchange_out_of_compiled_graphs(
        tmp_path, monkeypatch):
    """``torch.compiler.disable`` is applied to ``_sized_exchange`` when the first sharded
    store is built, not at import (it imports Dynamo); a store unpickled in a process that
    built none (``torch.load`` of a whole model) applies it too."""
    import inspect
    import pickle
    from sparseffn.distributed import expert_parallel
    _init(0, 1, str(tmp_path / "init"))
    try:
        layer = _sigma()
        shard_experts(layer)
        saved = pickle.dumps(layer)
        # a fresh process: the method as defined, never disabled
        monkeypatch.setattr(expert_parallel, "_sized_exchange_kept_eager", False)
        monkeypatch.setattr(ExpertParallelMLP, "_sized_exchange",
                            inspect.unwrap(ExpertParallelMLP._sized_exchange))
        assert not hasattr(ExpertParallelMLP._sized_exchange, "_torchdynamo_disable")
        loaded = pickle.loads(saved)
        assert ExpertParallelMLP._sized_exchange._torchdynamo_disable
        x = _batch(0, 1)
        torch.testing.assert_close(loaded(x), layer(x))
    finally:
        dist.destroy_process_group()


def _autocast_main(rank, world, init_file, out_dir, fixed):
    """A bf16-autocast step of the sharded σ-MoE, recording the dtype of every exchange
    (``fixed``: with a fixed exchange whose blocks hold every pair)."""
    from sparseffn.distributed import FixedExchange, expert_parallel
    _init(rank, world, init_file)
    sent = []
    exchange = expert_parallel.all_to_all

    def recording(tensor, *args):
        sent.append(tensor.dtype)
        return exchange(tensor, *args)
    expert_parallel.all_to_all = recording
    layer = _sigma()
    shard_experts(layer, batch_statistics="local",
                  fixed_exchange=FixedExchange(tokens=7, capacity_factor=2.0) if fixed else None)
    x = _batch(rank, world).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).sum().backward()
    torch.save({"y": y.detach(), "x_grad": x.grad, "sent": sent,
                "w1": layer.store.local.w1.grad, "first": layer.store.first_expert},
               f"{out_dir}/autocast{rank}.pt")
    dist.barrier()
    os._exit(0)


@pytest.mark.parametrize("fixed", [False, True], ids=["sized", "fixed"])
def test_under_bf16_autocast_the_ranks_exchange_bf16_rows_and_equal_one_process(fixed):
    """The experts read their rows in bf16 under autocast, so the rows are cast before the
    exchange (half the bytes each way), and the result is the one-process layer's."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_autocast_main, args=(world, os.path.join(tmp, "init"), tmp, fixed),
                 nprocs=world, join=True)
        got = [torch.load(f"{tmp}/autocast{r}.pt") for r in range(world)]
    one = _sigma()
    for rank, result in enumerate(got):   # the experts' gradients sum over every rank's batch
        # rows out, expert ids, outputs back (bf16 from bf16 experts)
        assert result["sent"] == [torch.bfloat16, torch.int64, torch.bfloat16], result["sent"]
        x = _batch(rank, world).requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = one(x)
        y.float().pow(2).sum().backward()
        assert result["y"].dtype == y.dtype
        torch.testing.assert_close(result["y"].float(), y.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(result["x_grad"], x.grad, atol=5e-2, rtol=5e-2)
    for result in got:
        first = result["first"]
        want = one.store.w1.grad[first:first + result["w1"].shape[0]]
        torch.testing.assert_close(result["w1"], want, atol=5e-2, rtol=5e-2)


# --- the fixed-size exchange (shard_experts(fixed_exchange=FixedExchange(...))) ----------

# run name: (layer, batch statistics, capacity factor (None: the exchange of sizes read on
# the host), tokens on each of the 2 ranks); the blocks are sized for 7 tokens a rank
FIXED_RUNS = {"sigma_roomy": ("sigma", "global", 2.0, (7, 4)),
              "switch_roomy": ("switch", "local", 2.0, (7, 4)),
              "sigma_tight": ("sigma", "local", 0.5, (7, 4)),
              "sigma_empty_rank": ("sigma", "local", 0.5, (7, 0)),
              "sized": ("sigma", "global", None, (7, 4))}


def _fixed_batch(rank, sizes):
    x = torch.randn(sizes[rank], D, generator=torch.Generator().manual_seed(70 + rank))
    x[:, 0] = x[:, 0].abs() + 1.0
    return x


def _kept_at_exchange(indices, dispatched, world, per_rank, capacity):
    """bool [T, k], slowly: a pair is sent if its router dispatched it and fewer than
    ``capacity`` earlier pairs of this rank (in token, then slot order) go to its expert's
    rank."""
    sent, kept = [0] * world, []
    flags = [True] * indices.numel() if dispatched is None else dispatched.reshape(-1).tolist()
    for expert, routed in zip(indices.reshape(-1).tolist(), flags):
        owner = expert // per_rank
        kept.append(bool(routed) and sent[owner] < capacity)
        sent[owner] += bool(routed)
    return torch.tensor(kept, dtype=torch.bool).view(indices.shape)


def _dropping_at_exchange(layer, world, capacity):
    """``layer`` (one process, every expert) whose routing also drops what the fixed
    exchange of ``world`` ranks with blocks of ``capacity`` rows drops."""
    per_rank = layer.num_experts // world

    def route(x):
        routing = layer.router(x)
        routing.dispatched = _kept_at_exchange(routing.indices, routing.dispatched, world,
                                               per_rank, capacity)
        return routing
    layer.route = route
    return layer


_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "__index__")


def _recording_host_reads(found):
    """Record in ``found`` each host read whose caller is in sparseffn/distributed/, until
    :func:`_stop_recording`."""
    import inspect
    for name in _READS:
        read = getattr(torch.Tensor, name)

        def recorded(tensor, *args, _read=read, _name=name, **kwargs):
            caller = inspect.currentframe().f_back
            if caller and "sparseffn/distributed/" in caller.f_code.co_filename:
                found.append(f"{caller.f_code.co_name}: {_name}")
            return _read(tensor, *args, **kwargs)
        setattr(torch.Tensor, name, recorded)


def _stop_recording():
    for name in _READS:
        delattr(torch.Tensor, name)   # torch.Tensor's own again (inherited from C)


def _fixed_rank_main(rank, world, init_file, out_dir):
    from sparseffn.distributed import FixedExchange, exchange_drops
    _init(rank, world, init_file)
    results = {}
    for name, (layer_name, statistics, factor, sizes) in FIXED_RUNS.items():
        layer = LAYERS[layer_name]()
        fixed = None if factor is None else FixedExchange(tokens=7, capacity_factor=factor)
        shard_experts(layer, batch_statistics=statistics, fixed_exchange=fixed)
        x = _fixed_batch(rank, sizes).requires_grad_()
        reads = []
        _recording_host_reads(reads)
        try:
            loss = _loss(layer, x)
            loss.backward()
        finally:
            _stop_recording()
        dropped = layer.routing_stats.get("exchange_dropped_fraction")
        y = layer(x.detach()).detach()          # the same forward again, for its output
        sync_gradients(layer)
        grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
        layer.eval()
        layer(x.detach())                       # evaluation: not counted
        drops = (exchange_drops(layer), exchange_drops(layer))   # read, then counted afresh
        if factor is not None:   # a checkpointed forward's recomputation counts nothing more
            layer.train()
            torch.utils.checkpoint.checkpoint(layer, x.detach().requires_grad_(),
                                              use_reentrant=False).sum().backward()
            counted = layer.store.exchange_counts.tolist()
            exchange_drops(layer)
            layer.eval()
        results[name] = {
            "y": y, "loss": loss.detach(), "x_grad": x.grad, "reads": reads, "dropped": dropped,
            "drops": drops, "counted": counted if factor is not None else None,
            "grads": grads, "first_expert": layer.store.first_expert, "repr": repr(layer.store),
            "capacity": fixed and fixed.capacity(layer.router.k, world),
            "eval_y": layer(_fixed_batch(rank, sizes)).detach()}
    torch.save(results, f"{out_dir}/fixed{rank}.pt")
    dist.barrier()
    os._exit(0)


def _fixed_reference(layer_name, statistics, world, sizes, capacity):
    """The one-process layer on the ranks' batches (global statistics: as one batch), with
    the pairs the exchange drops dropped; the gradients of the mean of the ranks' losses,
    and each rank's pairs that were kept."""
    layer = LAYERS[layer_name]()
    xs = [_fixed_batch(rank, sizes).requires_grad_() for rank in range(world)]
    if statistics == "local":    # each rank's batch alone, as its exchange sees it
        if capacity is not None:
            _dropping_at_exchange(layer, world, capacity)
        ys, losses = [], []
        for x in xs:
            loss = _loss(layer, x)
            ys.append(layer(x.detach()).detach())
            (loss / world).backward()
            losses.append(loss.detach())
    else:
        assert capacity is None or capacity >= max(sizes) * layer.router.k  # nothing dropped
        y = layer(torch.cat(xs))
        aux = aux_loss(layer)
        ys = list(torch.split(y.detach(), list(sizes)))
        (y.pow(2).sum() / (10 * world) + aux).backward()
        losses = [part.pow(2).sum() / 10 + aux.detach() for part in ys]
    dropped = None
    if capacity and statistics == "local":   # the pairs routed, less those kept, per pair
        dropped = []
        for x in xs:
            routed, kept = layer.router(x.detach()).dispatched, layer.route(x.detach()).dispatched
            pairs = kept.numel()
            routed = pairs if routed is None else routed.sum().item()
            dropped.append((routed - kept.sum().item()) / max(pairs, 1))
    return ys, losses, [x.grad * world for x in xs], \
        {n: p.grad.clone() for n, p in layer.named_parameters()}, dropped


def test_the_fixed_size_exchange_reads_nothing_on_the_host_and_drops_what_it_says():
    """Blocks roomy enough for every pair: the one-process layer's outputs, losses and
    gradients (σ-MoE with global statistics, Switch with its own capacity drops). Blocks too
    small (factor 0.5): the one-process layer with the same pairs dropped, in pair order,
    and the dropped fraction it reports. Ranks with fewer tokens than the blocks are sized
    for, and with none. Evaluation sends every pair. The exchange of sizes read on the host
    is the one that reads."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_fixed_rank_main, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world,
                 join=True)
        got = [torch.load(f"{tmp}/fixed{r}.pt") for r in range(world)]
    for name, (layer_name, statistics, factor, sizes) in FIXED_RUNS.items():
        capacity = got[0][name]["capacity"]
        ys, losses, x_grads, grads, dropped = _fixed_reference(layer_name, statistics, world,
                                                               sizes, capacity)
        one = LAYERS[layer_name]().eval()
        for rank, result in enumerate(got):
            r = result[name]
            torch.testing.assert_close(r["y"], ys[rank], atol=1e-5, rtol=1e-5, msg=name)
            torch.testing.assert_close(r["loss"], losses[rank], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(r["x_grad"], x_grads[rank], atol=1e-5, rtol=1e-5)
            first = r["first_expert"]
            for pname, grad in r["grads"].items():
                full = grads[pname.replace("local.", "")]
                want = full[first:first + grad.shape[0]] if "local." in pname else full
                torch.testing.assert_close(grad, want, atol=1e-5, rtol=1e-5,
                                           msg=f"{name} rank {rank} {pname}")
            # evaluation: every pair, the one-process layer as it is
            torch.testing.assert_close(r["eval_y"], one(_fixed_batch(rank, sizes)),
                                       atol=1e-5, rtol=1e-5)
            if factor is None:
                assert r["reads"] and r["dropped"] is None, name   # the sizes, on the host
                assert r["drops"] == (None, None)
                continue
            # the training forwards' drops over both ranks (two forwards each, equal)
            pairs = [size * LAYERS[layer_name]().router.k for size in sizes]
            want = sum(float(result[name]["dropped"]) * n for result, n in zip(got, pairs)) \
                / sum(pairs)
            assert r["drops"][0] == pytest.approx(want) and r["drops"][1] == 0.0, name
            assert r["counted"][1] == pairs[rank], (name, r["counted"])   # one forward's pairs
            assert r["reads"] == [], (name, r["reads"])
            assert f"capacity_factor={factor}" in r["repr"]
            if dropped is None:         # global statistics: a block holds every pair
                assert capacity >= sizes[rank] * LAYERS[layer_name]().router.k
                assert float(r["dropped"]) == 0.0
            else:
                assert float(r["dropped"]) == pytest.approx(dropped[rank]), (name, rank)
    assert got[0]["sigma_tight"]["capacity"] == 4                    # ceil(0.5 · 7 · 2 / 2)
    assert float(got[0]["sigma_tight"]["dropped"]) > 0               # the case occurred
    assert got[1]["sigma_empty_rank"]["y"].shape == (0, D)


# run name: (layer, batch statistics, capacity factor, tokens on each of the 2 ranks,
# the layer under a non-reentrant activation checkpoint, torch.compile's backend). Inductor
# for one run, where its lowering meets what is its own: blocks with nothing in them (a rank
# without tokens, dropped pairs), the global statistics' all-reduce, and a checkpoint whose
# recomputation keeps the collectives' outputs (keeping_exchanges; without it the two ranks'
# backwards recomputed different all-to-alls, and gloo aborted). The other runs check what
# Dynamo and AOT autograd trace (one graph, the eager numbers), which aot_eager runs without
# Inductor's code generation (alone with a cold cache on two cores, Inductor for all four
# runs took 184 s and 305 CPU-s; for two, 104 s and 167 CPU-s; for one, 59 s and 99 CPU-s).
COMPILED_RUNS = {"sigma_global": ("sigma", "global", 2.0, (7, 4), False, "aot_eager"),
                 "switch": ("switch", "local", 2.0, (7, 4), False, "aot_eager"),
                 "sigma_tight_empty_rank": ("sigma", "local", 0.5, (7, 0), False, "aot_eager"),
                 "sigma_tight_empty_rank_checkpointed": ("sigma", "global", 0.5, (7, 0), True,
                                                         "inductor")}


def _compiled_rank_main(rank, world, init_file, out_dir):
    """Each run's training loss, input gradient, gradients and drop counts, eagerly and
    under ``torch.compile(fullgraph=True)`` (a graph break would raise), with the graphs
    Dynamo counted for the compiled one. Before PyTorch 2.10 a checkpointed sparse layer
    cannot trace in one graph (sparseffn.runtime): that run compiles around it instead."""
    from torch._dynamo.utils import counters
    from sparseffn.distributed import FixedExchange
    from sparseffn.distributed.checkpointing import keeping_exchanges
    from sparseffn.runtime import (checkpointed_sparse_layers_trace_in_one_graph,
                                   compiling_checkpointed_sparse_layers)
    _init(rank, world, init_file)
    results = {}
    for name, (layer_name, statistics, factor, sizes, checkpointed, backend) \
            in COMPILED_RUNS.items():
        one_graph = not checkpointed or checkpointed_sparse_layers_trace_in_one_graph()
        for compiled in (False, True):
            layer = LAYERS[layer_name]()
            shard_experts(layer, batch_statistics=statistics,
                          fixed_exchange=FixedExchange(tokens=7, capacity_factor=factor))
            run = (lambda x: torch.utils.checkpoint.checkpoint(
                layer, x, use_reentrant=False, context_fn=keeping_exchanges)) \
                if checkpointed else layer
            step = (lambda x, layer=layer, run=run: run(x).pow(2).sum() / 10 + aux_loss(layer))
            if compiled:
                torch._dynamo.reset()
                counters.clear()
                step = torch.compile(step, fullgraph=one_graph, backend=backend)
            x = _fixed_batch(rank, sizes).requires_grad_()
            # the recomputation's side effects skipped, as the trainer compiles checkpoints
            with compiling_checkpointed_sparse_layers():
                loss = step(x)
                loss.backward()
            results[name, compiled] = {
                "loss": loss.detach(), "x_grad": x.grad,
                "grads": {n: p.grad.clone() for n, p in layer.named_parameters()},
                "counted": layer.store.exchange_counts.clone(),
                "graphs": counters["stats"]["unique_graphs"] if compiled else None,
                "one_graph": compiled and one_graph}
    torch.save(results, f"{out_dir}/compiled{rank}.pt")
    dist.barrier()
    os._exit(0)


def test_the_fixed_exchange_compiles_into_the_models_graph_and_trains_as_eagerly():
    """The fixed exchange's all-to-alls and the global batch statistics' all-reduce trace
    into the graph (as functional collectives): a sharded layer's training step compiles in
    one graph (fullgraph), whose loss, gradients and drop counts are the eager step's, with
    roomy and tight blocks, a rank without tokens, and under activation checkpointing (the
    drops are counted once)."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_compiled_rank_main, args=(world, os.path.join(tmp, "init"), tmp),
                 nprocs=world, join=True)
        got = [torch.load(f"{tmp}/compiled{r}.pt") for r in range(world)]
    for rank, result in enumerate(got):
        for name in COMPILED_RUNS:
            eager, compiled = result[name, False], result[name, True]
            if compiled["one_graph"]:
                assert compiled["graphs"] == 1, (name, rank)
            torch.testing.assert_close(compiled["loss"], eager["loss"], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(compiled["x_grad"], eager["x_grad"], atol=1e-5,
                                       rtol=1e-5)
            for pname, grad in eager["grads"].items():
                torch.testing.assert_close(compiled["grads"][pname], grad, atol=1e-5,
                                           rtol=1e-5, msg=f"{name} rank {rank} {pname}")
            assert torch.equal(compiled["counted"], eager["counted"]), name
    for name in ("sigma_tight_empty_rank", "sigma_tight_empty_rank_checkpointed"):
        assert got[0][name, True]["counted"][0] > 0                  # pairs were dropped
        assert got[1][name, True]["x_grad"].shape == (0, D)


@pytest.mark.parametrize("seed", range(4))
def test_the_capacity_layout_matches_a_slow_loop(seed):
    from sparseffn.distributed.exchange import capacity_layout
    g = torch.Generator().manual_seed(seed)
    world = 1 + seed
    pairs = (0, 1, 13, 40)[seed]
    owner = torch.randint(0, world + 1, (pairs,), generator=g)   # world: not sent
    for capacity in (0, 1, 3, pairs):
        order, source, filled = capacity_layout(owner, world, capacity)
        assert torch.equal(order, torch.argsort(owner, stable=True))
        # slowly: each sent pair's row, and each row's pair
        rows, taken = {}, [0] * world
        for pair, rank in enumerate(owner.tolist()):
            if rank < world and taken[rank] < capacity:
                rows[pair] = rank * capacity + taken[rank]
            if rank < world:
                taken[rank] += 1
        carried = {row: pair for pair, row in rows.items()}
        assert filled.tolist() == [row in carried for row in range(world * capacity)]
        assert source.shape == (world * capacity,)
        for row in carried:
            assert order[source[row]].item() == carried[row]
        assert (source >= 0).all() and (source < max(pairs, 1)).all()


@pytest.mark.parametrize("fields, message", [
    ({"tokens": 0}, "tokens must be a positive integer"),
    ({"tokens": 7.0}, "tokens must be a positive integer"),
    ({"tokens": 7, "capacity_factor": 0}, "capacity_factor must be a finite number > 0"),
    ({"tokens": 7, "capacity_factor": float("nan")}, "capacity_factor must be a finite"),
    ({"tokens": 7, "capacity_factor": True}, "capacity_factor must be a finite")])
def test_a_bad_fixed_exchange_is_refused_by_name(fields, message):
    from sparseffn.distributed import FixedExchange
    with pytest.raises(ValueError, match=message):
        FixedExchange(**fields)
    with pytest.raises(TypeError, match="fixed_exchange must be a FixedExchange"):
        shard_experts(_sigma(), fixed_exchange=2.0)


def test_a_compiled_checkpointed_lm_keeps_the_exchanges_of_its_sharded_blocks(tmp_path,
                                                                             monkeypatch):
    """``TransformerLM`` checkpoints a block holding sharded experts with
    ``keeping_exchanges`` where torch.compile traces it (ranks with different shapes
    otherwise recompute different exchanges; see ``COMPILED_RUNS``); a block without them,
    and any block eagerly, plainly. Compiled so (``aot_eager``, in one graph from PyTorch 2.10
    on), the LM's loss and gradients are the eager ones. One process (gloo)."""
    from sparseffn.distributed import FixedExchange
    from sparseffn.distributed.checkpointing import keeping_exchanges
    from sparseffn.models import lm
    from sparseffn.runtime import (checkpointed_sparse_layers_trace_in_one_graph,
                                   compiling_checkpointed_sparse_layers)
    from tests.models.test_generate import tiny_lm
    tokens = torch.randint(0, 20, (3, 9), generator=torch.Generator().manual_seed(1))
    _init(0, 1, str(tmp_path / "init"))
    try:
        steps = []
        for compiled in (False, True):
            model = tiny_lm("sigma_moe")
            for module in model.modules():
                if isinstance(module, torch.nn.Dropout):
                    module.p = 0.0
            shard_experts(model.blocks[1], fixed_exchange=FixedExchange(tokens=27))
            model.activation_checkpointing = True
            loss_of = torch.compile(model.loss, backend="aot_eager",
                                    fullgraph=checkpointed_sparse_layers_trace_in_one_graph()) \
                if compiled else model.loss
            torch._dynamo.reset()
            with compiling_checkpointed_sparse_layers():
                loss = loss_of(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
            steps.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    finally:
        dist.destroy_process_group()
    (loss, grads), (loss_c, grads_c) = steps
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert [lm._checkpoint_options(block) for block in model.blocks] == [{}, {}]   # eager
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert [lm._checkpoint_options(block) for block in model.blocks] == \
        [{}, {"context_fn": keeping_exchanges}]
