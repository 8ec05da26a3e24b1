"""Shazeer et al. (2017) noisily gated top-k (Csordás et al. 2023 Eq. 27-28)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from ..losses import cv_squared
from ..registry import RouterConfig, implements
from ..routing import Routing
from ..validation import require_bool, require_non_negative
from .base import Router, full_precision_linear, init_selection_


@dataclass(frozen=True)


class NoisyTopKRouterConfig(RouterConfig):
    """Shazeer et al. (2017) noisy top-k gating (Csordás et al. 2023 Eq. 27-28).

    ``H(x) = W_g x + N(0,1) · softplus(W_noise x)`` during training,
    ``G(x) = softmax(KeepTopK(H(x), k))``.

    importance_weight: weight of ``CV(importance)²``, importance = Σ_x G(x) (Eq. 28).
    load_weight: weight of ``CV(load)²``, Shazeer's smooth estimate of the number of tokens
      per expert (the probability that each expert stays in the top k under new noise).
    noise_epsilon: added to the noise standard deviation (keeps it positive).
    train_noise: add the noise during training (never at evaluation).
    """

    type_name: ClassVar[str] = "noisy_topk"

    importance_weight: float = 0.01
    load_weight: float = 0.01
    noise_epsilon: float = 0.01
    train_noise: bool = True

    def __post_init__(self) -> None:
        require_non_negative(self, "importance_weight")
        require_non_negative(self, "load_weight")
        require_non_negative(self, "noise_epsilon")
        require_bool(self, "train_noise")

    def num_params(self, d_model: int, num_experts: int) -> int:
        return 2 * num_experts * d_model      # W_g and W_noise

    def aux_loss_weights(self) -> dict[str, float]:
        return {"importance": self.importance_weight, "load": self.load_weight}


def noisy_topk_load(clean: torch.Tensor, noisy: torch.Tensor, noise_std: torch.Tensor,
                    k: int, top: torch.Tensor | None = None) -> torch.Tensor:
    """Shazeer et al.'s smooth load estimate (their App. A, Eq. 8-10): for each token and
    expert the probability, over a fresh draw of that expert's noise, that it stays in the top
    k, ``Φ((clean_i - threshold_i) / std_i)``, where the threshold is the k-th largest noisy
    logit among the *other* experts. Summed over tokens: float32 [E].

    clean, noisy, noise_std: [T, E]; top: the k + 1 largest noisy logits of each token in
    descending order, [T, k+1], when already known (else found here). Needs k < E (with
    k = E every expert is always kept)."""
    if top is None:
        top = torch.topk(noisy, k + 1, dim=-1).values                 # [T, k+1]
    kth, next_one = top[:, k - 1:k], top[:, k:k + 1]
    in_top = noisy >= kth                                            # then the threshold is the (k+1)-th
    threshold = torch.where(in_top, next_one, kth)
    # Φ, the standard normal CDF (NaN in, NaN out: no argument validation to trip over)
    return torch.special.ndtr((clean - threshold) / noise_std).sum(0)


@implements(NoisyTopKRouterConfig)
class NoisyTopKRouter(Router):
    """``H(x) = W_g x + N(0,1)·softplus(W_noise x)`` (noise only in training),
    ``G(x) = softmax(KeepTopK(H(x), k))``: the k weights sum to one.

    Auxiliary losses: ``importance`` = CV(Σ_x G(x))² (Csordás et al. 2023 Eq. 28) and ``load`` =
    CV of the smooth load estimate squared (:func:`noisy_topk_load`; without noise, the plain
    counts, which carry no gradient). ``W_noise`` starts at zero, as in Shazeer et al.

    forward(x: [tokens, d_model]) -> Routing(indices [tokens, k], weights [tokens, k])
    """

    def __init__(self, config: NoisyTopKRouterConfig, d_model: int, num_experts: int, k: int,
                 init: str = "sigma_moe", init_depth: int = 1) -> None:
        super().__init__(config, d_model, num_experts, k, init, init_depth)
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))         # W_g
        self.noise_weight = nn.Parameter(torch.empty(num_experts, d_model))   # W_noise
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_selection_(self.weight, self.init, self.init_depth)
        with torch.no_grad():
            self.noise_weight.zero_()

    def forward(self, x: torch.Tensor) -> Routing:
        cfg = self.config
        clean = full_precision_linear(x, self.weight)                              # [T, E]
        noisy_run = self.training and cfg.train_noise
        if noisy_run:
            noise_std = (nn.functional.softplus(full_precision_linear(x, self.noise_weight))
                         + cfg.noise_epsilon)
            logits = clean + torch.randn_like(clean) * noise_std                  # Eq. 27
        else:
            logits = clean
        estimate_load = noisy_run and self.k < self.num_experts
        # One top-k serves both the gating and the load estimate's threshold (the (k+1)-th).
        top = torch.topk(logits, self.k + 1 if estimate_load else self.k, dim=-1)
        values, indices = top.values[:, :self.k], top.indices[:, :self.k].contiguous()
        weights = torch.softmax(values, dim=-1)                    # softmax(KeepTopK(H, k))
        routing = Routing(indices=indices, weights=weights)
        importance = logits.new_zeros(self.num_experts).index_add(
            0, indices.reshape(-1), weights.reshape(-1))
        # Σ_x G(x) is also the usage statistics' selection mass (every pair is dispatched;
        # expert_usage detaches it).
        routing.mass = importance
        if not self.computes_aux_losses:
            return routing
        if estimate_load:
            load = noisy_topk_load(clean, logits, noise_std, self.k, top.values)
        else:
            load = routing.plan(self.num_experts).counts.float()
        balance = torch.stack([importance, load])                                 # [2, E]
        if self.global_batch is not None:     # Σ over the global batch
            balance = self.global_batch.sum(balance)
        routing.aux_losses = dict(zip(("importance", "load"), cv_squared(balance).unbind()))
        return routing
