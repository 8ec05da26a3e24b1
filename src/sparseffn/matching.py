"""Equal-parameter and equal-compute dense baselines for any sparse layer (Csordás et al. 2023 §6).

Csordás et al. 2023 compare every sparse layer with the dense MLP that has the *same number of
parameters* (the fair baseline), compensating for the selection network by widening the dense
layer. The *active-equal* dense MLP (``d_ff = k · expert_size``) is what a perfect dispatch
would cost: the speed a sparse layer could reach at best.
"""

from __future__ import annotations

import dataclasses

from dataclasses import dataclass

from .config import ACTIVATIONS, DenseMLPConfig, LayerConfig, LayerCost, SigmaMoEConfig


def param_equal_dense(config: LayerConfig, **dense_kwargs) -> DenseMLPConfig:
    """The dense MLP whose parameter count is closest to ``config``'s (exactly equal whenever
    the sparse count is a multiple of ``2 · d_model``, the dense layer's unit of growth; off
    by at most ``d_model`` parameters otherwise, ties going to the wider dense layer)."""
    total = config.cost().total_params
    d_model = config.d_model  # type: ignore[attr-defined]
    d_ff = max(1, (total + d_model) // (2 * d_model))   # nearest, half up
    fields = {f.name for f in dataclasses.fields(config)}  # type: ignore[arg-type]
    activation = config.activation if "activation" in fields else "relu"  # type: ignore[attr-defined]
    return DenseMLPConfig(d_model=d_model, d_ff=d_ff,
                          activation=activation if activation in ACTIVATIONS else "relu",
                          init_depth=getattr(config, "init_depth", 1), **dense_kwargs)


def compute_equal_dense(config: LayerConfig, **dense_kwargs) -> DenseMLPConfig:
    """The dense MLP whose parameters equal ``config``'s *active* parameters per token (to
    within ``d_model``): what the same per-token compute buys without experts, the baseline of
    Fedus et al. 2022 (Switch Transformer, "FLOP-matched") and of the MoE papers before
    Csordás et al. 2023. For a MoE that is ``d_ff ≈ k · expert_size`` plus the selection
    network's share; a layer that reads all its parameters (a soft FFF) gets its
    parameter-equal dense MLP."""
    active = config.cost().active_params
    d_model = config.d_model  # type: ignore[attr-defined]
    d_ff = max(1, (active + d_model) // (2 * d_model))
    return dataclasses.replace(param_equal_dense(config, **dense_kwargs), d_ff=d_ff)


def active_equal_dense(config: SigmaMoEConfig, **dense_kwargs) -> DenseMLPConfig:
    """The dense MLP of width ``k · expert_size``: the same expert FLOPs per token."""
    return DenseMLPConfig(d_model=config.d_model, d_ff=config.k * config.expert_size,
                          activation=config.activation, init_depth=config.init_depth, **dense_kwargs)


@dataclass(frozen=True)
class CostReport:
    """A sparse layer's cost next to its parameter-equal dense MLP.

    relative_flops: forward FLOPs per token over the dense MLP's, selection included.
    relative_expert_flops: Csordás et al. 2023 Table 7's "% FLOPs": expert FLOPs only, over the MLP
      being approximated (for a MoE, the MLP of width ``num_experts · expert_size`` that its
      experts partition; so exactly ``k / num_experts``).
    """

    sparse: LayerCost
    dense: LayerCost
    dense_config: DenseMLPConfig
    relative_expert_flops: float

    @property
    def param_difference(self) -> int:
        """dense − sparse total parameters (0 when matched exactly)."""
        return self.dense.total_params - self.sparse.total_params

    @property
    def relative_flops(self) -> float:
        return self.sparse.flops / self.dense.flops

    @property
    def relative_active_params(self) -> float:
        return self.sparse.active_params / self.dense.active_params

    def as_dict(self) -> dict:
        return {
            "total_params": self.sparse.total_params,
            "dense_params": self.dense.total_params,
            "dense_d_ff": self.dense_config.d_ff,
            "active_params_per_token": self.sparse.active_params,
            "flops_per_token": self.sparse.flops,
            "relative_flops": self.relative_flops,
            "relative_expert_flops": self.relative_expert_flops,
        }


def compare_with_dense(config: LayerConfig) -> CostReport:
    """Total parameters, active parameters and FLOPs per token against the parameter-equal
    dense MLP."""
    sparse = config.cost()
    dense_config = param_equal_dense(config)
    approximated = dense_config
    if isinstance(config, SigmaMoEConfig):
        approximated = DenseMLPConfig(d_model=config.d_model, d_ff=config.d_ff)
    return CostReport(sparse=sparse, dense=dense_config.cost(), dense_config=dense_config,
                      relative_expert_flops=sparse.expert_flops / approximated.cost().flops)
