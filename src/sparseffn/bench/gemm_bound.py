"""The expert GEMMs of a mixture alone: what the BLAS gives for the MoE's matrix shapes.

A perfect dispatch (no routing, no gather, no scatter, no epilogues) still has to multiply
each expert's rows by that expert's weights. :class:`ExpertGemms` times exactly those
multiplications on rows that are already sorted by expert and contiguous, with the
per-expert row counts of a real routing, each one a multi-threaded ``torch.mm`` into
preallocated outputs: what the BLAS gives the MoE's shapes with no dispatch at all.

The ratio MoE / expert GEMMs is what routing and dispatch add on top of the products; expert
GEMMs / active-equal dense is what the thinner expert matrices cost by themselves (the
products of experts of width 128 run slower per FLOP than those of one dense layer of width
k·128). It is a reference point, not a strict floor: the fused kernels of
:mod:`sparseffn.ops.native` run their products in L2-sized pieces and can beat it.
"""

from __future__ import annotations

import torch


class ExpertGemms:
    """σ-MoE's expert matrix products on pre-sorted contiguous rows; call it to run them.

    counts: rows per expert (the routing's [tokens·k] pairs split by expert).
    Forward, per expert e with rows ``x[r_e]`` [n_e, d_model]: ``h[r_e] = x[r_e] w1[e]ᵀ``
    [n_e, G] and ``y[r_e] = h[r_e] w2[e]`` [n_e, d_model]. With ``backward`` also the four
    products of the backward pass: ``dh[r_e] = dy[r_e] w2[e]ᵀ``, ``dw2[e] = h[r_e]ᵀ dy[r_e]``,
    ``dx[r_e] = dh[r_e] w1[e]`` and ``dw1[e] = dh[r_e]ᵀ x[r_e]``. Weights are laid out as in
    :class:`~sparseffn.layers.SigmaMoE` (``w1``, ``w2``: [E, G, d_model]). Each product is
    one multi-threaded ``torch.mm`` into a preallocated output, so with many small experts
    the few microseconds of each call are part of the time.
    """

    def __init__(self, counts: list[int], d_model: int, expert_size: int, backward: bool,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        rows, num_experts = sum(counts), len(counts)
        self.backward = backward
        self.w1 = torch.randn(num_experts, expert_size, d_model, generator=gen)
        self.w2 = torch.randn(num_experts, expert_size, d_model, generator=gen)
        self.x = torch.randn(rows, d_model, generator=gen)
        self.dy = torch.randn(rows, d_model, generator=gen)
        self.h = torch.empty(rows, expert_size)
        self.dh = torch.empty(rows, expert_size)
        self.y = torch.empty(rows, d_model)
        self.dx = torch.empty(rows, d_model)
        self.dw1, self.dw2 = torch.empty_like(self.w1), torch.empty_like(self.w2)
        self.blocks = [(e, slice(start, start + n))
                       for e, (start, n) in enumerate(zip(_starts(counts), counts)) if n > 0]

    def __call__(self) -> None:
        x, h, y, dy, dh, dx = self.x, self.h, self.y, self.dy, self.dh, self.dx
        w1, w2, dw1, dw2 = self.w1, self.w2, self.dw1, self.dw2
        for e, r in self.blocks:
            torch.mm(x[r], w1[e].t(), out=h[r])
            torch.mm(h[r], w2[e], out=y[r])
            if self.backward:
                torch.mm(dy[r], w2[e].t(), out=dh[r])
                torch.mm(h[r].t(), dy[r], out=dw2[e])
                torch.mm(dh[r], w1[e], out=dx[r])
                torch.mm(dh[r].t(), x[r], out=dw1[e])


def _starts(counts: list[int]) -> list[int]:
    starts, total = [], 0
    for n in counts:
        starts.append(total)
        total += n
    return starts
