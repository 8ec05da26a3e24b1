"""Usage statistics under data parallelism: ``all_reduce_usage`` gives every replica the usage
of the global batch, also under ``DistributedDataParallel`` (two gloo processes on this
machine)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import sparseffn
from sparseffn.distributed import (all_reduce_sparse_grads, ddp_ignore_sparse_grad_parameters,
                                   ddp_ignore_usage_buffers)


def _replica(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)                        # the same weights on every replica
    layer = sparseffn.SigmaMoE(d_model=8, num_experts=5, expert_size=4, k=2)
    torch.manual_seed(100 + rank)               # different data on each
    layer(torch.randn(13, 8))
    torch.save({"local_counts": layer.usage_counts.clone(),
                "local_mass": layer.usage_mass.clone()}, f"{out_dir}/local{rank}.pt")
    sparseffn.all_reduce_usage(layer)
    torch.save({"counts": layer.usage_counts.clone(), "mass": layer.usage_mass.clone()},
               f"{out_dir}/global{rank}.pt")
    dist.barrier()          # both replicas are done talking
    # Leave without tearing gloo down: in a full test run on two busy cores its threads
    # sometimes aborted a finished replica at teardown ("terminate called without an active
    # exception", SIGABRT), failing the test after every result was written. An error above
    # still fails it (the replica raises and exits non-zero).
    os._exit(0)


def test_all_reduce_usage_sums_the_replicas():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_replica, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        local = [torch.load(f"{tmp}/local{r}.pt") for r in range(2)]
        merged = [torch.load(f"{tmp}/global{r}.pt") for r in range(2)]
    want_counts = local[0]["local_counts"] + local[1]["local_counts"]
    want_mass = local[0]["local_mass"] + local[1]["local_mass"]
    assert want_counts.sum() == 2 * 13 * 2          # every (token, slot) of both replicas
    for m in merged:
        torch.testing.assert_close(m["counts"], want_counts)
        torch.testing.assert_close(m["mass"], want_mass)


def test_all_reduce_usage_without_a_process_group_changes_nothing():
    layer = sparseffn.SigmaMoE(d_model=8, num_experts=5, expert_size=4, k=2)
    layer(torch.randn(7, 8))
    before = layer.usage_counts.clone()
    sparseffn.all_reduce_usage(layer)
    torch.testing.assert_close(layer.usage_counts, before)


def _model():
    """A σ-MoE and a PEER with sparse-gradient tables and a query BatchNorm, nested."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), sparseffn.SigmaMoE(d_model=8, num_experts=5,
                                                             expert_size=4, k=2),
                         sparseffn.PEER(d_model=8, num_experts=16, heads=2, k=3, key_dim=4,
                                        sparse_grad=True, query_norm="batchnorm"))


def _ddp_replica(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    results = {}
    for kept_per_rank in (True, False):
        model = _model()
        alone = _model()     # the same weights, run on this rank's batches without DDP
        names = ddp_ignore_sparse_grad_parameters(model)
        if kept_per_rank:    # after another helper: both lists are kept
            names += ddp_ignore_usage_buffers(model)
        ddp = DistributedDataParallel(model)
        norm = model[2].router.query_norm.norm
        seen = []       # PEER's BatchNorm statistics as its forward starts, after DDP's broadcast
        model[2].register_forward_pre_hook(lambda *_: seen.append(norm.running_mean.clone()))
        for step in range(3):                   # different batches on each rank
            x = torch.randn(7, 8, generator=torch.Generator().manual_seed(100 * rank + step))
            ddp(x).pow(2).mean().backward()     # DDP would fail on the tables it had kept
            all_reduce_sparse_grads(model)
            alone(x)
        try:
            sparseffn.all_reduce_usage(ddp)
            error = None
        except RuntimeError as e:
            error = str(e)
        results[kept_per_rank] = {
            "names": names, "error": error,
            "usage": [model[i].usage_counts.clone() for i in (1, 2)],
            "alone": [alone[i].usage_counts.clone() for i in (1, 2)],
            "bn_mean": seen[-1]}
    torch.save(results, f"{out_dir}/ddp{rank}.pt")
    dist.barrier()
    os._exit(0)


@pytest.fixture(scope="module")
def under_ddp():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_ddp_replica, args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        return [torch.load(f"{tmp}/ddp{r}.pt") for r in range(2)]


def test_under_ddp_the_usage_buffers_stay_per_rank_and_sum_to_the_global_batch(under_ddp):
    kept = [ranks[True] for ranks in under_ddp]
    assert kept[0]["names"] == ["2.store.w_in", "2.store.w_out", "1.usage_counts",
                                "1.usage_mass", "2.usage_counts", "2.usage_mass"]
    assert kept[0]["error"] is None
    for layer in range(2):
        want = kept[0]["alone"][layer] + kept[1]["alone"][layer]
        assert want.sum() > 0 and not torch.equal(kept[0]["alone"][layer],
                                                  kept[1]["alone"][layer])
        for rank in range(2):
            torch.testing.assert_close(kept[rank]["usage"][layer], want)
    # the other buffers are still broadcast from rank 0: PEER's query BatchNorm statistics
    assert kept[0]["bn_mean"].abs().sum() > 0
    torch.testing.assert_close(kept[0]["bn_mean"], kept[1]["bn_mean"])


def test_all_reduce_usage_refuses_a_ddp_module_that_broadcast_them(under_ddp):
    broadcast = [ranks[False] for ranks in under_ddp]
    for rank in range(2):
        assert "ddp_ignore_usage_buffers" in broadcast[rank]["error"]
        assert "1.usage_counts" in broadcast[rank]["error"]
    # what it refused to sum: rank 1 held rank 0's usage of the earlier batches
    assert not torch.equal(broadcast[1]["usage"][0], broadcast[1]["alone"][0])
