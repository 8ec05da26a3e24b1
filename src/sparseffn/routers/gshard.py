"""GShard's group-level top-2 gating (Lepikhin et al. 2021, arXiv:2006.16668, Algorithm 1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from ..ops.assignment import positions_in_expert
from ..ops.sizes import exported_for_any_size
from ..registry import RouterConfig, implements, require_capacity_factor, require_router_k
from ..routing import Routing
from ..validation import require_choice, require_non_negative, require_positive_int
from .base import (LinearRouter, ROUTER_PRECISIONS, active_capacity_factor, capacity_of,
                   count_max, count_min, selected_scores)

GSHARD_SECOND_EXPERT = ("random", "all")


@dataclass(frozen=True)


class GShardRouterConfig(RouterConfig):
    """GShard top-2 gating (Lepikhin et al. 2021, arXiv:2006.16668, Algorithm 1).

    Tokens are split into groups of ``group_size`` (None: the whole batch is one group). In
    each group every expert has a buffer of ``capacity = ceil(capacity_factor · 2 · group_size /
    num_experts)`` positions; the first
    choices fill it in token order, then the second choices, each dispatched only with
    probability ``min(1, 2 · g2)`` (``second_expert="random"``, during training; at
    evaluation and with ``"all"`` every second choice is dispatched). ``capacity_factor`` 0 or
    None: dropless.

    eval_capacity_factor: the capacity factor in evaluation mode (``module.eval()``); None or 0
      (the default): dropless, so a token's output does not depend on the tokens evaluated
      with it (see :func:`~sparseffn.routers.base.active_capacity_factor`).

    aux_weight: weight of the group auxiliary loss ``(1/E) Σ_e (c_e / S) · m_e`` (line 13).
    precision: the selection product ``W x`` in ``"float32"`` (the default; Switch's
      "selective precision") or ``"autocast"`` (see
      :func:`~sparseffn.routers.base.selection_linear`).
    """

    type_name: ClassVar[str] = "gshard"

    capacity_factor: float | None = 1.0
    eval_capacity_factor: float | None = None
    group_size: int | None = None
    second_expert: str = "random"
    aux_weight: float = 0.01
    precision: str = "float32"

    def __post_init__(self) -> None:
        require_choice(self, "precision", ROUTER_PRECISIONS)
        require_capacity_factor(self)
        require_capacity_factor(self, "eval_capacity_factor")
        if self.group_size is not None:
            require_positive_int(self, "group_size")
        require_choice(self, "second_expert", GSHARD_SECOND_EXPERT)
        require_non_negative(self, "aux_weight")

    def check_layer(self, num_experts: int, k: int) -> None:
        require_router_k(self, k, 2, "its top-2 experts")
        if num_experts < 2:
            raise ValueError(f"GShardRouterConfig needs at least 2 experts, got {num_experts}")

    def aux_loss_weights(self) -> dict[str, float]:
        return {"gshard": self.aux_weight}


@dataclass


class Top2Assignment:
    """The result of :func:`gshard_top2` for T tokens.

    indices: int64 [T, 2], (e1, e2). combine: [T, 2], the combine weights 𝒢 (g1, g2 normalised
    by g1 + g2, zero where not dispatched). dispatched: bool [T, 2]. positions: int64 [T, 2],
    the buffer position each choice was given. aux_loss: scalar, the mean over groups of
    ℓ_aux (line 13), or None when not asked for.
    """

    indices: torch.Tensor
    combine: torch.Tensor
    dispatched: torch.Tensor
    positions: torch.Tensor
    aux_loss: torch.Tensor | None


def _group_aux(gates: torch.Tensor, e1: torch.Tensor, size: int, num_groups: int
               ) -> torch.Tensor:
    """Line 13's ℓ_aux = (1/E) Σ_e (c_e / S) · m_e summed over consecutive groups of exactly
    S = ``size`` tokens, divided by ``num_groups`` (gates [n·S, E], e1 int64 [n·S]).

    c_e counts the group's first choices of expert e (line 11) and m_e is its mean gate
    (line 3), so Σ_e c_e · m_e = Σ_t m_{e1(t)}: a gather of the mean gates instead of counting
    the tokens per expert (the same value and gradient; c carries none)."""
    num_experts = gates.shape[1]
    mean_gates = gates.reshape(-1, size, num_experts).mean(1)                  # m, [n, E]
    picked = mean_gates.gather(1, e1.view(-1, size))                          # m_{e1(t)}
    return picked.sum() / (num_experts * size * num_groups)


def _mean_group_aux(gates: torch.Tensor, e1: torch.Tensor, group_size: int | None
                    ) -> torch.Tensor:
    """Line 13, averaged over the groups of ``group_size`` tokens (the last may be shorter;
    None: one group)."""
    tokens = gates.shape[0]
    size = group_size or max(tokens, 1)
    num_groups = (tokens + size - 1) // size
    whole = tokens // size * size
    terms = [_group_aux(gates[start:stop], e1[start:stop], group_tokens, num_groups)
             for start, stop, group_tokens in ((0, whole, size), (whole, tokens, tokens - whole))
             if stop > start]
    return terms[0] + terms[1] if len(terms) == 2 else terms[0] if terms else gates.new_zeros(())


def _top2(gates: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lines 5-6 and 15-16: each token's two experts (int64 [T, 2], by gate) and their gates
    normalised by g1 + g2 ([T, 2])."""
    top = torch.topk(gates.detach(), 2, dim=-1).indices
    chosen = selected_scores(gates, top)
    return top, chosen / chosen.sum(-1, keepdim=True)


