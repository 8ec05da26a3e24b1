"""Layers over product-key retrieval: the product-key memory (PKM; Lample et al. 2019, seed 001
§3.2) and PEER (seed 002 §3). Both are a :class:`ProductKeyRouter` in front of a table of
single rows, read with gathered-row kernels (``ops/rows.py``) that never copy the retrieved
rows out per token."""

from __future__ import annotations

import math

from ..config import PEERConfig, PKMConfig
from ..init import dense_init_std
from ..routers.product_keys import ProductKeyRouter
from ..routing import RoutedFFN
from ..stores import NeuronExperts, ValueRows


class ProductKeyMemory(RoutedFFN):
    """``y = Σ_heads Σ_{i ∈ top-k} act(s_i) v_i`` (Lample et al. 2019; Csordás et al. 2023,
    arXiv:2310.10837, Eq. 14-15): each head retrieves the top k of ``num_subkeys²`` product
    keys and adds the matching value rows, weighted by the softmax (or ReLU) of their scores.
    A :class:`ProductKeyRouter` plus a :class:`~sparseffn.stores.ValueRows` store.

    Parameters: ``router.*`` (sub-keys, optional query network and norm) and ``store.values``
    [num_subkeys², d_model], shared by the heads.

    After each forward, ``routing_stats``: ``counts`` (per value row, how many (token, head)
    retrievals read it) and ``mass`` (their summed weights), over ``num_values`` rows.

    Initialisation (``init``): ``"lample"``: sub-keys N(0, 1/sqrt(key_dim/2)), values
    N(0, 1/sqrt(d_model)); ``"dense"``: each full key N(0, sqrt(2/(d_model n_layers))) per
    entry like the dense W1 rows, values like W2 of an MLP of width num_values (Csordás et al.
    2023, §5).

    forward(x: [..., d_model]) -> [..., d_model]
    """

    _renamed_parameters = {"values": "store.values"}

    def __init__(self, config: PKMConfig | None = None, **kwargs) -> None:
        config = config if config is not None else PKMConfig(**kwargs)
        if config.init == "lample":
            key_std, value_std = None, 1 / math.sqrt(config.d_model)
        else:
            key_std = dense_init_std(config.d_model, config.n_layers)
            value_std = dense_init_std(config.num_values, config.n_layers)
        super().__init__(ProductKeyRouter(config.retrieval(), key_std=key_std),
                         ValueRows(config.num_values, config.d_model, std=value_std,
                                   sparse_grad=config.sparse_grad))
        self.config = config

    def extra_repr(self) -> str:
        cfg = self.config
        return f"d_model={cfg.d_model}, num_values={cfg.num_values}, activation={cfg.activation}"


class PEER(RoutedFFN):
    """``f(x) = Σ_heads Σ_{i ∈ I_h} g_i(x) σ(u_iᵀ x) v_i`` (He 2024, "Mixture of A Million
    Experts", arXiv:2407.04153, §3.2): ``num_experts`` single-neuron experts, the top k per
    head retrieved by product keys, router scores ``g = softmax`` (or sigmoid) of the retrieved
    keys' scores. A :class:`ProductKeyRouter` plus a :class:`~sparseffn.stores.NeuronExperts`
    store.

    Parameters: ``router.*`` (query networks, optional query norm, sub-keys) and the experts as
    two embedding tables ``store.w_in`` [N, d_model] (rows u_i) and ``store.w_out``
    [N, d_model] (rows v_i), shared by the heads, initialised ``N(0, sqrt(2/(d_model
    n_layers)))`` and ``N(0, sqrt(2/(heads·k n_layers)))``: Csordás et al.'s dense init for an
    MLP whose hidden layer is the heads·k retrieved neurons.

    After each forward, ``routing_stats``: ``counts`` (per expert, how many (token, head)
    retrievals chose it) and ``mass`` (their summed router scores).

    forward(x: [..., d_model]) -> [..., d_model]
    """

    _renamed_parameters = {"w_in": "store.w_in", "w_out": "store.w_out"}

    def __init__(self, config: PEERConfig | None = None, **kwargs) -> None:
        config = config if config is not None else PEERConfig(**kwargs)
        store = NeuronExperts(config.num_experts, config.d_model, activation=config.activation,
                              dropout=config.dropout,
                              in_std=dense_init_std(config.d_model, config.n_layers),
                              out_std=dense_init_std(config.heads * config.k, config.n_layers),
                              sparse_grad=config.sparse_grad)
        super().__init__(ProductKeyRouter(config.retrieval()), store)
        self.config = config

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"d_model={cfg.d_model}, num_experts={cfg.num_experts}, heads={cfg.heads}, "
                f"k={cfg.k}, activation={cfg.activation}, score={cfg.score}")
