"""What every router shares: fp32 selection logits, initialisation, expert dropout, capacity.

A router maps ``x [tokens, d_model]`` to a :class:`~sparseffn.routing.Routing`; it never knows
how the experts are computed (../DESIGN.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..init import dense_init_std, equal_norm_rows_
from ..ops import kernels
from ..ops.grad_mode import differentiable_once
from ..ops.precision import autocast_dtype, autocast_off, routing_dtype
from ..registry import RouterConfig
from ..routing import Routing


def full_precision_linear(x: torch.Tensor, weight: torch.Tensor,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x Wᵀ (+ b)`` in float32 whatever the input dtype or autocast (float64 for a float64
    input, :func:`~sparseffn.ops.precision.routing_dtype`): routing decisions and their losses
    are computed at full precision (Switch Transformer's "selective precision").

    x: [T, d]; weight: [E, d]; returns [T, E] float32 (float64)."""
    dtype = routing_dtype(x.dtype)
    with autocast_off(x.device.type):
        return nn.functional.linear(x.to(dtype), weight.to(dtype),
                                    None if bias is None else bias.to(dtype))


ROUTER_PRECISIONS = ("float32", "autocast")


def selected_scores(scores: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``scores.gather(1, indices)``: each token's scores of its selected experts, [T, E] and
    int64 [T, k] -> [T, k].

    While ``torch.compile`` traces a forward whose backward it will compile, the gradient is
    the ``sparseffn::dense_rows`` operator instead of the ``scatter_add`` into zeros that
    autograd writes for ``gather``. Inductor's CPU backend in PyTorch 2.13 (not 2.9 or 2.11)
    scheduled a fused kernel that read that scatter's target before the scatter ran: a
    compiled S-BASE layer (E 6, k 1) got wrong input and router gradients, in training and
    in evaluation. Eager keeps the plain ``gather``."""
    if torch.compiler.is_compiling() and torch.is_grad_enabled() and scores.requires_grad:
        return _SelectedScores.apply(scores, indices)
    return scores.gather(1, indices)


class _SelectedScores(torch.autograd.Function):
    """``scores.gather(1, indices)`` whose gradient is one opaque operator (see
    :func:`selected_scores`)."""
    generate_vmap_rule = True

    @staticmethod
    def forward(scores, indices):
        return scores.gather(1, indices)

    @staticmethod
    def setup_context(ctx, inputs, output):
        scores, indices = inputs
        ctx.save_for_backward(indices)
        ctx.num_experts = scores.shape[1]

    @staticmethod
    @differentiable_once(with_graph=lambda ctx, grad: (   # (second derivatives)
        grad.new_zeros(grad.shape[0], ctx.num_experts).scatter_add(1, ctx.saved_tensors[0],
                                                                   grad), None))
    def backward(ctx, grad):
        indices, = ctx.saved_tensors
        return kernels.dense_rows(indices, grad.contiguous(), ctx.num_experts), None


def selection_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     precision: str = "float32") -> torch.Tensor:
    """The selection logits ``x Wᵀ (+ b)`` [T, E] in float32 (float64 for a float64 ``x``),
    the product computed as ``precision`` says (one of ``ROUTER_PRECISIONS``):

    - ``"float32"``: in float32 even under autocast (:func:`full_precision_linear`; Switch
      Transformer's "selective precision"), in float64 for a float64 ``x``;
    - ``"autocast"``: like any ``nn.Linear``: in bf16 under bf16 autocast (as the σ-MoE code of
      Csordás et al. 2023 does), else in the weight's dtype. On a GPU at large d_model this
      is several times cheaper (fp32 products do not use the tensor cores).

    The scores, the top-k and the losses computed from the logits are float32 (float64)
    either way.

    x: [T, d]; weight: [E, d]."""
    if precision == "float32":
        return full_precision_linear(x, weight, bias)
    if precision != "autocast":
        raise ValueError(f"router precision must be one of {ROUTER_PRECISIONS}, got {precision!r}")
    if not torch.is_autocast_enabled(x.device.type):
        x = x.to(weight.dtype)
    logits = nn.functional.linear(x, weight, bias)
    return logits.to(routing_dtype(logits.dtype))


@torch.no_grad()
def init_selection_(weight: torch.Tensor, init: str, init_depth: int) -> torch.Tensor:
    """Initialise a selection matrix [E, d_model].

    - ``"sigma_moe"``: like the experts' first layer, ``N(0, sqrt(2/(d_model init_depth)))``,
      with every row of equal norm (Csordás et al. 2023 §5);
    - ``"standard"``: the same distribution without the row-norm equalisation;
    - ``"switch"``: truncated ``N(0, sqrt(0.1/d_model))`` (Fedus et al.).
    """
    d_model = weight.shape[-1]
    if init == "switch":
        std = math.sqrt(0.1 / d_model)
        return nn.init.trunc_normal_(weight, 0.0, std, -2 * std, 2 * std)
    std = dense_init_std(d_model, init_depth)
    if init == "sigma_moe":
        return equal_norm_rows_(weight, std)
    return weight.normal_(0.0, std)


def drop_experts(scores: torch.Tensor, rate: float, training: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Csordás et al. 2023's expert dropout (Eq. 36): during training each (token, expert) pair is
    dropped with probability ``rate``; a dropped expert cannot be selected (its score becomes
    -inf for the selection), and the kept scores are not rescaled.

    Returns (scores for the selection [T, E], dropped mask [T, E] or None)."""
    if not training or rate <= 0:
        return scores, None
    dropped = torch.rand_like(scores) < rate
    return scores.masked_fill(dropped, float("-inf")), dropped


def active_capacity_factor(config, training: bool) -> float | None:
    """The capacity factor of a router with capacity: ``config.capacity_factor`` in training,
    ``config.eval_capacity_factor`` in evaluation (``module.eval()``).

    Capacity makes a token's output depend on the tokens that arrive with it (which of them
    come first to an expert), so by default evaluation is dropless (``eval_capacity_factor``
    None): a model then gives each token the same output whether the sequence is processed
    at once or a token at a time, as in generation with a KV cache. Fedus et al. 2022 evaluate
    with a capacity factor of their own (e.g. 2.0); set ``eval_capacity_factor`` for that."""
    return config.capacity_factor if training else config.eval_capacity_factor


def capacity_of(capacity_factor: float | None, tokens: int, k: int, num_experts: int
                ) -> int | None:
    """``ceil(capacity_factor · k · tokens / num_experts)`` (at least 1); None when dropless
    (``capacity_factor`` 0 or None)."""
    if not capacity_factor:
        return None
    return count_max(1, math.ceil(capacity_factor * k * tokens / num_experts))


def count_min(a: int, b: int) -> int:
    """``min`` of two counts: ``torch.sym_min`` where one is symbolic (a comparison there would
    be a guard), the built-in ``min`` of two ints (Dynamo on PyTorch 2.8 to 2.11 refuses
    ``torch.sym_min`` of two ints: "torch.* op returned non-Tensor")."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return torch.sym_min(a, b)
    return min(a, b)


def count_max(a: int, b: int) -> int:
    """``max`` of two counts, as :func:`count_min`."""
    if isinstance(a, torch.SymInt) or isinstance(b, torch.SymInt):
        return torch.sym_max(a, b)
    return max(a, b)


class Router(nn.Module):
    """Base of every router: ``forward(x: [tokens, d_model]) -> Routing``.

    Subclasses own their parameters and implement :meth:`forward`; ``reset_parameters`` uses
    the layer's ``init`` scheme.

    ``global_batch``: None (the default: the batch statistics of the aux losses are over this
    call's tokens) or a :class:`~sparseffn.losses.BatchSum` that makes them global across
    processes (set by :func:`sparseffn.distributed.shard_experts`).

    ``aux_losses_in_eval``: False (the default) or True inside
    :func:`sparseffn.computing_aux_losses`; see :attr:`computes_aux_losses`.
    """

    global_batch = None
    aux_losses_in_eval = False

    def __init__(self, config: RouterConfig, d_model: int, num_experts: int, k: int,
                 init: str = "sigma_moe", init_depth: int = 1) -> None:
        super().__init__()
        config.check_layer(num_experts, k)
        self.config = config
        self.d_model, self.num_experts, self.k = d_model, num_experts, k
        self.init, self.init_depth = init, init_depth

    def reset_parameters(self) -> None:
        raise NotImplementedError

    def aux_loss_weights(self) -> dict[str, float]:
        """The weight in the training objective of each aux loss this router returns."""
        return self.config.aux_loss_weights()

    def forward(self, x: torch.Tensor) -> Routing:
        raise NotImplementedError

    @property
    def computes_aux_losses(self) -> bool:
        """Whether this forward computes the aux losses: in training mode, whenever autograd
        records, and inside :func:`sparseffn.computing_aux_losses`. In evaluation mode without
        autograd (generation, a validation pass under ``no_grad``) nothing can train on them,
        so routers skip them: at one token they were 5 of σ-MoE's 19 computing operators and 7
        of Switch's 22, and, with ``global_batch``, a collective per layer."""
        return self.training or torch.is_grad_enabled() or self.aux_losses_in_eval

    @property
    def routes_tokens_alone_in_eval(self) -> bool:
        """Whether, in evaluation mode, a token's routing depends on that token alone and not
        on the tokens evaluated with it, so that a model gives a token the same output
        whether a sequence runs at once or a token at a time (generation with a KV cache).
        True except under an evaluation capacity (``eval_capacity_factor`` of Switch and
        GShard: first come, first served; see :func:`active_capacity_factor`)."""
        return not getattr(self.config, "eval_capacity_factor", None)

    def input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """The dtype this router's products read ``x`` in when autocast casts it, or None
        where they read ``x`` as it comes (float32 routing). A layer whose store casts ``x`` to
        the same dtype casts it once for both (:class:`~sparseffn.routing.RoutedFFN`)."""
        return None

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, num_experts={self.num_experts}, k={self.k}"


class LinearRouter(Router):
    """A router whose scores are ``W x`` for one selection matrix ``weight`` [E, d_model]
    (W_s / W_3 / wg in the papers), initialised by :func:`init_selection_`."""

    def __init__(self, config: RouterConfig, d_model: int, num_experts: int, k: int,
                 init: str = "sigma_moe", init_depth: int = 1) -> None:
        super().__init__(config, d_model, num_experts, k, init, init_depth)
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init_selection_(self.weight, self.init, self.init_depth)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """``W x`` as float32 (float64) [T, E], computed in the config's ``precision``."""
        return selection_linear(x, self.weight, precision=self.config.precision)

    def input_dtype(self, x: torch.Tensor) -> torch.dtype | None:
        """Under autocast with ``precision="autocast"``, the autocast dtype (the selection
        product is then an ``nn.Linear`` like any other)."""
        return autocast_dtype(x) if self.config.precision == "autocast" else None