def gshard_top2(gates: torch.Tensor, group_size: int | None, capacity: int | None,
                uniform: torch.Tensor | None, aux: bool = True) -> Top2Assignment:
    """Algorithm 1 of GShard, vectorised over tokens and groups.

    gates: [T, E] softmax gates (line 2); consecutive runs of ``group_size`` tokens form the
    groups (the last may be shorter; None: one group). capacity: C, the buffer size of each
    expert in each group (None: unlimited). uniform: [T] draws from U(0, 1) for line 17, or
    None to dispatch every second choice that fits. aux: whether to compute ℓ_aux.

    Line by line: the first choices take buffer positions in token order, and every first
    choice counts towards c_e, kept or not (lines 7-11); ℓ_aux = (1/E) Σ_e (c_e / S) · m_e
    (line 13); the second choices continue from c_e, in token order, each advancing its
    expert's counter whether or not it is dispatched (line 22), and are dispatched when the
    position fits and ``2 · g2 > rnd`` (line 19).
    """
    tokens, num_experts = gates.shape
    top, normalised = _top2(gates)                                            # lines 5-6, 15-16
    e1, e2 = top.unbind(1)
    # Lines 7 and 18 in one pass: the second choices take positions after every first choice
    # of their group (from c_e), in token order, as if queued behind all the first choices.
    groups = ((torch.arange(tokens, device=gates.device) // group_size).repeat(2),
              (tokens + group_size - 1) // group_size) if group_size else (None, None)
    pos1, pos2 = positions_in_expert(top.t().reshape(-1), num_experts,
                                     *groups).view(2, tokens).unbind(0)
    keep1 = torch.ones_like(e1, dtype=torch.bool) if capacity is None else pos1 < capacity
    keep2 = torch.ones_like(e2, dtype=torch.bool) if capacity is None else pos2 < capacity
    if uniform is not None:
        keep2 = keep2 & (2 * normalised[:, 1].detach() > uniform)            # line 19
    dispatched = torch.stack([keep1, keep2], 1)
    return Top2Assignment(indices=top, combine=normalised * dispatched,
                          dispatched=dispatched, positions=torch.stack([pos1, pos2], 1),
                          aux_loss=_mean_group_aux(gates, e1, group_size) if aux else None)



@implements(GShardRouterConfig)
class GShardRouter(LinearRouter):
    """Top-2 gating with per-group expert capacity (see :func:`gshard_top2`).

    ``capacity = ceil(capacity_factor · 2 · S / E)`` for groups of S tokens, with
    ``eval_capacity_factor`` in evaluation mode (default: dropless). During training
    with ``second_expert="random"`` the second expert is sampled with probability
    ``min(1, 2 · g2)``; at evaluation every second choice that fits is dispatched.

    Auxiliary loss ``gshard`` (line 13). Stats: ``dropped_fraction`` (tokens with no expert
    at all), ``first_dropped_fraction`` (first choices lost to capacity),
    ``second_dispatched_fraction``, ``capacity``.

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, 2], weights [tokens, 2],
    dispatched [tokens, 2])
    """

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.config
        gates = torch.softmax(self.logits(x), dim=-1)          # line 2
        tokens = x.shape[0]
        any_size = exported_for_any_size(tokens)
        if any_size:   # exported for every token count: no test of the count (a guard); a
            # batch within one group takes the grouped path with one group (the same result)
            group_size = count_min(cfg.group_size, tokens) if cfg.group_size else tokens
        else:
            group_size = min(cfg.group_size or tokens, tokens) if tokens else 1
        capacity = capacity_of(active_capacity_factor(cfg, self.training), group_size, 2,
                               self.num_experts)
        random_second = self.training and cfg.second_expert == "random"
        # one group: None, so the sort keys carry no group ids (their width would then follow
        # the token count, a graph per width under torch.compile(dynamic=True))
        groups = ((group_size if cfg.group_size else None) if any_size
                  else None if group_size >= tokens else group_size)
        aux = self.computes_aux_losses
        names = ("dropped_fraction", "first_dropped_fraction", "second_dispatched_fraction")
        if capacity is None and not random_second:
            # Nothing can drop a pair (dropless evaluation, the default): lines 5-6 and 15-16
            # alone. No buffer positions, and statistics known without computing them (made
            # on the input's device: a CPU tensor in a compiled graph stops CUDA graphs).
            top, combine = _top2(gates)
            # the third statistic: 1 with tokens, 0 without (no test of the count: a guard
            # when exported, where the count of real tokens may be data-dependent)
            present = torch.sym_float(count_min(tokens, 1))
            known = (*torch.zeros(2, device=x.device).unbind(),
                     torch.full((), present, device=x.device))
            return Routing(indices=top, weights=combine, stats=dict(zip(names, known)),
                           aux_losses={"gshard": _mean_group_aux(gates, top[:, 0], groups)}
                           if aux else {})
        uniform = torch.rand(tokens, device=x.device) if random_second else None
        result = gshard_top2(gates, groups, capacity, uniform, aux=aux)
        dispatched = result.dispatched
        flags = torch.stack([~dispatched.any(1), ~dispatched[:, 0], dispatched[:, 1]], 1)
        fractions = flags.float().sum(0) / count_max(tokens, 1)       # an empty batch: zeros
        stats = dict(zip(names, fractions.unbind()))
        if capacity is not None:
            stats["capacity"] = torch.full((), torch.sym_float(capacity), device=x.device)
        return Routing(indices=result.indices, weights=result.combine, dispatched=dispatched,
                       aux_losses={} if result.aux_loss is None else {"gshard": result.aux_loss},
                       stats=stats)
