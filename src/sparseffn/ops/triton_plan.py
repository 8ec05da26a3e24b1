"""A Triton counting sort for :class:`~sparseffn.ops.cvmm.DispatchPlan` on GPUs
(``sparseffn::expert_order``).

A plan sorts a batch's (token, slot) pairs by expert, stably, and counts each expert's pairs.
In PyTorch ops that is a cast of the keys, a stable ``torch.sort`` (on CUDA a radix sort of
several kernels, with their scratch allocations), an ``arange``, a ``searchsorted`` over the
experts' boundaries, a ``sub`` for the counts and a ``floor_divide`` for each row's token:
about eight launches a layer, for keys that take at most a few hundred values.

A counting sort does it in two launches, with no atomics and no host read:

1. each program counts the keys of one chunk of the pairs by expert (``[chunks, BINS]``
   counts; bin E holds the pairs dropped at capacity);
2. each program reads every chunk's counts, so it knows where each expert's block starts
   (the totals of the experts before it) and how many of the expert's pairs lie in earlier
   chunks, then walks its own chunk in order, placing each pair after the earlier pairs of
   its expert: the rank of a pair among its block's equal keys is an exclusive cumulative
   sum of one-hot rows. It writes the sorted order, each row's token and (program 0) the
   per-expert counts.

The result is the stable sort's, element for element, so every product downstream is the
same bits. The same two launches give Switch's capacity positions
(:func:`~sparseffn.ops.assignment.positions_in_expert`, ``sparseffn::expert_positions``): a
pair's rank among its expert's pairs, its sorted row less the expert's first row.

A key outside ``[0, E]`` (an invalid expert index, checked on the host only where
:func:`sparseffn.ops.debug.set_checks` asks) is sorted with the dropped pairs: the order is
always a permutation and such a pair is never computed.

``SPARSEFFN_COUNTING_SORT=0`` in the environment (or :func:`set_counting_sort_enabled`) keeps
the PyTorch sort on GPUs too. Without a GPU the kernels run on CPU tensors in Triton's
interpreter (see :mod:`~sparseffn.ops.triton_cvmm`).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
from torch import Tensor

from . import triton_cvmm
from .triton_cvmm import cdiv, next_power_of_2, tl, triton
from .written import written_in_full

# Experts + 1 (the dropped pairs' bin) held as one-hot columns in registers; more experts take
# the PyTorch sort.
MAX_BINS = 256
MAX_EXPERTS = MAX_BINS - 1
# Pairs a program counts and places, at least; more when there would be over MAX_CHUNKS
# chunks, since every program of the second launch reads all chunks' counts.
CHUNK = 1024
MAX_CHUNKS = 256
# Elements of one [pairs, BINS] one-hot block in registers.
_BLOCK_ELEMENTS = 4096


_enabled = os.environ.get("SPARSEFFN_COUNTING_SORT", "1") != "0"


def set_counting_sort_enabled(enabled: bool) -> None:
    """Sort plans and positions by these kernels where they apply (``True``, the default
    unless the environment sets ``SPARSEFFN_COUNTING_SORT=0``) or by the PyTorch sort."""
    global _enabled
    _enabled = bool(enabled)


def usable(keys: Tensor, num_experts: int) -> bool:
    """True when the counting sort takes these keys: enabled, Triton present and enabled, a
    CUDA tensor (or a CPU tensor under the interpreter), at most ``MAX_EXPERTS`` experts."""
    return _enabled and num_experts <= MAX_EXPERTS and triton_cvmm.on_kernel_device(keys)


if triton is not None:

    @triton.jit
    def _bin_of(keys_ptr, i, n, num_experts):
        """The bin of pairs ``i`` [BLOCK]: the expert, or ``num_experts`` for a dropped pair
        or a key outside ``[0, num_experts)``; -1 past the end (in no bin)."""
        key = tl.load(keys_ptr + i, mask=i < n, other=-1)
        inside = (key >= 0) & (key < num_experts)
        return tl.where(i < n, tl.where(inside, key, num_experts), -1).to(tl.int32)

    @triton.jit
    def _chunk_counts_kernel(keys_ptr, weights_ptr, counts_ptr, mass_ptr, n, chunk,
                             num_experts, BINS: tl.constexpr, BLOCK: tl.constexpr,
                             HAS_WEIGHTS: tl.constexpr):
        """Row ``program_id`` of counts [chunks, BINS]: the pairs of chunk ``program_id`` in
        each bin; with HAS_WEIGHTS, of mass [chunks, BINS] too: their weights' float32 sum."""
        pid = tl.program_id(0)
        bins = tl.arange(0, BINS)
        total = tl.zeros((BINS,), tl.int32)
        mass = tl.zeros((BINS,), tl.float32)
        for offset in range(0, chunk, BLOCK):
            i = pid * chunk + offset + tl.arange(0, BLOCK)
            hit = _bin_of(keys_ptr, i, n, num_experts)[:, None] == bins[None, :]
            total += tl.sum(hit.to(tl.int32), 0)
            if HAS_WEIGHTS:
                w = tl.load(weights_ptr + i, mask=i < n, other=0.0).to(tl.float32)
                mass += tl.sum(tl.where(hit, w[:, None], 0.0), 0)
        tl.store(counts_ptr + pid * BINS + bins, total)
        if HAS_WEIGHTS:
            tl.store(mass_ptr + pid * BINS + bins, mass)

    @triton.jit
    def _sum_chunks(chunk_mass_ptr, num_chunks, BINS: tl.constexpr, BLOCK_C: tl.constexpr):
        """The chunks' masses [num_chunks, BINS] summed per bin, in chunk order: [BINS]."""
        bins = tl.arange(0, BINS)
        mass = tl.zeros((BINS,), tl.float32)
        for c in range(0, num_chunks, BLOCK_C):
            cs = c + tl.arange(0, BLOCK_C)
            mass += tl.sum(tl.load(chunk_mass_ptr + cs[:, None] * BINS + bins[None, :],
                                   mask=(cs < num_chunks)[:, None], other=0.0), 0)
        return mass

    @triton.jit
    def _place_pairs_kernel(keys_ptr, chunk_counts_ptr, order_ptr, token_ptr, counts_ptr,
                            position_ptr, chunk_mass_ptr, mass_ptr, n, chunk, num_chunks,
                            num_experts, k, BINS: tl.constexpr, BLOCK: tl.constexpr,
                            BLOCK_C: tl.constexpr, ORDER: tl.constexpr,
                            HAS_WEIGHTS: tl.constexpr):
        """Sorted row of each pair of chunk ``program_id``. With ORDER: ``order[row] = pair``,
        ``token[row] = pair // k``, and program 0 writes the per-expert counts [E] (and with
        HAS_WEIGHTS the per-expert mass [E], the chunks' masses summed); without ORDER:
        ``position[pair]``, the pair's rank among its expert's pairs (row less the expert's
        first row)."""
        pid = tl.program_id(0)
        bins = tl.arange(0, BINS)
        total = tl.zeros((BINS,), tl.int32)
        earlier_chunks = tl.zeros((BINS,), tl.int32)
        for c in range(0, num_chunks, BLOCK_C):
            cs = c + tl.arange(0, BLOCK_C)
            counts = tl.load(chunk_counts_ptr + cs[:, None] * BINS + bins[None, :],
                             mask=(cs < num_chunks)[:, None], other=0)
            total += tl.sum(counts, 0)
            earlier_chunks += tl.sum(tl.where((cs < pid)[:, None], counts, 0), 0)
        if ORDER:
            experts_here = tl.where(pid == 0, num_experts, 0)   # program 0 writes the counts
            tl.store(counts_ptr + bins, total.to(tl.int64), mask=bins < experts_here)
            if HAS_WEIGHTS:
                if pid == 0:
                    tl.store(mass_ptr + bins, _sum_chunks(chunk_mass_ptr, num_chunks, BINS,
                                                          BLOCK_C), mask=bins < num_experts)
            # the next free row of each bin: its block's start, after earlier chunks' pairs
            cursor = tl.cumsum(total, 0) - total + earlier_chunks
        else:     # ranks within each bin: its block starts at 0
            cursor = earlier_chunks
        for offset in range(0, chunk, BLOCK):
            i = pid * chunk + offset + tl.arange(0, BLOCK)
            hit = (_bin_of(keys_ptr, i, n, num_experts)[:, None] == bins[None, :]).to(tl.int32)
            # each pair after its bin's cursor and the block's earlier pairs of that bin
            row = tl.sum(hit * (tl.cumsum(hit, 0) - hit + cursor[None, :]), 1)
            if ORDER:
                tl.store(order_ptr + row, i.to(tl.int64), mask=i < n)
                tl.store(token_ptr + row, (i // k).to(tl.int64), mask=i < n)
            else:
                tl.store(position_ptr + i, row.to(tl.int64), mask=i < n)
            cursor += tl.sum(hit, 0)


def _sizes(num_pairs: int, num_experts: int, chunk: Optional[int]) -> tuple[int, int, int, int]:
    """(BINS, BLOCK, chunk, chunks) for ``num_pairs`` pairs: ``chunk`` pairs a program (at
    least ``CHUNK``, a multiple of BLOCK, unless given) and at most ``MAX_CHUNKS`` chunks."""
    bins = max(16, next_power_of_2(num_experts + 1))
    block = max(1, min(128, _BLOCK_ELEMENTS // bins))
    if chunk is None:
        chunk = max(CHUNK, next_power_of_2(cdiv(num_pairs, MAX_CHUNKS)))
    chunk = cdiv(chunk, block) * block
    return bins, block, chunk, cdiv(num_pairs, chunk)


def _count_and_place(keys: Tensor, num_experts: int, chunk: Optional[int], *,
                     sorted_out: Optional[tuple[Tensor, Tensor, Tensor, Tensor]] = None,
                     positions: Optional[Tensor] = None, k: int = 1,
                     weights: Optional[Tensor] = None) -> None:
    """The two launches over non-empty ``keys``, writing either ``sorted_out`` (order,
    token_of_row, counts, mass; the mass where ``weights`` are given) or ``positions``. The
    pointers of the other mode are never read: None."""
    num_pairs = keys.shape[0]
    bins, block, chunk, chunks = _sizes(num_pairs, num_experts, chunk)
    chunk_counts = torch.empty(chunks, bins, dtype=torch.int32, device=keys.device)
    has_weights = weights is not None
    chunk_mass = torch.empty(chunks, bins, dtype=torch.float32,
                             device=keys.device) if has_weights else None
    keys = keys.contiguous()
    _chunk_counts_kernel[(chunks,)](keys, weights.contiguous() if has_weights else None,
                                    chunk_counts, chunk_mass, num_pairs, chunk, num_experts,
                                    BINS=bins, BLOCK=block, HAS_WEIGHTS=has_weights)
    block_c = max(1, min(next_power_of_2(chunks), _BLOCK_ELEMENTS // bins))
    order = sorted_out is not None
    order_out, token_out, counts_out, mass_out = sorted_out if order else (None,) * 4
    _place_pairs_kernel[(chunks,)](keys, chunk_counts, order_out, token_out, counts_out,
                                   positions, chunk_mass, mass_out, num_pairs, chunk, chunks,
                                   num_experts, k, BINS=bins, BLOCK=block, BLOCK_C=block_c,
                                   ORDER=order, HAS_WEIGHTS=has_weights and order)


@written_in_full()
def expert_order(keys: Tensor, num_experts: int, k: int, weights: Optional[Tensor] = None,
                 chunk: Optional[int] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The stable sort of the pairs by expert. keys: integer [S], the expert of each pair
    ``token · k + slot``, or ``num_experts`` for a pair dropped at capacity; weights:
    optional float [S], each pair's routing weight.

    Returns ``(order, token_of_row, counts, mass)``: int64 [S] (``order[r]``, the pair of
    sorted row r), int64 [S] (``order // k``; ``order`` for k = 0), int64 [E] (pairs per
    expert, dropped ones not counted) and float32 [E] (the weights of each expert's pairs
    summed, per chunk in pair order and then in chunk order: the same sum on every run), or
    an empty tensor without ``weights``. ``chunk`` sets the pairs a program sorts (the tests
    lower it to give the sort many chunks)."""
    num_pairs = keys.shape[0]
    device = keys.device
    order = torch.empty(num_pairs, dtype=torch.int64, device=device)
    token_of_row = torch.empty(num_pairs, dtype=torch.int64, device=device)
    counts = torch.empty(num_experts, dtype=torch.int64, device=device)
    mass = torch.empty(num_experts if weights is not None else 0, dtype=torch.float32,
                       device=device)
    if num_pairs == 0:
        return order, token_of_row, counts.zero_(), mass.zero_()
    _count_and_place(keys, num_experts, chunk, sorted_out=(order, token_of_row, counts, mass),
                     k=max(k, 1), weights=weights)
    return order, token_of_row, counts, mass


@written_in_full()
def positions_in_expert(experts: Tensor, num_experts: int,
                        chunk: Optional[int] = None) -> Tensor:
    """The buffer position of each pair at its expert (how many earlier pairs chose the same
    expert), from the same two launches. experts: integer [P] in ``[0, num_experts)``;
    returns int64 [P]. A key outside that range is ranked among them all (as the dropped
    pairs of :func:`expert_order`)."""
    positions = torch.empty(experts.shape[0], dtype=torch.int64, device=experts.device)
    if experts.shape[0]:
        _count_and_place(experts, num_experts, chunk, positions=positions)
    return positions
