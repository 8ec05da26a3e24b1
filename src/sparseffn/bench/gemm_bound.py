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
    :class:`~sparseffn.layers.SigmaMoE` (``w1``, ``w2``: [E, G, d_model]), on ``device`` in
    ``dtype`` (bf16 for a bf16-autocast comparison: the products autocast would run). Each product is
    one multi-threaded ``torch.mm`` into a preallocated output, so with many small experts
    the few microseconds of each call are part of the time.
    """

    def __init__(self, counts: list[int], d_model: int, expert_size: int, backward: bool,
                 seed: int = 0, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        rows, num_experts = sum(counts), len(counts)
        self.backward = backward

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

        def empty(*shape):
            return torch.empty(*shape, device=device, dtype=dtype)
        self.w1 = randn(num_experts, expert_size, d_model)
        self.w2 = randn(num_experts, expert_size, d_model)
        self.x = randn(rows, d_model)
        self.dy = randn(rows, d_model)
        self.h = empty(rows, expert_size)
        self.dh = empty(rows, expert_size)
        self.y = empty(rows, d_model)
        self.dx = empty(rows, d_model)
        self.dw1, self.dw2 = torch.empty_like(self.w1), torch.empty_like(self.w2)
        # Each expert's row blocks and matrices as views, made once here so that the timed
        # call does nothing but the products. Experts without rows are skipped.
        per_expert = zip(*(t.split(counts) for t in (self.x, self.h, self.y, self.dy,
                                                      self.dh, self.dx)),
                         self.w1, self.w2, self.dw1, self.dw2, counts)
        self._blocks = [views[:-1] for views in per_expert if views[-1] > 0]

    def __call__(self) -> None:
        for x, h, y, dy, dh, dx, w1, w2, dw1, dw2 in self._blocks:
            torch.mm(x, w1.t(), out=h)
            torch.mm(h, w2, out=y)
            if self.backward:
                torch.mm(dy, w2.t(), out=dh)
                torch.mm(h.t(), dy, out=dw2)
                torch.mm(dh, w1, out=dx)
                torch.mm(dh.t(), x, out=dw1)
