"""Expert parallelism on gloo (2 and 4 processes on 127.0.0.1): on the same weights and the
same per-rank batches, outputs, losses and every gradient equal one process holding every
expert; uneven and empty batches, an expert no token reaches, capacity drops, N -> M
checkpoints, and a rank that fails mid-step."""

import os
import tempfile
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparseffn import MoE, MoEConfig, SigmaMoE, SwitchRouterConfig, aux_loss
from sparseffn.distributed import (ExpertParallelMLP, ddp_ignore_expert_parameters,
                                   expert_parameters, gathered_state_dict,
                                   scale_expert_gradients, shard_experts, sync_gradients)
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


LAYERS = {"sigma": _sigma, "switch": _switch, "switch_dropless": _switch_dropless}
# run name: (layer, batch statistics, wrapper of the replicated part: none, DDP or FSDP2)
RUNS = {"sigma": ("sigma", "local", False), "switch": ("switch", "local", False),
        "sigma_ddp": ("sigma", "local", "ddp"), "sigma_fsdp": ("sigma", "global", "fsdp2"),
        "sigma_global": ("sigma", "global", False),
        "switch_global": ("switch_dropless", "global", False)}


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
            assert ddp_ignore_expert_parameters(layer) == ["store.local.w1", "store.local.w2"]
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


def _failing_main(rank, world, init_file, out_dir):
    _init(rank, world, init_file)
    layer = _sigma()
    shard_experts(layer)
    if rank == 1:
        raise RuntimeError("rank 1 fails before its all-to-all")
    start = time.monotonic()
    try:
        layer(_batch(rank, world))
        message = "no error"
    except Exception as error:     # what a user's training loop would see
        message = f"{type(error).__name__}: {error}"
    with open(f"{out_dir}/failed{rank}.txt", "w") as f:
        f.write(f"{time.monotonic() - start:.1f}\n{message}")
    os._exit(0)


def test_a_rank_that_fails_mid_step_makes_the_others_fail_with_a_clear_error():
    with tempfile.TemporaryDirectory() as tmp:
        # not join=True: spawn would then terminate rank 0 as soon as rank 1 died
        context = mp.spawn(_failing_main, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2,
                           join=False)
        for process in context.processes:
            process.join(timeout=60)
        exit_codes = [p.exitcode for p in context.processes]
        with open(f"{tmp}/failed0.txt") as file:
            seconds, message = file.read().split("\n", 1)
    assert exit_codes[0] == 0 and exit_codes[1] not in (0, None)
    assert float(seconds) < 30
    assert message.startswith("ExchangeError: expert-parallel") and "rank 0 of 2" in message, \
        message


def test_sharding_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        shard_experts(_sigma())


def _autocast_main(rank, world, init_file, out_dir):
    """A bf16-autocast step of the sharded σ-MoE, recording the dtype of every exchange."""
    from sparseffn.distributed import expert_parallel
    _init(rank, world, init_file)
    sent = []
    exchange = expert_parallel.all_to_all

    def recording(tensor, *args):
        sent.append(tensor.dtype)
        return exchange(tensor, *args)
    expert_parallel.all_to_all = recording
    layer = _sigma()
    shard_experts(layer, batch_statistics="local")
    x = _batch(rank, world).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).sum().backward()
    torch.save({"y": y.detach(), "x_grad": x.grad, "sent": sent,
                "w1": layer.store.local.w1.grad, "first": layer.store.first_expert},
               f"{out_dir}/autocast{rank}.pt")
    dist.barrier()
    os._exit(0)


def test_under_bf16_autocast_the_ranks_exchange_bf16_rows_and_equal_one_process():
    """The experts read their rows in bf16 under autocast, so the rows are cast before the
    exchange (half the bytes each way), and the result is the one-process layer's."""
    world = 2
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_autocast_main, args=(world, os.path.join(tmp, "init"), tmp), nprocs=world,
                 join=True)
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
