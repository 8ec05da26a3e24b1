"""From layer records to the numbers a report shows (JSON-serialisable dicts).

``summarize(records, tokens, vocab_size, token_label)`` gives, per layer:

routed layers
  ``usage_entropy`` (1: even, 0: collapsed), ``starved_fraction`` (experts below 1% of the fair
  share), ``usage_curve`` (the sorted usage as ``[rank / E, share · E]`` points, at most
  ``CURVE_POINTS``: 1 is the fair share), and for at most ``MAX_MATRIX_EXPERTS`` experts the
  ``co_occurrence`` counts and the ``top_tokens`` of each expert; a tree-routed layer adds
  ``tree`` (per node: tokens reached, share sent left, split and decision entropies; tokens
  per leaf);
dense MLPs
  ``active_mean`` / ``active_std``: non-zero hidden units per token, and their fraction of d_ff.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from ..auxiliary import routing_stats
from .record import LayerRecord
from .stats import (co_occurrence, mean_and_std, starved_fraction, token_expert_counts,
                    tree_node_decisions, usage_entropy, usage_shares)

CURVE_POINTS = 200          # points kept of a sorted usage curve
MAX_MATRIX_EXPERTS = 64     # co-occurrence matrices and token tables up to this many experts
TOP_TOKENS = 8              # tokens listed per expert

# the collapse monitor's thresholds (also used by the trainer's warning)
LOW_ENTROPY = 0.5           # normalised usage entropy below this: the usage is collapsing
STARVED = 0.25              # more than this fraction of experts starved: collapse


def usage_curve(mass: torch.Tensor, points: int = CURVE_POINTS) -> list[list[float]]:
    """The sorted usage as ``[rank / E, share · E]`` pairs (at most ``points``, evenly spaced
    in rank, the first and last expert always included)."""
    shares = usage_shares(mass)
    experts = shares.numel()
    if experts == 0:
        return []
    ranks = torch.linspace(0, experts - 1, min(points, experts)).round().long().unique()
    return [[float(r) / experts, float(shares[r]) * experts] for r in ranks.tolist()]


def collapse_warning(entropy: float, starved: float) -> str | None:
    """A short warning when usage looks collapsed by the thresholds above, else None."""
    if entropy < LOW_ENTROPY or starved > STARVED:
        return f"usage entropy {entropy:.2f}, {starved:.0%} of experts starved"
    return None


def usage_health(model) -> dict[str, tuple[float, float]]:
    """Per sparse layer of ``model`` with usage buffers: the normalised usage entropy and the
    starved fraction of its accumulated ``usage_mass`` (the collapse monitor's numbers; reset
    the usage to start a new window). Layers that have not routed anything yet are left out."""
    out = {}
    for name, stats in routing_stats(model).items():
        mass = stats.get("usage_mass")
        if mass is not None and mass.numel() > 1 and bool(mass.sum() > 0):
            out[name] = (usage_entropy(mass), starved_fraction(mass))
    return out


def _routed(record: LayerRecord, tokens: torch.Tensor | None, vocab_size: int | None,
            token_label: Callable[[int], str]) -> dict:
    mass = record.mass
    indices, dispatched = record.indices, record.dispatched
    entropy, starved = usage_entropy(mass), starved_fraction(mass)
    out = {"kind": "routed", "num_experts": record.num_experts, "tokens": record.tokens,
           "k": indices.shape[1], "usage_entropy": entropy, "starved_fraction": starved,
           "warning": collapse_warning(entropy, starved), "usage_curve": usage_curve(mass)}
    small = record.num_experts <= MAX_MATRIX_EXPERTS
    # a slot per expert: every expert for every token (a soft tree, a dense gate), or, with a
    # dispatched mask, the experts' own choices (expert choice)
    slot_per_expert = indices.shape[1] == record.num_experts
    every_expert = slot_per_expert and dispatched is None
    if small and not every_expert and indices.shape[1] > 1:
        out["co_occurrence"] = co_occurrence(indices, record.num_experts, dispatched).tolist()
    if small and tokens is not None and vocab_size and tokens.numel() == record.tokens:
        if slot_per_expert:   # the top-weight expert is each token's choice (a token no
            # expert chose has none)
            indices = record.weights.argmax(-1, keepdim=True)
            dispatched = None if dispatched is None else dispatched.any(-1, keepdim=True)
        counts = token_expert_counts(tokens, indices, vocab_size, record.num_experts, dispatched)
        out["token_experts"] = counts.tolist()
        out["top_tokens"] = _top_tokens(counts, token_label)
    logits = record.node_logits
    if logits is not None:
        tree = tree_node_decisions(logits)
        out["tree"] = {key: [None if isinstance(v, float) and math.isnan(v) else v
                             for v in value.tolist()] for key, value in tree.items()}
    return out


def _top_tokens(counts: torch.Tensor, token_label: Callable[[int], str]) -> list[list]:
    """Per expert, its most frequent tokens as ``[label, count, share of the expert's
    tokens]``."""
    out = []
    for column in counts.T:
        total = int(column.sum())
        top = column.topk(min(TOP_TOKENS, column.numel()))
        out.append([[token_label(int(t)), int(c), int(c) / total]
                    for c, t in zip(top.values.tolist(), top.indices.tolist()) if c > 0])
    return out


def _dense(record: LayerRecord) -> dict:
    mean, std = mean_and_std(record.active)
    return {"kind": "dense", "d_ff": record.d_ff, "tokens": record.tokens, "active_mean": mean,
            "active_std": std, "active_fraction": mean / record.d_ff if record.d_ff else math.nan}


def summarize(records: dict[str, LayerRecord], tokens: torch.Tensor | None = None,
              vocab_size: int | None = None,
              token_label: Callable[[int], str] = str) -> dict[str, dict]:
    """Per layer, the numbers of the module doc. ``tokens`` (int64 [T], the input token of
    every recorded position, in forward order) enables the token tables."""
    flat = None if tokens is None else tokens.reshape(-1).cpu()
    return {name: _routed(r, flat, vocab_size, token_label) if r.kind == "routed" else _dense(r)
            for name, r in records.items() if r.tokens}


def byte_label(token: int) -> str:
    """A readable label for a byte: the character, or an escape for whitespace and control
    bytes."""
    names = {9: "\\t", 10: "\\n", 13: "\\r", 32: "␣"}
    if token in names:
        return names[token]
    return chr(token) if 33 <= token < 127 else f"0x{token:02x}"
