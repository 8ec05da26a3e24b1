"""DDP with PEER's sparse-gradient tables: left out of DDP and averaged by
``all_reduce_sparse_grads``; every gradient equals the single-process gradient of the global
batch (two gloo processes on this machine)."""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import sparseffn
from sparseffn.distributed import all_reduce_sparse_grads, ddp_ignore_sparse_grad_parameters


def _layer():
    torch.manual_seed(0)
    return sparseffn.PEER(d_model=8, num_experts=49, heads=2, k=3, key_dim=4, sparse_grad=True)


def _batch(rank):
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(10 + rank))


def _replica(rank: int, world: int, init_file: str, out_dir: str,
             without_sparse_all_reduce: bool = False) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    if without_sparse_all_reduce:    # as NCCL, which raises on a sparse tensor
        _refuse_sparse_all_reduce()
    layer = _layer()
    assert sorted(ddp_ignore_sparse_grad_parameters(layer)) == ["store.w_in", "store.w_out"]
    model = DistributedDataParallel(layer)
    model(_batch(rank)).pow(2).mean().backward()
    all_reduce_sparse_grads(layer)
    torch.save({n: (p.grad.to_dense() if p.grad.is_sparse else p.grad)
                for n, p in layer.named_parameters()}, f"{out_dir}/grads{rank}.pt")
    dist.barrier()
    os._exit(0)      # see test_distributed_usage: gloo's teardown may abort a finished replica


def _refuse_sparse_all_reduce():
    all_reduce = dist.all_reduce

    def dense_only(tensor, *args, **kwargs):
        if tensor.is_sparse:
            raise RuntimeError("NCCL does not support all_reduce with sparse tensors")
        return all_reduce(tensor, *args, **kwargs)
    dist.all_reduce = dense_only


@pytest.mark.parametrize("without_sparse_all_reduce", [False, True],
                         ids=["gloo", "a backend without sparse all-reduce"])
def test_ddp_with_sparse_gradient_tables_matches_one_process(without_sparse_all_reduce):
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_replica, args=(2, os.path.join(tmp, "init"), tmp, without_sparse_all_reduce),
                 nprocs=2, join=True)
        got = [torch.load(f"{tmp}/grads{r}.pt") for r in range(2)]
    layer = _layer()
    # DDP averages: the gradient of the mean of the replicas' losses
    loss = sum(layer(_batch(r)).pow(2).mean() for r in range(2)) / 2
    loss.backward()
    for name, p in layer.named_parameters():
        want = p.grad.to_dense() if p.grad.is_sparse else p.grad
        for g in got:
            torch.testing.assert_close(g[name], want, atol=1e-6, rtol=1e-5, msg=name)


def test_all_reduce_sparse_grads_without_a_process_group_changes_nothing():
    layer = _layer()
    layer(torch.randn(3, 8)).sum().backward()
    before = layer.store.w_in.grad.to_dense().clone()
    all_reduce_sparse_grads(layer)
    torch.testing.assert_close(layer.store.w_in.grad.to_dense(), before)


def _replica_without_gradients_on_one_rank(rank: int, world: int, init_file: str,
                                           out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    layer = _layer()
    if rank == 0:
        layer(_batch(rank)).pow(2).mean().backward()
    all_reduce_sparse_grads(layer)          # rank 1 takes part with empty gradients
    torch.save({n: p.grad.to_dense() for n, p in layer.named_parameters() if p.grad is not None},
               f"{out_dir}/grads{rank}.pt")
    dist.barrier()
    os._exit(0)


def test_a_rank_whose_tables_got_no_gradient_takes_part_with_empty_ones():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_replica_without_gradients_on_one_rank,
                 args=(2, os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
        got = [torch.load(f"{tmp}/grads{r}.pt") for r in range(2)]
    layer = _layer()
    layer(_batch(0)).pow(2).mean().backward()
    tables = {n for n, p in layer.named_parameters() if p.grad.is_sparse}
    assert tables == {"store.w_in", "store.w_out"} and set(got[1]) == tables
    for name in tables:
        want = dict(layer.named_parameters())[name].grad.to_dense() / 2
        for g in got:
            torch.testing.assert_close(g[name], want, atol=1e-6, rtol=1e-5, msg=name)
