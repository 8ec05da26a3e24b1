"""The numbers behind the papers' analysis figures, from routing records (plain tensors).

Every function reads tensors and returns tensors or floats; nothing here knows a model.
:mod:`sparseffn.analysis.record` collects the inputs from a model's forward passes.

- :func:`usage_shares`, :func:`usage_entropy`, :func:`starved_fraction`: how evenly the
  selection weight spreads over the experts (Csordás et al. 2023, arXiv:2310.10837, Fig. 3
  and 7: the sorted usage curve that makes expert collapse visible).
- :func:`co_occurrence`: how often two experts are selected for the same token (their Fig. 6).
- :func:`active_channels`: how many hidden units of a dense MLP are non-zero per token (their
  Fig. 1, the observation that motivates sparse approximations).
- :func:`token_expert_counts`: which tokens each expert takes (Fedus et al. 2022, Switch
  Transformer, the table of token types per expert).
- :func:`tree_node_decisions`: per node of a fast feed-forward tree, how many tokens reach it
  in greedy descent, how evenly it splits them and how hard its decisions are (Belcak &
  Wattenhofer 2023, arXiv:2308.14711).
"""

from __future__ import annotations

import math

import torch


def _shares(mass: torch.Tensor) -> torch.Tensor:
    mass = mass.detach().double().clamp_min(0)
    total = mass.sum()
    if total <= 0:
        return torch.full_like(mass, 1.0 / max(1, mass.numel()))
    return mass / total


def usage_shares(mass: torch.Tensor) -> torch.Tensor:
    """Each expert's share of the total selection weight, sorted from the most used: float64
    [E], summing to one (uniform when nothing was selected). ``mass``: [E], e.g. a layer's
    ``usage_mass`` buffer."""
    return _shares(mass).sort(descending=True).values


def usage_entropy(mass: torch.Tensor) -> float:
    """The entropy of the usage shares over ``log E``: 1 when every expert gets the same
    weight, 0 when one expert gets all of it (collapse). One expert: 1."""
    p = _shares(mass)
    if p.numel() <= 1:
        return 1.0
    entropy = -(p * p.clamp_min(1e-300).log()).sum()
    return float(entropy / math.log(p.numel()))


def starved_fraction(mass: torch.Tensor, of_fair_share: float = 0.01) -> float:
    """The fraction of experts whose share is below ``of_fair_share`` of the fair share
    ``1 / E`` (default: below 1% of it): the experts that collapse has left unused."""
    p = _shares(mass)
    return float((p < of_fair_share / p.numel()).double().mean())


def _selected(indices: torch.Tensor, dispatched: torch.Tensor | None) -> torch.Tensor:
    """bool [T, k]: the slots that were computed (all when ``dispatched`` is None)."""
    if dispatched is None:
        return torch.ones(indices.shape, dtype=torch.bool, device=indices.device)
    return dispatched.to(torch.bool)


def co_occurrence(indices: torch.Tensor, num_experts: int,
                  dispatched: torch.Tensor | None = None) -> torch.Tensor:
    """``C[i, j]``: the number of tokens that selected both expert i and expert j (i ≠ j),
    ``C[i, i]``: the number of tokens that selected expert i. int64 [E, E], symmetric.

    indices: int64 [T, k] (a token selects an expert at most once); dispatched: bool [T, k] or
    None (slots dropped at capacity are not selections)."""
    one_hot = torch.zeros(indices.shape[0], num_experts, dtype=torch.int64, device=indices.device)
    one_hot.scatter_add_(1, indices.long(), _selected(indices, dispatched).long())
    one_hot.clamp_(max=1)
    return one_hot.T @ one_hot


def active_channels(hidden: torch.Tensor) -> torch.Tensor:
    """Of a dense MLP's hidden activations ``hidden`` [..., d_ff]: the number of units that
    are not zero for each token, int64 [...]."""
    return (hidden.detach() != 0).sum(-1)


