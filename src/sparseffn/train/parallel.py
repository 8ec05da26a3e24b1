"""A run on several processes: ``torchrun --nproc-per-node N -m sparseffn train CONFIG``.

Data parallelism always (each rank takes its share of every step's batch; the gradients of the
replicated parameters are averaged); with ``train.expert_parallel`` the experts of every
mixture are also sharded across the ranks
(:func:`sparseffn.distributed.shard_experts`, aux losses over the global batch). A step on N
ranks computes the loss of the same global batch as one process: each rank's mean loss is
weighted by its share of the tokens.

Rank 0 writes the files (metrics, summary, the checkpoint); every rank evaluates the same
windows (replicated: simple, and the expert exchange needs every rank in each forward).
With sharded experts each rank also writes its experts and their optimizer state to a shard
file beside the checkpoint (:mod:`sparseffn.train.checkpoint`), and nothing is gathered;
loading a checkpoint puts the shards together into the one-process state, so a checkpoint
written by N ranks resumes on M ranks (or one) and ``sparseffn eval`` reads it. Each rank's
RNG state is kept too: resuming on the same number of ranks continues exactly.
A single process (no ``WORLD_SIZE`` above 1) does none of this.
"""

from __future__ import annotations

import math
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ..distributed import (FixedExchange, expert_parameters, shard_experts, sharded_stores,
                           split_state_dict, sync_gradients)
from ..distributed.errors import explained
from ..optim import clip_grad_norm_, gradient_norm, scale_gradients_

#: How long a rank waits for the others in a collective before it fails.
TIMEOUT = timedelta(minutes=10)


