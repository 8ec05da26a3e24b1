"""Randomly drawn layers at odd sizes against the loop references.

The conformance suite checks one example per registration at ``d_model`` 12 and 7 tokens. Here
each seed draws a routed layer of one kind in turn (σ-MoE, MoE with each registered router,
FFF, PKM, PEER), its sizes and options (gated and biased experts, the activation, capacity
factors, sparse FFF training, FFF's evaluation modes, tree nodes of several neurons, odd table
and key sizes), a ``d_model`` from 1 to 130, a token count up to 600, an input laid out as a
user's slice may be (a transpose, every other column, or an offset into a larger buffer), and
training or evaluation mode. The output and every gradient must equal those of the store's loop
reference fed the layer's own routing. The draws are seeded, so a failure names a seed that
reproduces it."""

from __future__ import annotations

import random

import pytest
import torch

from sparseffn import FFFConfig, MoEConfig, PEERConfig, PKMConfig, SigmaMoEConfig, build_layer
from sparseffn.config import LayerConfig
from sparseffn.router_config import (DenseGateRouterConfig, ExpertChoiceRouterConfig,
                                     GShardRouterConfig,
                                     HierarchicalRouterConfig, NoisyTopKRouterConfig,
                                     SBaseRouterConfig, SigmaRouterConfig, SoftmaxRouterConfig,
                                     SwitchRouterConfig, TreeRouterConfig)
from sparseffn.routers import ProductKeyRouterConfig
from tests.layers.test_conformance import (check_against_the_reference, output_and_reference,
                                          with_nonzero_biases)

D_MODELS = (1, 3, 7, 17, 33, 64, 65, 130)
TOKENS = (1, 2, 5, 31, 64, 257, 600)


ROUTERS = ("sigma", "softmax", "noisy_topk", "switch", "gshard", "sbase", "dense_softmax",
           "hierarchical", "tree", "product_keys", "expert_choice")
# each seed's kind of layer in turn, so that every router and layer type is drawn 3 times
KINDS = ("sigma_moe", *(f"moe:{router}" for router in ROUTERS), "fff", "pkm", "peer")


def _routed_moe(rng: random.Random, d_model: int, router: str) -> MoEConfig:
    """An MoE layer with ``router`` and the experts' options drawn."""
    num_experts = rng.randint(2, 16)
    k = rng.randint(1, num_experts)
    if router == "switch":
        config, k = SwitchRouterConfig(capacity_factor=rng.choice([0.5, 1.0, 2.0])), 1
    elif router == "gshard":
        config, k = GShardRouterConfig(capacity_factor=rng.choice([0.5, 1.0, 2.0])), 2
    elif router in ("dense_softmax", "hierarchical"):   # every expert, a tree of 2^depth
        num_experts = 2 ** rng.randint(1, 3)
        config = DenseGateRouterConfig() if router == "dense_softmax" else \
            HierarchicalRouterConfig()
        k = num_experts
    elif router == "tree":
        num_experts = 2 ** rng.randint(1, 4)
        k = rng.randint(1, num_experts)
        config = TreeRouterConfig(node_width=rng.choice([1, 3]))
    elif router == "product_keys":
        heads = rng.randint(1, 3)
        num_experts = rng.randint(2, 6) ** 2
        config = ProductKeyRouterConfig(heads=heads, key_dim=rng.choice([2, 4, 6]))
        k = heads * rng.randint(1, min(4, num_experts // heads))
    elif router == "expert_choice":
        config = ExpertChoiceRouterConfig(eval_routing=rng.choice(["expert_choice", "top_k"]))
    else:
        config = {"sigma": SigmaRouterConfig(), "softmax": SoftmaxRouterConfig(
            renormalize=rng.random() < 0.5), "noisy_topk": NoisyTopKRouterConfig(),
            "sbase": SBaseRouterConfig()}[router]
    return MoEConfig(d_model=d_model, num_experts=num_experts,
                     expert_size=rng.choice([1, 5, 16, 33]), k=k, router=config,
                     activation=rng.choice(["relu", "gelu", "silu"]),
                     gated=rng.random() < 0.3, bias=rng.random() < 0.3)


def random_config(rng: random.Random, kind: str) -> LayerConfig:
    """A layer of ``kind`` (one of ``KINDS``) with its sizes and options drawn."""
    d_model = rng.choice(D_MODELS)
    if kind == "sigma_moe":
        num_experts = rng.randint(1, 20)
        return SigmaMoEConfig(d_model=d_model, num_experts=num_experts,
                              expert_size=rng.choice([1, 3, 8, 17, 64]),
                              k=rng.randint(1, num_experts))
    if kind.startswith("moe:"):
        return _routed_moe(rng, d_model, kind[len("moe:"):])
    if kind == "fff":
        depth = rng.randint(1, 5)
        sparse = {"train_mode": "sparse", "k": rng.randint(1, 2 ** depth)}
        leaf_width = rng.choice([1, 4, 9])
        options = sparse if rng.random() < 0.5 else {}
        # nodes of several neurons and each evaluation mode, drawn last: a seed keeps its sizes
        return FFFConfig(d_model=d_model, depth=depth, leaf_width=leaf_width,
                         eval_mode=rng.choice([None, "soft", "topk", "hard"]),
                         router=TreeRouterConfig(node_width=rng.choice([1, 1, 2, 5])),
                         **options)
    sub_keys = rng.randint(2, 12)
    fields = {"heads": rng.randint(1, 3), "k": rng.randint(1, min(8, sub_keys ** 2)),
              "key_dim": rng.choice([2, 4, 6, 16])}
    if kind == "pkm":
        return PKMConfig(d_model=d_model, num_subkeys=sub_keys, query="linear", **fields)
    return PEERConfig(d_model=d_model, num_experts=sub_keys ** 2, **fields)


def strided_input(rng: random.Random, tokens: int, d_model: int) -> torch.Tensor:
    """[tokens, d_model] that requires grad and is laid out as a user's slice may be."""
    layout = rng.choice(["transposed", "every_other_column", "offset"])
    if layout == "transposed":
        x = torch.randn(d_model, tokens).t()
    elif layout == "every_other_column":
        x = torch.randn(tokens, 2 * d_model)[:, ::2]
    else:
        x = torch.randn(tokens + 1, d_model)[1:]
    return x.requires_grad_(True)


@pytest.mark.parametrize("seed", range(3 * len(KINDS)))
def test_a_random_layer_matches_its_reference(seed):
    rng = random.Random(seed)
    config = random_config(rng, KINDS[seed % len(KINDS)])
    torch.manual_seed(seed)
    layer = with_nonzero_biases(build_layer(config)).train(rng.random() < 0.6)
    if getattr(layer.store, "hidden_dropout", None) is not None:
        layer.store.hidden_dropout.p = 0.0      # the reference has no dropout mask to share
    x = strided_input(rng, rng.choice(TOKENS), config.d_model)
    atol = 1e-5 * max(1.0, config.d_model ** 0.5)
    check_against_the_reference(layer, x, atol=atol)
    with torch.no_grad():   # inference: the paths without a backward (few tokens' experts)
        y, ref = output_and_reference(layer.eval(), x)
    torch.testing.assert_close(y, ref, atol=atol, rtol=1e-4)
