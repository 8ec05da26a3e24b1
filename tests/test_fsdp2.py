"""FSDP2 data parallelism over a whole language model, as users shard one: every block and the
root ``fully_shard``-ed, so the experts' tables (and PKM's and PEER's rows) are sharded like
any other weight. Two gloo processes, each with its own batch: every gradient equals one
process's mean over the two batches, in float32 eagerly and compiled, and under
``MixedPrecisionPolicy(param_dtype=bfloat16)`` a bf16 copy's; the full state dict after an
optimizer step equals the one-process step's, and ``all_reduce_usage`` gives the usage of
both batches."""

import copy
import os
import tempfile
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from sparseffn import aux_loss, all_reduce_usage
from sparseffn.bench.lm_step import lm_model
from sparseffn.requirements import torch_release

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="no torch.distributed")

WORLD = 2
SIZES = dict(d_model=32, n_layers=2, n_heads=2, context=16, d_ff=128)
LR = 0.5
# (FFN preset, how the ranks run it): eager float32, compiled float32, bf16 parameters
CASES = [("sigma_moe", "fp32"), ("switch", "fp32"), ("fff_sparse", "fp32"), ("pkm", "fp32"),
         ("peer", "fp32"), ("sigma_moe", "compiled"), ("sigma_moe", "bf16"), ("pkm", "bf16")]
# PyTorch 2.7 and 2.8 with gloo: FSDP2 sums the gradients it should average (PyTorch issue
# 162338; docs/distributed.md)
SUMMED = torch_release(torch.__version__) < (2, 9)


def _tokens(rank):
    """Rank ``rank``'s batch: 2 sequences of 16 byte tokens and their next tokens."""
    return torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(10 + rank))


def _loss(model, tokens, rank):
    torch.manual_seed(100 + rank)          # the same routing noise and dropout as the reference
    return model.loss(tokens[:, :-1], tokens[:, 1:]) + aux_loss(model)


def _usage(model):
    return {n: b.clone() for n, b in model.named_buffers() if n.endswith("usage_counts")}


def _rank_main(rank, init_file, out_dir):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    mesh = init_device_mesh("cpu", (WORLD,))
    results = {}
    for preset, mode in CASES:
        model = lm_model(preset, **SIZES)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
            if mode == "bf16" else MixedPrecisionPolicy()
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        if mode == "compiled":
            # (Inductor adds nothing FSDP2-specific here; aot_eager keeps CI from compiling
            # C++ in both ranks from a cold cache)
            model.loss = torch.compile(model.loss, backend="aot_eager")
        _loss(model, _tokens(rank), rank).backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()
                 if p.grad is not None}
        torch.optim.SGD(model.parameters(), lr=LR).step()
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     cpu_offload=True))
        all_reduce_usage(model)
        results[f"{preset}/{mode}"] = {"grads": grads, "state": state, "usage": _usage(model)}
    if rank == 0:
        torch.save(results, f"{out_dir}/results.pt")
    dist.barrier()
    os._exit(0)      # see test_distributed_usage: gloo's teardown may abort a finished rank


def _reference(preset, mode):
    """One process: the mean over the ranks' batches of their gradients (each batch through
    a bf16 copy of the model for ``bf16``), the SGD step, and the usage of both batches."""
    model = lm_model(preset, **SIZES)
    grads = {}
    for rank in range(WORLD):
        replica = copy.deepcopy(model)
        if mode == "bf16":
            replica.to(torch.bfloat16)
        _loss(replica, _tokens(rank), rank).backward()
        for name, p in replica.named_parameters():
            if p.grad is not None:
                grads[name] = grads.get(name, 0) + p.grad.float() * (1 if SUMMED else 1 / WORLD)
        usage = _usage(replica)
        if rank == 0:
            total = usage
        else:
            total = {n: total[n] + u for n, u in usage.items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name in grads:
                p -= LR * grads[name]
    return grads, model.state_dict(), total


@pytest.fixture(scope="module")
def ranks():
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
        yield torch.load(f"{tmp}/results.pt")


@pytest.mark.parametrize("preset, mode", CASES, ids=[f"{p}-{m}" for p, m in CASES])
def test_fsdp2_over_every_block_trains_as_one_process_on_both_batches(ranks, preset, mode):
    got = ranks[f"{preset}/{mode}"]
    grads, state, usage = _reference(preset, mode)
    assert got["grads"].keys() == grads.keys()
    # bf16: the same bf16 products on both sides; the float32 sums may differ in order
    tolerance = dict(atol=1e-6, rtol=1e-5) if mode != "compiled" else dict(atol=1e-5, rtol=1e-4)
    for name, want in grads.items():
        torch.testing.assert_close(got["grads"][name], want, **tolerance, msg=name)
    assert got["state"].keys() == state.keys()
    for name, want in state.items():
        torch.testing.assert_close(got["state"][name], want, **tolerance, msg=name)
    assert usage and got["usage"].keys() == usage.keys()
    for name, want in usage.items():
        assert torch.equal(got["usage"][name], want), name
