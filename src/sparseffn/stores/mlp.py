"""Two-layer MLP experts, computed with CVMM (Csordás, Irie & Schmidhuber 2023,
arXiv:2310.10837, App. B.1) or, for a dense routing, as one pair of dense products."""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from ..activations import activation_fn
from ..init import dense_init_std
from ..ops.cvmm import DispatchPlan
from ..ops.expert_mlp import expert_mlp, expert_mlp_few, expert_mlp_few_ok, few_pairs_tokens
from ..ops.grad_mode import grad_wanted
from ..ops.sizes import cond_allowed, exported_for_any_size
from ..ops.precision import autocast_dtype
from ..routing import Routing
from .base import ExpertStore

#: Initialisation schemes of :class:`MLPExperts`.
MLP_EXPERT_INITS = ("sigma_moe", "standard", "switch", "fff")


class MLPExperts(ExpertStore):
    """``num_experts`` MLPs ``f_e(x) = act(x W1_eᵀ + b1_e) W2_e + b2_e``, combined as
    ``y_t = Σ_j w_tj f_{i_tj}(x_t)`` (Csordás et al. 2023, Eq. 25; Belcak & Wattenhofer 2023,
    arXiv:2308.14711, Eq. 5 for the leaves of a fast feed-forward tree).

    Parameters: ``w1`` [E, expert_size, d_model] (rows: the keys of each expert's hidden units),
    ``w2`` [E, expert_size, d_out] (rows: their values) and, with ``bias``, ``b1``
    [E, expert_size] and ``b2`` [E, d_out]. ``dense_bias`` instead gives the biases of the
    dense MLP whose hidden units the experts partition: ``b1`` [E, expert_size] (each hidden
    unit's own bias) and ``b_out`` [d_out], added once to every token's output whatever its
    weights, ``y_t = Σ_j w_tj f_{i_tj}(x_t) + b_out`` with ``f_e`` without ``b2``
    (MoEfication, Zhang et al. 2022, arXiv:2110.01786: a dense MLP split into experts keeps
    its output bias).

    ``gated`` makes each expert a gated linear unit, ``f_e(x) = (act(x Wg_eᵀ) ⊙ (x W1_eᵀ +
    b1_e)) W2_e + b2_e`` (Shazeer 2020, "GLU Variants Improve Transformer", arXiv:2002.05202;
    with ``activation="silu"`` the SwiGLU of Llama's MLPs and Mixtral's experts), with one more
    parameter ``w_gate`` [E, expert_size, d_model], initialised as ``w1``.

    Sparse routings run through :func:`~sparseffn.ops.expert_mlp` (pairs a router dropped at
    capacity are never computed: their output is zero), or, at inference on a few tokens (no
    gradient wanted, CPU float32, up to ``FEW_PAIRS_MACS`` multiply-adds: decoding), through
    :func:`~sparseffn.ops.expert_mlp.expert_mlp_few`, which computes the same without a
    dispatch plan. A ``dense`` routing (weights over every
    expert, the soft mode of a fast feed-forward tree) runs as one GEMM into all experts'
    hidden units, each expert's block scaled by its weight, and one GEMM back.

    init (with ``init_depth``, the number of blocks the init is scaled for):
      ``"sigma_moe"``: like the dense MLP of width ``E · expert_size`` it replaces,
        ``W1 ~ N(0, sqrt(2/(d_model L)))``, ``W2 ~ N(0, sqrt(2/(E·expert_size·L)))`` (Csordás
        et al. 2023, §5); zero biases;
      ``"standard"``: W2's fan-in is the expert's own width;
      ``"switch"``: truncated ``N(0, sqrt(0.1/fan_in))`` (Fedus, Zoph & Shazeer 2022,
        arXiv:2101.03961, §2.5); zero biases;
      ``"fff"``: uniform ``±1/sqrt(fan_in)`` for weights and biases (the ``fastfeedforward``
        package of Belcak & Wattenhofer).

    forward(x: [T, d_model], routing) -> [T, d_out]
    """

    def __init__(self, num_experts: int, d_model: int, expert_size: int, d_out: int | None = None,
                 *, activation: str = "relu", bias: bool = False, dense_bias: bool = False,
                 dropout: float = 0.0, init: str = "sigma_moe", init_depth: int = 1,
                 gated: bool = False) -> None:
        super().__init__()
        if init not in MLP_EXPERT_INITS:
            raise ValueError(f"MLPExperts init must be one of {MLP_EXPERT_INITS}, got {init!r}")
        if bias and dense_bias:
            raise ValueError("MLPExperts: bias (per-expert output biases) and dense_bias (one "
                             "shared output bias) exclude each other")
        self.num_experts, self.d_model, self.expert_size = num_experts, d_model, expert_size
        self.d_out = d_model if d_out is None else d_out
        self.activation, self.init, self.init_depth = activation, init, init_depth
        self.w1 = nn.Parameter(torch.empty(num_experts, expert_size, d_model))
        self.w2 = nn.Parameter(torch.empty(num_experts, expert_size, self.d_out))
        self.w_gate = nn.Parameter(torch.empty(num_experts, expert_size, d_model)) if gated else None
        self.b1 = nn.Parameter(torch.empty(num_experts, expert_size)) if bias or dense_bias else None
        self.b2 = nn.Parameter(torch.empty(num_experts, self.d_out)) if bias else None
        self.b_out = nn.Parameter(torch.empty(self.d_out)) if dense_bias else None
        self.hidden_dropout = nn.Dropout(dropout)
        self.reset_parameters()

    def no_weight_decay_parameters(self) -> list[nn.Parameter]:
        """The per-expert biases (two-dimensional, not weights: see
        :func:`sparseffn.param_groups`)."""
        return [b for b in (self.b1, self.b2) if b is not None]

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.init == "fff":
            for params, fan_in in (((self.w1, self.b1, self.w_gate), self.d_model),
                                   ((self.w2, self.b2), self.expert_size)):
                bound = 1 / math.sqrt(fan_in)
                for p in params:
                    if p is not None:
                        p.uniform_(-bound, bound)
            return
        if self.init == "switch":
            for weight, fan_in in ((self.w1, self.d_model), (self.w_gate, self.d_model),
                                   (self.w2, self.expert_size)):
                if weight is None:
                    continue
                std = math.sqrt(0.1 / fan_in)
                nn.init.trunc_normal_(weight, 0.0, std, -2 * std, 2 * std)
        else:
            w2_fan_in = (self.num_experts * self.expert_size if self.init == "sigma_moe"
                         else self.expert_size)
            self.w1.normal_(0.0, dense_init_std(self.d_model, self.init_depth))
            if self.w_gate is not None:
                self.w_gate.normal_(0.0, dense_init_std(self.d_model, self.init_depth))
            self.w2.normal_(0.0, dense_init_std(w2_fan_in, self.init_depth))
        for p in (self.b1, self.b2, self.b_out):
            if p is not None:
                p.zero_()

    def input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """Under autocast, the autocast dtype: ``expert_mlp`` runs both products in it."""
        return autocast_dtype(x)

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        y = self.expert_output(x, routing)
        return y if self.b_out is None else y + self.b_out.to(y.dtype)

    def expert_output(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``Σ_j w_tj f_{i_tj}(x_t)`` without the shared output bias: [T, d_out]."""
        if routing.dense:
            return self.dense_output(x, routing.weights)
        dropout = self.hidden_dropout if self.training and self.hidden_dropout.p > 0 else None
        few = (self.activation, self.b1, self.b2, self.w_gate)
        if dropout is None and expert_mlp_few_ok(x, routing.indices, routing.weights, self.w1,
                                                 self.w2, *few):
            return expert_mlp_few(x, routing.indices, routing.weights, self.w1, self.w2, *few,
                                  dispatched=routing.dispatched)
        if dropout is None and self._exported_inference(x, routing):
            return self._few_or_planned(x, routing)
        return self._planned(x, routing.plan(self.num_experts), routing.weights,
                             routing.indices, dropout)

    def _planned(self, x: torch.Tensor, plan: DispatchPlan, weights: torch.Tensor,
                 indices: torch.Tensor, dropout=None) -> torch.Tensor:
        """:func:`~sparseffn.ops.expert_mlp.expert_mlp` of these experts: [T, d_out]."""
        biased = self.b1 is not None or self.b2 is not None
        return expert_mlp(x, plan, self.w1, self.w2, weights, activation=self.activation,
                          hidden_dropout=dropout, b1=self.b1, b2=self.b2,
                          indices=indices if biased else None, w_gate=self.w_gate)

    def _exported_inference(self, x: torch.Tensor, routing: Routing) -> bool:
        """Whether torch.export traces an inference forward for any token count given as an
        input's size. Not for a count the program computes (the real tokens of a model that
        skips padding): inside ``torch.cond``'s branches each operand's data-dependent size
        is a new symbol, and the plan's shape checks could not relate them. Nor inside
        :func:`~sparseffn.ops.sizes.without_cond`, where the plan serves every count."""
        if not exported_for_any_size(x.shape[0]) or routing.indices.dim() != 2 \
                or not cond_allowed():
            return False
        # (Dynamo, tracing a strict export, cannot call free_unbacked_symbols; its sizes
        # come from the inputs there unless skip_padding counts them)
        if not torch.compiler.is_dynamo_compiling() and free_unbacked_symbols(x.shape[0]):
            return False
        return not grad_wanted(x, routing.weights, *self.parameters())

    def _few_or_planned(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """A program's choice (``torch.cond``, an ONNX ``If``) between the two paths eager
        inference chooses between by the batch's size: the pairs read straight from the
        weights up to :func:`~sparseffn.ops.expert_mlp.few_pairs_tokens` tokens (decoding),
        the dispatch plan above. With the plan alone, an exported σ-MoE decoded a token in ONNX
        Runtime through one block of small ops per expert. [T, d_out]."""
        few = (self.activation, self.b1, self.b2, self.w_gate)

        def pairs(x, indices, weights, *dispatched):
            return expert_mlp_few(x, indices, weights, self.w1, self.w2, *few,
                                  dispatched=dispatched[0] if dispatched else None)

        def planned(x, indices, weights, *dispatched):
            # a plan of its own: one kept on the routing would leak out of the branch
            plan = DispatchPlan.build(indices, self.num_experts,
                                      dispatched=dispatched[0] if dispatched else None)
            return self._planned(x, plan, weights, indices)

        operands = (x, routing.indices, routing.weights)
        if routing.dispatched is not None:
            operands += (routing.dispatched,)
        bound = few_pairs_tokens(routing.indices.shape[1], self.w1, self.w2, self.w_gate)
        return torch.cond(x.shape[0] <= bound, pairs, planned, operands)

    def dense_output(self, x: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
        """``Σ_e w_e f_e(x)`` over every expert: the hidden layers as one GEMM
        [T, E·expert_size], each expert's block scaled by its weight, then one GEMM back.
        ``weights`` None: every expert with weight one, unscaled (the shared experts of
        :class:`~sparseffn.layers.MoE`, a dense MLP of ``E·expert_size`` hidden units).

        x: [T, d_model]; weights: [T, E] or None; returns [T, d_out]."""
        tokens = x.shape[0]
        experts, width, d_model = self.w1.shape
        hidden = nn.functional.linear(x, self.w1.reshape(experts * width, d_model),
                                      None if self.b1 is None else self.b1.reshape(-1))
        act = activation_fn(self.activation)
        if self.w_gate is None:
            hidden = act(hidden)
        else:
            hidden = act(nn.functional.linear(x, self.w_gate.reshape(experts * width, d_model))) * hidden
        hidden = self.hidden_dropout(hidden)
        if weights is not None:
            weights = weights.to(hidden.dtype)
            hidden = (hidden.view(tokens, experts, width) * weights.unsqueeze(-1)).view(
                tokens, experts * width)
        y = hidden @ self.w2.reshape(experts * width, -1).to(hidden.dtype)
        if self.b2 is None:
            return y
        return y + (self.b2.sum(0) if weights is None else weights @ self.b2).to(y.dtype)

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, d_model={self.d_model}, "
                f"expert_size={self.expert_size}, d_out={self.d_out}, "
                f"activation={self.activation}, bias={self.b2 is not None}, "
                f"dense_bias={self.b_out is not None}, gated={self.w_gate is not None}, "
                f"init={self.init}")
