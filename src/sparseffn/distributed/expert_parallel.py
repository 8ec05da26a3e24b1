"""Expert parallelism: the experts of a mixture sharded across the processes of a
``torch.distributed`` group, as one more expert store (../DESIGN.md: router | store).

Each rank holds ``num_experts / world`` consecutive experts (rank r: experts
``[r·E_local, (r+1)·E_local)``) and a full copy of everything else (the router, attention,
embeddings: data parallelism). In a forward pass every rank routes its own tokens, then
(GShard, Lepikhin et al. 2020, arXiv:2006.16668 §2.2; Switch Transformer, Fedus et al. 2022,
arXiv:2101.03961 §2.2):

1. counts its (token, expert) pairs per owning rank and exchanges the counts
   (:func:`~sparseffn.distributed.exchange.exchange_counts`);
2. sends each pair's token row to the expert's rank (all-to-all with variable sizes: no
   padding to a global capacity; a router with a capacity factor has already dropped what it
   drops, and dropped pairs are never sent);
3. each rank runs its local experts on what it received, through the same store and kernels
   as one process (:class:`~sparseffn.stores.MLPExperts`), unweighted;
4. the inverse all-to-all brings each pair's output home, where the gates weight it and each
   token sums its k outputs in slot order (no atomics).

Steps 1-2 read the exchanged counts on the host. ``shard_experts(model,
fixed_exchange=FixedExchange(tokens=T, capacity_factor=f))`` instead sends, in training,
blocks of a fixed ``ceil(f · T·k / world)`` rows to each rank, as GShard's fixed-capacity
buffers do: nothing is read on the host, and pairs past a block are dropped (see
:class:`FixedExchange`).

The gates never leave their rank, so the router's gradient is computed at home. Gradients of
the experts stay on their rank; those of the replicated parameters are averaged as in data
parallelism: :func:`sync_gradients` after ``backward()`` (or DDP for the replicated part, with
:func:`ddp_ignore_expert_parameters`, and :func:`scale_expert_gradients`).

Usage (``torchrun --nproc-per-node N script.py``)::

    dist.init_process_group("gloo")            # or "nccl"
    model = build_model()                      # the same weights on every rank (same seed)
    shard_experts(model)                       # keeps this rank's experts only
    loss = model(local_batch).mean(); loss.backward()
    sync_gradients(model)                      # replicated: average; experts: 1/world
    optimizer.step()
    full = gathered_state_dict(model)          # the one-process state dict, on every rank

The auxiliary losses' batch statistics (σ-MoE's and S-BASE's mean selection distribution,
Eq. 34 of Csordás et al. 2023; Switch's f and p and the z-loss's mean; the noisy top-k
importance and load) are over the global batch, as the papers define them, at the cost of
one all-reduce of ``2·num_experts + 1`` numbers per layer: with equal weights, a step on N
ranks computes what one process computes on the N batches together (``batch_statistics=
"global"``, the default). ``"local"`` keeps them per rank, as DeepSpeed-MoE does. A capacity
factor always applies per rank, to its own tokens (GShard's groups), and GShard's loss is per
group by its definition. The per-forward ``routing_stats`` are this rank's;
:func:`~sparseffn.all_reduce_usage` sums the accumulated usage over ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from ..auxiliary import sparse_grad_parameters
from ..routing import RoutedFFN, Routing, recomputing
from ..stores import MLPExperts
from ..stores.base import ExpertStore
from .exchange import all_to_all, capacity_layout, exchange_counts
from .batch import GroupBatchSum
from .ddp import ddp_ignore
from .errors import explained
from .sparse_grads import all_reduce_sparse_grads

BATCH_STATISTICS = ("global", "local")


@dataclass(frozen=True)
class FixedExchange:
    """The expert exchange in blocks of a fixed size, for training: each rank sends each rank
    ``ceil(capacity_factor · tokens · k / world)`` rows per layer and forward (k: the
    layer's experts per token), whatever the routing, as GShard dispatches to buffers of a
    fixed capacity (Lepikhin et al. 2020, arXiv:2006.16668, §2.2). Nothing is read on the
    host, so the host never waits for the device at an expert layer.

    tokens: the tokens one rank routes in a training forward, **the same number on every
      rank** (the block size must be, and it is computed from this, not from each rank's
      batch). A forward with fewer tokens sends the same blocks, partly empty; one with
      more drops more.
    capacity_factor: the block's size relative to an even share (``tokens · k / world``).
      With balanced routing nothing is dropped at 1.0; at ``world`` nothing ever is.

    A destination's pairs beyond its block, the later tokens first, are dropped like pairs
    past an expert's capacity (Fedus et al. 2022, §2.2): their output is zero and their gate
    gets no gradient; ``routing_stats["exchange_dropped_fraction"]`` says how many of the
    rank's (token, slot) pairs were. Evaluation sends every pair (the exchange of sizes read
    on the host), so no evaluation output depends on the blocks.
    """

    tokens: int
    capacity_factor: float = 1.0

    def __post_init__(self) -> None:
        tokens, factor = self.tokens, self.capacity_factor
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens <= 0:
            raise ValueError(f"FixedExchange.tokens must be a positive integer (the tokens one "
                             f"rank routes in a training forward), got {tokens!r}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) \
                or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"FixedExchange.capacity_factor must be a finite number > 0, got "
                             f"{factor!r}")

    def capacity(self, k: int, world: int) -> int:
        """The rows each rank sends each rank: ``ceil(capacity_factor · tokens · k / world)``."""
        return math.ceil(self.capacity_factor * self.tokens * k / world)


def _checked_fixed_exchange(fixed_exchange, where: str) -> FixedExchange | None:
    if fixed_exchange is not None and not isinstance(fixed_exchange, FixedExchange):
        raise TypeError(f"{where}: fixed_exchange must be a FixedExchange or None, got "
                        f"{type(fixed_exchange).__name__}")
    return fixed_exchange


def _group_rank_world(group) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("expert parallelism needs an initialised torch.distributed process "
                           "group (dist.init_process_group, e.g. under torchrun)")
    return dist.get_rank(group), dist.get_world_size(group)


def _keep_sized_exchange_eager() -> None:
    """Make ``torch.compile`` run :meth:`ExpertParallelMLP._sized_exchange` eagerly (it reads
    its splits on the host). Done when the first store is built, not as the class is defined:
    ``torch.compiler.disable`` imports Dynamo (about 1.8 s), which a process that never
    shards experts, such as ``sparseffn train`` on one rank, does not need."""
    global _sized_exchange_kept_eager
    if not _sized_exchange_kept_eager:
        ExpertParallelMLP._sized_exchange = torch.compiler.disable(
            ExpertParallelMLP._sized_exchange, recursive=True)
        _sized_exchange_kept_eager = True


_sized_exchange_kept_eager = False


class ExpertParallelMLP(ExpertStore):
    """MLP experts sharded across the ranks of ``group``: this rank computes ``local`` (an
    :class:`~sparseffn.stores.MLPExperts` with ``num_experts / world`` experts, the global
    experts ``first_expert + i``) for every rank's tokens.

    forward(x: [T, d_model], routing over all ``num_experts``) -> [T, d_out], equal to what one
    process holding every expert computes (up to the order of floating-point sums).
    Parameters: ``local.*`` (this rank's experts; ``local.b_out``, a dense MLP's output bias,
    is replicated).

    Two exchanges:

    - ``fixed_exchange=None`` (the default): every dispatched pair is sent, in exchanges of
      the sizes the ranks tell each other first. One host read per forward: those sizes,
      which ``all_to_all_single`` takes as Python ints, so the host waits for the device at
      every layer and a CUDA graph cannot hold the store.
    - a :class:`FixedExchange`: in training, blocks of a fixed size to each rank, nothing
      read on the host, pairs past a block dropped; in evaluation, as None.

    ``torch.compile`` traces the fixed exchange's training forward into the model's graph
    (Dynamo turns its collectives into functional ones: no graph break, and its splits are
    constants); the exchange of sizes runs eagerly between compiled parts (a graph break
    around it), as it reads its splits on the host.
    """

    def __init__(self, local: MLPExperts, num_experts: int, group=None,
                 fixed_exchange: FixedExchange | None = None) -> None:
        super().__init__()
        _keep_sized_exchange_eager()
        rank, world = _group_rank_world(group)
        if local.num_experts * world != num_experts:
            raise ValueError(f"ExpertParallelMLP: {world} ranks of {local.num_experts} experts "
                             f"do not make {num_experts}")
        self.fixed_exchange = _checked_fixed_exchange(fixed_exchange, "ExpertParallelMLP")
        # the fixed exchange's pairs dropped and pairs in all, summed over training forwards
        # until exchange_drops() reads them (integers: a model's .to(dtype) leaves them be)
        self.register_buffer("exchange_counts", torch.zeros(2, dtype=torch.int64,
                                                            device=local.w1.device),
                             persistent=False)
        self.local = local
        self.group = group
        self.world = world
        self.num_experts = num_experts
        self.experts_per_rank = local.num_experts
        self.first_expert = rank * local.num_experts
        self.d_model, self.d_out = local.d_model, local.d_out

    def __setstate__(self, state) -> None:   # unpickled (torch.load of a whole model)
        _keep_sized_exchange_eager()
        super().__setstate__(state)

    def expert_parameters(self) -> list[nn.Parameter]:
        """The parameters that belong to this rank's experts only (not ``b_out``)."""
        return [p for name, p in self.local.named_parameters() if name != "b_out"]

    def reset_parameters(self) -> None:
        self.local.reset_parameters()

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        if routing.dense:
            raise ValueError("ExpertParallelMLP: a dense routing (every token to every expert, "
                             "the soft mode of a fast feed-forward tree) is not expert-parallel; "
                             "use a sparse train_mode or keep the layer unsharded")
        experts = routing.indices.reshape(-1)
        owner = torch.div(experts, self.experts_per_rank, rounding_mode="floor")
        if routing.dispatched is not None:   # dropped at capacity: a rank past the last, never sent
            owner = torch.where(routing.dispatched.reshape(-1), owner, self.world)
        if self.fixed_exchange is not None and self.training:
            y = self._fixed_exchange(x, routing, experts, owner)
        else:
            y = self._sized_exchange(x, routing, experts, owner)
        local = self.local
        return y if local.b_out is None else y + local.b_out.to(y.dtype)

    def _sized_exchange(self, x: torch.Tensor, routing: Routing, experts: torch.Tensor,
                        owner: torch.Tensor) -> torch.Tensor:
        """Every dispatched pair, in exchanges of the sizes the ranks tell each other: one
        host read (the split sizes)."""
        k = routing.indices.shape[1]
        # the pairs in the order of their ranks, stable; one host read: the split sizes
        order = torch.argsort(owner, stable=True)
        send = torch.bincount(owner, minlength=self.world + 1)[:self.world]
        recv = exchange_counts(send, self.group)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        order = order[:sum(send_splits)]
        rows = self._rows(x, torch.div(order, k, rounding_mode="floor"))            # [P, d]
        rows = all_to_all(rows, send_splits, recv_splits, self.group)               # [R, d]
        local_ids = all_to_all(experts.index_select(0, order) % self.experts_per_rank,
                               send_splits, recv_splits, self.group)                 # [R]
        out = self._expert_outputs(rows, local_ids)                                  # [R, d_out]
        back = all_to_all(out, recv_splits, send_splits, self.group)                 # [P, d_out]
        return self._combine(back, order, routing)

    def _fixed_exchange(self, x: torch.Tensor, routing: Routing, experts: torch.Tensor,
                        owner: torch.Tensor) -> torch.Tensor:
        """At most ``capacity`` pairs to each rank, in exchanges of ``world · capacity`` rows
        whatever the routing (:func:`~sparseffn.distributed.exchange.capacity_layout`): no
        host read. Records ``exchange_dropped_fraction`` in the routing's stats."""
        tokens, k = routing.indices.shape
        capacity = self.fixed_exchange.capacity(k, self.world)
        order, source, filled = capacity_layout(owner, self.world, capacity)
        if tokens:
            pair_of_row = order.index_select(0, source)                              # [W·C]
            rows = self._rows(x, torch.div(pair_of_row, k, rounding_mode="floor"))
            local_ids = torch.where(filled, experts.index_select(0, pair_of_row)
                                    % self.experts_per_rank, -1)
        else:   # no token here: empty blocks, which the other ranks still expect; made
            # from x, so that this rank's backward runs the same exchanges as theirs
            pair_of_row = source
            rows = self._rows(torch.cat((x, x.new_zeros(1, x.shape[1]))), source)
            local_ids = torch.full_like(source, -1)
        splits = [capacity] * self.world
        rows = all_to_all(rows, splits, splits, self.group)                          # [W·C, d]
        local_ids = all_to_all(local_ids, splits, splits, self.group)                # [W·C]
        out = self._expert_outputs(rows, local_ids.clamp(min=0), filled=local_ids >= 0)
        back = all_to_all(out, splits, splits, self.group)                           # [W·C, d_out]
        dropped = (owner < self.world).sum() - filled.sum()
        routing.stats["exchange_dropped_fraction"] = (
            dropped.float() / max(tokens * k, 1)).detach()
        if not recomputing():   # an activation checkpoint's second forward counts nothing
            self.exchange_counts[0].add_(dropped)
            self.exchange_counts[1].add_(tokens * k)   # a Python number: no copy to the device
        # the pair each row of the blocks carries; tokens·k (past the last) for an empty row
        return self._combine(back, torch.where(filled, pair_of_row, tokens * k), routing)

    def _rows(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The rows of ``x`` to send, in the experts' dtype."""
        rows = x.index_select(0, tokens)
        dtype = self.local.input_dtype(rows)
        if dtype is not None and rows.dtype != dtype:
            # cast before the exchange, not after: half the bytes sent each way under bf16
            # autocast, and the same bits (the experts would cast each row the same way)
            rows = rows.to(dtype)
        return rows

    def _expert_outputs(self, rows: torch.Tensor, local_ids: torch.Tensor,
                        filled: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's experts on the rows it received, unweighted; rows where ``filled`` is
        False are not computed (their output is zero)."""
        ones = torch.ones(local_ids.shape[0], 1, dtype=torch.float32, device=rows.device)
        return self.local.expert_output(rows, Routing(
            indices=local_ids.unsqueeze(1), weights=ones,
            dispatched=None if filled is None else filled.unsqueeze(1)))

    @staticmethod
    def _combine(back: torch.Tensor, pairs: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Home again: weight each output row (``back`` [J, d_out], of pair ``pairs[j]``, or
        of none where ``pairs[j]`` is T·k) by its pair's gate, and sum each token's k slots
        in order (no atomics). A pair no row carries contributes zero, and its gate gets no
        gradient."""
        tokens, k = routing.indices.shape
        # rows that carry no pair: gate 0, written to a spare slot past the last
        weights = torch.cat((routing.weights.reshape(-1), routing.weights.new_zeros(1)))
        gates = weights.index_select(0, pairs).to(back.dtype)
        slots = back.new_zeros(tokens * k + 1, back.shape[1]).index_copy(
            0, pairs, back * gates.unsqueeze(1))
        return slots[:tokens * k].view(tokens, k, back.shape[1]).sum(1)

    def extra_repr(self) -> str:
        exchange = "" if self.fixed_exchange is None else f", {self.fixed_exchange}"
        return (f"num_experts={self.num_experts}, world={self.world}, "
                f"experts {self.first_expert}..{self.first_expert + self.experts_per_rank - 1} "
                f"here{exchange}")


def sharded_stores(model: nn.Module):
    """``(name, store)`` of every layer of ``model`` whose experts :func:`shard_experts`
    sharded (``name``: the layer's module name)."""
    for name, module in model.named_modules():
        if isinstance(module, RoutedFFN) and isinstance(module.store, ExpertParallelMLP):
            yield name, module.store


@torch.no_grad()
def _local_copy(store: MLPExperts, first: int, count: int) -> MLPExperts:
    """A store of experts ``first .. first + count - 1`` of ``store``, sharing nothing."""
    local = MLPExperts(count, store.d_model, store.expert_size, store.d_out,
                       activation=store.activation, bias=store.b2 is not None,
                       dense_bias=store.b_out is not None, dropout=store.hidden_dropout.p,
                       init=store.init, init_depth=store.init_depth,
                       gated=store.w_gate is not None).to(store.w1.device, store.w1.dtype)
    for name, param in local.named_parameters():
        source = getattr(store, name)
        param.copy_(source if name == "b_out" else source[first:first + count])
    return local.train(store.training)


def shard_experts(model: nn.Module, group=None, batch_statistics: str = "global",
                  fixed_exchange: FixedExchange | None = None) -> list[str]:
    """Keep on this rank only its share of the experts of every mixture of MLP experts in
    ``model`` (any :class:`~sparseffn.routing.RoutedFFN` with an
    :class:`~sparseffn.stores.MLPExperts` store: :class:`~sparseffn.MoE` with every router,
    :class:`~sparseffn.SigmaMoE`, a sparse-trained FFF), in place; returns their names.

    Call it on the same weights on every rank (build the model from one seed, or load one
    checkpoint first): rank r keeps experts ``[r·E/world, (r+1)·E/world)``. ``num_experts``
    must be a multiple of the group's size. ``batch_statistics``: ``"global"`` (the routers'
    aux losses over every rank's tokens) or ``"local"`` (over this rank's; see the module's
    notes). ``fixed_exchange``: None (every pair, in exchanges whose sizes are read on the
    host) or a :class:`FixedExchange` (in training, blocks of a fixed size, nothing read on
    the host, pairs past a block dropped).
    """
    if batch_statistics not in BATCH_STATISTICS:
        raise ValueError(f"batch_statistics must be one of {BATCH_STATISTICS}, got "
                         f"{batch_statistics!r}")
    _checked_fixed_exchange(fixed_exchange, "shard_experts")   # before any layer changes
    rank, world = _group_rank_world(group)
    names = []
    for name, module in model.named_modules():
        if not (isinstance(module, RoutedFFN) and isinstance(module.store, MLPExperts)):
            continue
        store = module.store
        if store.num_experts % world:
            raise ValueError(f"shard_experts: {name or type(module).__name__} has "
                             f"{store.num_experts} experts, not a multiple of the {world} ranks")
        count = store.num_experts // world
        module.store = ExpertParallelMLP(_local_copy(store, rank * count, count),
                                         store.num_experts, group, fixed_exchange)
        module.router.global_batch = GroupBatchSum(group) if batch_statistics == "global" \
            else None
        names.append(name)
    return names


@torch.no_grad()
def exchange_drops(model: nn.Module) -> float | None:
    """The share of (token, slot) pairs that the fixed-size exchanges of ``model``'s sharded
    layers dropped in the training forwards since the last call, over every rank and layer
    (None when no layer has a :class:`FixedExchange`); then start counting again. Every rank
    must call it: one all-reduce and one host read, for a training loop to call where it
    reads anyway (as ``sparseffn train`` does at its log steps)."""
    stores = [store for _, store in sharded_stores(model) if store.fixed_exchange is not None]
    if not stores:
        return None
    counts = torch.stack([store.exchange_counts for store in stores]).sum(0)   # [dropped, all]
    with explained("all-reduce (exchange drops)", stores[0].group):
        dist.all_reduce(counts, group=stores[0].group)
    for store in stores:
        store.exchange_counts.zero_()
    dropped, pairs = counts.tolist()
    return dropped / pairs if pairs else 0.0


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of ``model`` that live on this rank only (its experts)."""
    return [p for _, store in sharded_stores(model) for p in store.expert_parameters()]


def ddp_ignore_expert_parameters(model: nn.Module) -> list[str]:
    """Keep the expert parameters out of a ``DistributedDataParallel(model)`` built afterwards
    (each rank's are different: DDP must neither broadcast nor average them), and the
    sharded stores' own counts (``exchange_counts``, each rank's); returns their names.
    After ``backward()`` call :func:`scale_expert_gradients`."""
    ids = {id(p) for p in expert_parameters(model)}
    names = [name for name, p in model.named_parameters() if id(p) in ids]
    names += [f"{name}.store.exchange_counts" if name else "store.exchange_counts"
              for name, _ in sharded_stores(model)]
    return ddp_ignore(model, names)


@torch.no_grad()
def scale_expert_gradients(model: nn.Module, group=None) -> None:
    """Divide the expert gradients by the group's size, as data parallelism divides the
    replicated ones: each rank's expert gradient sums the contributions of every rank's
    tokens, and the objective is the mean of the ranks' losses. An expert that received no
    token gets a zero gradient (never ``None``, so every rank's optimizer steps alike)."""
    _, world = _group_rank_world(group)
    for p in expert_parameters(model):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        else:
            p.grad.div_(world)


@torch.no_grad()
def sync_gradients(model: nn.Module, group=None) -> None:
    """After ``backward()`` without DDP: average the gradients of the replicated parameters
    over the group (one all-reduce of them all, flattened; a missing gradient counts as zero
    on that rank; sparse-gradient tables by :func:`all_reduce_sparse_grads`) and scale the
    expert gradients (:func:`scale_expert_gradients`). Every rank's gradients are then those
    of the mean of the ranks' losses."""
    _, world = _group_rank_world(group)
    skip = {id(p) for p in expert_parameters(model)} | \
        {id(p) for p in sparse_grad_parameters(model)}
    replicated = [p for p in model.parameters() if p.requires_grad and id(p) not in skip]
    if replicated:
        for p in replicated:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in replicated])
        with explained("gradient all-reduce", group):
            dist.all_reduce(flat, group=group)
        flat.div_(world)
        offset = 0
        for p in replicated:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    all_reduce_sparse_grads(model, group)
    scale_expert_gradients(model, group)


@torch.no_grad()
def split_state_dict(model: nn.Module) -> tuple[dict, dict[str, tuple[torch.Tensor, ExpertParallelMLP]]]:
    """``model``'s state dict in the one-process naming, split in two: everything but the
    experts, and ``{name: (this rank's rows, its store)}`` for each expert parameter (``….store.w1``
    of ``num_experts / world`` rows here). ``b_out``, replicated, stays in the first part."""
    state = model.state_dict()
    experts = {}
    for name, store in sharded_stores(model):
        prefix = f"{name}.store." if name else "store."
        own = {id(p) for p in store.expert_parameters()}
        for pname, param in store.local.named_parameters():
            value = state.pop(f"{prefix}local.{pname}")
            if id(param) in own:
                experts[prefix + pname] = (value, store)
            else:
                state[prefix + pname] = value
    return state, experts


@torch.no_grad()
def gathered_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state dict as one process holding every expert would have it (keys
    ``….store.w1`` of all ``num_experts``), on every rank: load it into an unsharded model,
    or into any number of ranks with :func:`shard_experts` after loading. One all-gather per
    expert parameter."""
    state, experts = split_state_dict(model)
    for name, (value, store) in experts.items():
        parts = [torch.empty_like(value) for _ in range(store.world)]
        with explained("all-gather of the experts", store.group):
            dist.all_gather(parts, value.contiguous(), group=store.group)
        state[name] = torch.cat(parts)
    return state
