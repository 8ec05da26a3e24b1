"""The router rows of ``sparseffn bench layers``: every top-k routing rule in the same MoE
(config a's experts: 16 × 128, d_model 512), forward+backward, against the parameter-equal
dense MLP and against σ-MoE at the same k (the routing overhead).

All contenders, σ-MoE at k = 1, 2, 4 and each dense baseline included, run in rotation in one
:func:`~.measure.interleaved_times` call, so every ratio compares runs adjacent in time.
"""

from __future__ import annotations

import statistics

import torch

from ..auxiliary import aux_loss
from ..config import MoEConfig
from ..layers import DenseMLP, MoE
from ..matching import param_equal_dense
from ..router_config import (ExpertChoiceRouterConfig, GShardRouterConfig,
                             NoisyTopKRouterConfig, SBaseRouterConfig, SigmaRouterConfig,
                             SoftmaxRouterConfig, SwitchRouterConfig)
from .measure import dtype_name, forward_backward_fn, interleaved_times, paired_ratio

# (row name, router config, k). The routing-overhead target compares each with σ-MoE at its k.
ROUTER_ROWS = [
    ("softmax", SoftmaxRouterConfig(), 4),
    ("softmax_renorm", SoftmaxRouterConfig(renormalize=True), 4),
    ("noisy_topk", NoisyTopKRouterConfig(), 4),
    ("sbase", SBaseRouterConfig(), 4),
    ("switch", SwitchRouterConfig(capacity_factor=1.25), 1),
    ("switch_dropless", SwitchRouterConfig(capacity_factor=None), 1),
    ("gshard", GShardRouterConfig(), 2),
    ("expert_choice", ExpertChoiceRouterConfig(), 2),     # 2 experts a token on average
]


def bench_routers(tokens: int, repeats: int, d_model: int = 512, num_experts: int = 16,
                  expert_size: int = 128, seed: int = 0, device: torch.device | str = "cpu",
                  autocast_dtype: torch.dtype | None = None) -> list[dict]:
    """One record per router row (see the module docstring), on ``device`` (CUDA events
    there), under autocast with ``autocast_dtype``."""
    device = torch.device(device)
    torch.manual_seed(seed)
    x = torch.randn(tokens, d_model).to(device)

    def config(router, k: int) -> MoEConfig:
        return MoEConfig(d_model=d_model, num_experts=num_experts, expert_size=expert_size,
                         k=k, router=router)

    sigma_ks = sorted({k for _, _, k in ROUTER_ROWS})
    layers = {f"sigma_k{k}": MoE(config(SigmaRouterConfig(), k)).to(device).train()
              for k in sigma_ks}
    dense_of: dict[str, str] = {}
    dense_layers: dict[str, DenseMLP] = {}
    for name, router, k in ROUTER_ROWS:
        layers[name] = MoE(config(router, k)).to(device).train()
    for name, layer in layers.items():
        dense = param_equal_dense(layer.config)
        key = f"dense_d_ff{dense.d_ff}"
        dense_of[name] = key
        if key not in dense_layers:
            dense_layers[key] = DenseMLP(dense).to(device).train()
    fns = {name: forward_backward_fn(layer, x, aux_loss, autocast_dtype)
           for name, layer in layers.items()}
    fns.update({name: forward_backward_fn(layer, x, autocast_dtype=autocast_dtype)
                for name, layer in dense_layers.items()})
    times = interleaved_times(fns, repeats, device=device)
    ms = {name: statistics.median(ts) for name, ts in times.items()}

    records = []
    for name, router, k in [("sigma", SigmaRouterConfig(), k) for k in sigma_ks] + ROUTER_ROWS:
        key = f"sigma_k{k}" if name == "sigma" else name
        with torch.no_grad():
            layers[key](x)   # one more forward, for the routing statistics
        stats = layers[key].routing_stats
        # the tokens that got no expert: dropped at capacity, or chosen by no expert
        dropped = stats.get("dropped_fraction", stats.get("unrouted_fraction"))
        records.append({
            "config": "a", "pass": "forward_backward", "router": name, "device": str(device),
            "dtype": dtype_name(autocast_dtype),
            "router_config": router.to_dict(), "tokens": tokens, "d_model": d_model,
            "num_experts": num_experts, "expert_size": expert_size, "k": k,
            "moe_ms": ms[key],
            "dense_param_d_ff": dense_layers[dense_of[key]].config.d_ff,
            "dense_param_ms": ms[dense_of[key]],
            "ratio_param": paired_ratio(times[key], times[dense_of[key]]),
            "sigma_same_k_ms": ms[f"sigma_k{k}"],
            "ratio_sigma_same_k": paired_ratio(times[key], times[f"sigma_k{k}"]),
            "dropped_fraction": None if dropped is None else float(dropped),
        })
    return records


def format_router_table(records: list[dict]) -> str:
    header = (f"{'router (config a)':<18}{'k':>3}{'ms':>9}{'/param dense':>14}"
              f"{'/σ-MoE same k':>15}{'dropped':>9}")
    lines = [header, "-" * len(header)]
    for r in records:
        dropped = "-" if r["dropped_fraction"] is None else f"{r['dropped_fraction']:.3f}"
        lines.append(f"{r['router']:<18}{r['k']:>3}{r['moe_ms']:>9.1f}{r['ratio_param']:>14.3f}"
                     f"{r['ratio_sigma_same_k']:>15.3f}{dropped:>9}")
    lines.append("forward+backward; /σ-MoE same k: the routing overhead over σ-MoE with the "
                 "same k and experts (target <= 1.15); dropped: the fraction of tokens that "
                 "got no expert (at capacity; in expert choice, chosen by none)")
    return "\n".join(lines)
