"""σ-MoE (seed 001 §5): a sigmoid-gated top-k mixture of MLP experts computed with CVMM."""

from __future__ import annotations

from ..config import SigmaMoEConfig
from .moe import MoE


class SigmaMoE(MoE):
    """``y = Σ_{e∈E_x} s[e] · W2^e act(W1^e x)`` (seed 001 Eq. 25) with σ-MoE's selection:
    the :class:`MoE` layer with a :class:`~sparseffn.routers.SigmaRouter`, configured by one
    flat :class:`SigmaMoEConfig`.

    Parameters, in seed 001's key-value view (Eq. 20-24): ``router.weight`` [num_experts,
    d_model] (W_s); ``w1`` [num_experts, expert_size, d_model], whose rows are the keys k_i of
    each expert (W1^e); ``w2`` [num_experts, expert_size, d_model], whose rows are the values
    v_i (W2^e transposed). Expert e computes ``act(x @ w1[e].T) @ w2[e]``.

    Initialisation (``init="sigma_moe"``): experts like the dense MLP of width
    ``d_ff = num_experts · expert_size`` they replace, ``W1^e ~ N(0, sqrt(2/(d_model
    n_layers)))`` and ``W2^e ~ N(0, sqrt(2/(d_ff n_layers)))``; ``init="standard"`` uses the
    expert's own width ``expert_size`` for W2.

    After each forward: ``aux_losses["entropy"]`` (Eq. 35, weight ``entropy_weight``) and the
    per-expert usage in ``routing_stats``.

    forward(x: [..., d_model]) -> [..., d_model]
    """

    def __init__(self, config: SigmaMoEConfig | None = None, **kwargs) -> None:
        config = config if config is not None else SigmaMoEConfig(**kwargs)
        super().__init__(config.to_moe_config())
        self.config = config