class Parallel:
    """This process's place in the run: ``rank`` of ``world``."""

    def __init__(self, rank: int = 0, world: int = 1, expert_parallel: bool = False,
                 device: torch.device = torch.device("cpu")) -> None:
        self.rank, self.world, self.expert_parallel = rank, world, expert_parallel
        self.device = device
        self._pending: tuple[dist.Work, torch.Tensor] | None = None    # see any_later

    @classmethod
    def from_environment(cls, expert_parallel: bool,
                         device: torch.device = torch.device("cpu")) -> "Parallel":
        """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``,
        ``MASTER_ADDR``/``MASTER_PORT``): gloo on the CPU; with ``device="cuda"`` each rank
        on GPU ``LOCAL_RANK``, NCCL for CUDA tensors and gloo for the CPU ones. One process
        on ``device`` when there is none. ``device`` is the training device, checked by the
        caller (:func:`sparseffn.train.trainer.training_device`)."""
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1 and not (
                dist.is_available() and dist.is_initialized()):
            return cls(0, 1, expert_parallel, device)
        cuda = device.type == "cuda"
        local = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda \
            else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(local)
        if not dist.is_initialized():
            dist.init_process_group("cuda:nccl,cpu:gloo" if cuda else "gloo", timeout=TIMEOUT)
        return cls(dist.get_rank(), dist.get_world_size(), expert_parallel, local)

    @property
    def active(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether the experts are split across the ranks (and checkpoints with them)."""
        return self.active and self.expert_parallel

    def shard(self, model: nn.Module, fixed_exchange: FixedExchange | None = None) -> None:
        """Keep this rank's experts only (with ``expert_parallel``), exchanging their tokens
        in blocks of a fixed size when ``fixed_exchange`` is given."""
        if self.sharded:
            shard_experts(model, fixed_exchange=fixed_exchange)

    def fixed_exchange(self, capacity_factor: float | None, rows: int, micro_batches: int,
                       tokens_per_row: int) -> FixedExchange | None:
        """The experts' fixed-size exchange for ``capacity_factor`` (None: None), its blocks
        sized for the largest micro-batch a rank gets from a batch of ``rows`` rows (the
        same number on every rank, as the blocks must be): ``ceil(ceil(rows / world) /
        micro_batches)`` rows of ``tokens_per_row`` tokens (``tensor_split`` hands out the
        larger parts first)."""
        if capacity_factor is None:
            return None
        per_rank = math.ceil(rows / self.world)
        return FixedExchange(tokens=math.ceil(per_rank / micro_batches) * tokens_per_row,
                             capacity_factor=capacity_factor)

    def local(self, inputs: torch.Tensor, targets: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor, float]:
        """This rank's rows of the step's batch, and the weight of its mean loss that makes
        the ranks' average the global batch's mean: ``world · rows_here / rows``."""
        if not self.active:
            return inputs, targets, 1.0
        rows = inputs.shape[0]
        inputs = inputs.tensor_split(self.world)[self.rank]
        targets = targets.tensor_split(self.world)[self.rank]
        return inputs, targets, self.world * inputs.shape[0] / rows

    def mean(self, values: list[float]) -> list[float]:
        """The mean of each of ``values`` over the ranks (one all-reduce, in float64)."""
        if not self.active:
            return values
        total = torch.tensor(values, dtype=torch.float64)
        with explained("all-reduce (loss)"):
            dist.all_reduce(total)
        return [value / self.world for value in total.tolist()]

    def any_later(self, flag: bool) -> bool:
        """Whether any rank had ``flag`` set at its previous call (one process: ``flag``
        now). Every rank gets the same answer at the same call, so all stop at the same step,
        and none waits for the others here: this call's flags are all-reduced in the
        background (gloo, on the host) while the next step runs, and read by the next call.
        A synchronous all-reduce at every step made each rank's host wait for the slowest
        one's (266 µs a step between two processes of a 2-core CPU). Once it answers True
        nothing is left in flight; after the last step, :meth:`settle_later` collects the
        last flags."""
        if not self.active:
            return flag
        stop = self.settle_later()
        if not stop:
            value = torch.tensor([int(flag)])
            with explained("all-reduce (stop request)"):
                work = dist.all_reduce(value, op=dist.ReduceOp.MAX, async_op=True)
            self._pending = (work, value)
        return stop

    def settle_later(self) -> bool:
        """Wait for the flags :meth:`any_later` left in flight, if any: whether a rank had
        its flag set."""
        pending, self._pending = self._pending, None
        if pending is None:
            return False
        work, value = pending
        with explained("all-reduce (stop request)"):
            work.wait()
        return bool(value)

    def max_(self, flags: torch.Tensor) -> None:
        """Leave in ``flags`` (on the training device) their elementwise maximum over the
        ranks: one all-reduce on the device, no host read."""
        if self.active:
            with explained("all-reduce (overflow check)"):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)

    def barrier(self) -> None:
        if self.active:
            with explained("barrier"):
                dist.barrier()

    def sync(self, model: nn.Module) -> None:
        """After backward: average the replicated gradients, scale the expert ones
        (:func:`sparseffn.distributed.sync_gradients`)."""
        if self.active:
            sync_gradients(model)

    def clip_grad_norm_(self, params: list[nn.Parameter], max_norm: float, model: nn.Module
                        ) -> None:
        """``torch.nn.utils.clip_grad_norm_`` over the whole model: the replicated gradients
        (equal on every rank after :meth:`sync`) once, the experts' of every rank. With
        sharded experts the norm stays on the training device: the experts' sum of squares
        is added over the ranks there (NCCL on GPUs), and ``clip_grads_with_norm_`` (the
        second half of ``clip_grad_norm_``) multiplies every gradient by ``min(1, max_norm /
        (norm + 1e-6))``, so the step reads nothing on the host."""
        params = [p for p in params if p.grad is not None]
        if not self.sharded:
            clip_grad_norm_(params, max_norm)
            return
        experts = {id(p) for p in expert_parameters(model)}
        replicated = _norm([p for p in params if id(p) not in experts], self.device)
        expert_squares = _norm([p for p in params if id(p) in experts], self.device).square()
        with explained("all-reduce (gradient norm)"):
            dist.all_reduce(expert_squares)
        norm = (replicated.square() + expert_squares).sqrt()
        scale_gradients_(params, max_norm, norm.float())

    # -- checkpoints -----------------------------------------------------------------------

    def split_checkpoint(self, model: nn.Module, optimizers: list[torch.optim.Optimizer]
                         ) -> tuple[dict, list[dict], dict]:
        """The model's and the optimizers' states in the one-process naming without the
        experts' tensors, and this rank's shard of them: ``{"model": {name: rows},
        "optimizers": [{index: {key: rows}}]}``."""
        model_state, experts = split_state_dict(model)
        shard = {"model": {name: value for name, (value, _) in experts.items()},
                 "optimizers": []}
        states = []
        for optimizer in optimizers:
            state = optimizer.state_dict()
            rows: dict = {}
            for index, param, _ in self._expert_slots(optimizer, model):
                if index not in state["state"]:
                    continue
                entry = dict(state["state"][index])    # a copy: the live state stays whole
                for key, value in list(entry.items()):
                    if torch.is_tensor(value) and value.shape == param.shape:
                        rows.setdefault(index, {})[key] = entry.pop(key)
                state["state"][index] = entry
            states.append(state)
            shard["optimizers"].append(rows)
        return model_state, states, shard

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, model: nn.Module,
                             state: dict) -> None:
        """Load a one-process optimizer state, keeping this rank's rows of the experts'."""
        if not self.sharded:
            optimizer.load_state_dict(state)
            return
        state = {"state": {i: dict(s) for i, s in state["state"].items()},
                 "param_groups": state["param_groups"]}
        for index, param, store in self._expert_slots(optimizer, model):
            rows = slice(store.first_expert, store.first_expert + store.experts_per_rank)
            for key, value in state["state"].get(index, {}).items():
                if torch.is_tensor(value) and value.dim() and value.shape[0] == store.num_experts \
                        and value.shape[1:] == param.shape[1:]:
                    state["state"][index][key] = value[rows].clone()
        optimizer.load_state_dict(state)

    def _expert_slots(self, optimizer, model):
        """(index in the optimizer's state, parameter, its store) of every expert parameter."""
        if not self.sharded:
            return []
        owner = {id(p): store for _, store in sharded_stores(model)
                 for p in store.expert_parameters()}
        params = [p for group in optimizer.param_groups for p in group["params"]]
        return [(i, p, owner[id(p)]) for i, p in enumerate(params) if id(p) in owner]

    def rng_states(self, state: dict) -> list[dict] | None:
        """Every rank's RNG ``state`` (on every rank), or None on one process."""
        if not self.active:
            return None
        states: list = [None] * self.world
        with explained("all-gather (RNG states)"):
            dist.all_gather_object(states, state)
        return states


def _norm(params: list[nn.Parameter], device: torch.device) -> torch.Tensor:
    """The 2-norm of the gradients of ``params`` together (:func:`sparseffn.optim.gradient_norm`:
    ``torch.nn.utils.get_total_norm``, sparse gradients too), a 0-d float64 tensor on
    ``device`` (also for no gradients)."""
    return gradient_norm(params).to(device=device, dtype=torch.float64)
