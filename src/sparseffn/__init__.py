"""sparseffn: sparse feed-forward layers for PyTorch.

Every layer is a drop-in replacement for a Transformer MLP block,
``forward(x: [..., d_model]) -> [..., d_model]``; auxiliary losses are collected with
:func:`aux_loss`.
"""

import torch as _torch

from .requirements import check_torch as _check_torch

_check_torch(_torch.__version__)   # before the operators register: a clear error on old torch

from .auxiliary import (all_reduce_usage, aux_loss, aux_loss_terms, computing_aux_losses,
                        dense_grad_parameters, no_usage_statistics, reset_usage, routing_stats,
                        skipping_padding, sparse_grad_parameters, summing_aux_losses)
from .config import (DenseMLPConfig, FFFConfig, LayerConfig, LayerCost, MoEConfig, PEERConfig,
                     PKMConfig, ProductKeySpec, SigmaMoEConfig, TopKMLPConfig, config_from_dict)
from .layers import (DeepMixtureOfExperts, DenseMLP, FastFeedForward, HierarchicalMixtureOfExperts,
                     MixtureOfExperts, MoE, PEER, ProductKeyMemory, SigmaMoE, TopKMLP)
from .router_config import (DenseGateRouterConfig, ExpertChoiceRouterConfig, GShardRouterConfig,
                            HierarchicalRouterConfig,
                            NoisyTopKRouterConfig, RouterConfig, SBaseRouterConfig,
                            SigmaRouterConfig, SoftmaxRouterConfig, SwitchRouterConfig, TreeRouterConfig)
from .matching import active_equal_dense, compare_with_dense, param_equal_dense
from .onnx_decoding import OnnxDecoder, decoder_to_onnx
from .onnx_export import portable_forms, to_onnx
from .ops import DispatchPlan, cvmm
from .optim import (adam_optimizers, clip_grad_norm_, clip_grad_value_, no_weight_decay_parameters,
                    param_groups)
from .routing import Routing, SparseFFN
from .registry import build_layer, build_router
from .runtime import tune_cpu_allocator

__version__ = "0.1.0"

__all__ = [
    "DeepMixtureOfExperts", "DenseGateRouterConfig", "DenseMLP", "DenseMLPConfig",
    "DispatchPlan", "ExpertChoiceRouterConfig", "FFFConfig", "FastFeedForward",
    "GShardRouterConfig",
    "HierarchicalMixtureOfExperts", "HierarchicalRouterConfig", "LayerConfig", "LayerCost",
    "MixtureOfExperts", "MoE", "MoEConfig", "NoisyTopKRouterConfig", "OnnxDecoder", "PEER",
    "PEERConfig",
    "PKMConfig", "ProductKeyMemory", "ProductKeySpec", "RouterConfig", "Routing",
    "SBaseRouterConfig", "SigmaMoE", "SigmaMoEConfig", "SigmaRouterConfig",
    "SoftmaxRouterConfig", "SparseFFN", "SwitchRouterConfig", "TopKMLP", "TopKMLPConfig",
    "TreeRouterConfig", "active_equal_dense", "adam_optimizers", "all_reduce_usage", "aux_loss",
    "aux_loss_terms",
    "build_layer", "build_router", "clip_grad_norm_", "clip_grad_value_", "compare_with_dense",
    "computing_aux_losses",
    "config_from_dict", "cvmm", "decoder_to_onnx",
    "dense_grad_parameters", "no_usage_statistics", "no_weight_decay_parameters",
    "param_equal_dense", "param_groups", "portable_forms",
    "reset_usage", "routing_stats", "skipping_padding",
    "sparse_grad_parameters", "summing_aux_losses", "to_onnx", "tune_cpu_allocator",
]