def mean_and_std(values: torch.Tensor) -> tuple[float, float]:
    """The mean and the (population) standard deviation of ``values``; (nan, nan) when empty."""
    if values.numel() == 0:
        return math.nan, math.nan
    values = values.double()
    return float(values.mean()), float(values.std(unbiased=False))


def token_expert_counts(tokens: torch.Tensor, indices: torch.Tensor, vocab_size: int,
                        num_experts: int, dispatched: torch.Tensor | None = None) -> torch.Tensor:
    """``N[v, e]``: how many times token id ``v`` was sent to expert ``e`` by its first slot
    (the top-1 choice, the highest-weight one for the routers that sort their slots).
    int64 [vocab_size, E]. tokens: int64 [T]; indices: int64 [T, k]."""
    first = indices[:, 0].long()
    keep = _selected(indices, dispatched)[:, 0]
    flat = tokens.long()[keep] * num_experts + first[keep]
    counts = torch.bincount(flat, minlength=vocab_size * num_experts)
    return counts.view(vocab_size, num_experts)


def _binary_entropy_bits(p: torch.Tensor) -> torch.Tensor:
    p = p.double().clamp(1e-12, 1 - 1e-12)
    return -(p * p.log2() + (1 - p) * (1 - p).log2())


def tree_node_decisions(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per node of a complete binary tree (heap order: root 0, children 2n+1 left, 2n+2
    right), from its logits ``z`` [T, 2^d - 1], with greedy descent going left where z > 0:

    - ``reached`` int64 [N]: tokens whose descent passes through the node;
    - ``left`` float64 [N]: the fraction of those it sends left (NaN where none arrive);
    - ``split_entropy`` float64 [N]: the binary entropy (bits) of that split, 1 for an even
      split, 0 when the node sends every token the same way (NaN where none arrive);
    - ``decision_entropy`` float64 [N]: the mean over arriving tokens of the binary entropy
      (bits) of ``sigmoid(z)``: 0 for hard decisions, 1 for undecided ones;
    - ``leaves`` int64 [2^d]: tokens per leaf.
    """
    tokens, nodes = logits.shape
    depth = int(round(math.log2(nodes + 1)))
    if (1 << depth) - 1 != nodes:
        raise ValueError(f"tree_node_decisions: {nodes} node logits is no complete tree "
                         f"(2^depth - 1 nodes)")
    z = logits.detach().double()
    reached = torch.zeros(nodes, dtype=torch.int64)
    went_left = torch.zeros(nodes, dtype=torch.float64)
    softness = torch.zeros(nodes, dtype=torch.float64)
    node = torch.zeros(tokens, dtype=torch.int64, device=z.device)
    for _ in range(depth):
        zn = z.gather(1, node[:, None]).squeeze(1)
        left = zn > 0
        reached += torch.bincount(node, minlength=nodes).cpu()
        went_left += torch.bincount(node, weights=left.double(), minlength=nodes).cpu()
        softness += torch.bincount(node, weights=_binary_entropy_bits(torch.sigmoid(zn)),
                                   minlength=nodes).cpu()
        node = 2 * node + 2 - left.long()
    leaves = torch.bincount(node - nodes, minlength=nodes + 1).cpu()
    arrived = reached.double()
    fraction = torch.where(reached > 0, went_left / arrived.clamp_min(1), torch.nan)
    split = torch.where(reached > 0, _binary_entropy_bits(fraction.nan_to_num(0.5)), torch.nan)
    # an exact 0 or 1 split has zero entropy (not the clamp's 1e-10)
    split = torch.where((fraction == 0) | (fraction == 1), torch.zeros_like(split), split)
    decision = torch.where(reached > 0, softness / arrived.clamp_min(1), torch.nan)
    return {"reached": reached, "left": fraction, "split_entropy": split,
            "decision_entropy": decision, "leaves": leaves}
