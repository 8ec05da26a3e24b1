"""The one record every router returns, and the base class of every sparse FFN layer.

A router maps tokens to experts; the expert store never knows how (../DESIGN.md). Layers keep
their auxiliary losses and routing statistics on the module after each forward, so that
``forward(x) -> same shape`` stays drop-in; :mod:`sparseffn.auxiliary` collects them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .ops.cvmm import DispatchPlan, sum_per_expert
from .ops.portable import exporting_to_onnx, tracing_forms
from .ops.precision import cast_for_two
from .ops.rows import row_usage, shared_row_index
from .ops.sizes import exporting


@dataclass
class Routing:
    """Which experts each token uses, and with what weight.

    indices: int64 [tokens, k], expert ids.
    weights: float32 [tokens, k], the gate value multiplying each selected expert's output
      (zero where the slot was not dispatched).
    aux_losses: unweighted auxiliary losses (scalar tensors) by name; their weights in the
      training objective come from the router (``Router.aux_loss_weights``).
    dispatched: bool [tokens, k] or None (all dispatched): False where a slot was dropped at
      an expert's capacity (or, in GShard, where the second expert was not sampled); such a
      slot is never computed and contributes zero.
    stats: router-specific statistics (detached scalars), e.g. ``dropped_fraction``.
    dense: True when every token uses every expert in order: ``weights`` is [tokens, E] and
      ``indices`` is ``arange(E)`` for each token (the soft mode of a fast feed-forward tree,
      Belcak & Wattenhofer 2023, arXiv:2308.14711); stores may then compute densely.
    mass: float32 [E] or None: the selection weight of the dispatched pairs summed per expert,
      when the router computed it anyway (noisy top-k's importance, still in its graph); the
      usage statistics then take it, detached, instead of summing again.

    A store that sorts the pairs by expert asks :meth:`plan`, which sorts once per routing: the
    usage statistics then read their counts from the same sort. A store of table rows (PKM,
    PEER) asks :meth:`row_index` for the pairs grouped by row, which its table gradients
    need: the usage statistics then read that too.
    """

    indices: torch.Tensor
    weights: torch.Tensor
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    dispatched: torch.Tensor | None = None
    stats: dict[str, torch.Tensor] = field(default_factory=dict)
    dense: bool = False
    mass: torch.Tensor | None = None
    _plan: DispatchPlan | None = field(default=None, init=False, repr=False, compare=False)
    _row_index: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = field(
        default=None, init=False, repr=False, compare=False)

    def plan(self, num_experts: int) -> DispatchPlan:
        """The :class:`~sparseffn.ops.DispatchPlan` of these indices and ``dispatched`` over
        ``num_experts`` experts, built on the first call and kept (with the weights' mass per
        expert where its sort sums it on the way, for the usage statistics)."""
        if self._plan is None or self._plan.num_experts != num_experts:
            self._plan = DispatchPlan.build(self.indices, num_experts, dispatched=self.dispatched,
                                            weights=self.weights)
        return self._plan

    def built_plan(self, num_experts: int) -> DispatchPlan | None:
        """The plan :meth:`plan` built over ``num_experts`` experts, or None if none was."""
        plan = self._plan
        return plan if plan is not None and plan.num_experts == num_experts else None

    def row_index(self, num_rows: int, *tables: torch.Tensor, sparse_grad: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pairs of ``indices`` grouped by row of a table of ``num_rows`` rows, for the
        backward of the ``tables`` read with them (:func:`~sparseffn.ops.rows.shared_row_index`:
        None where no Triton table gradient will use it), built on the first call that gets
        one and kept."""
        built = self.built_row_index(num_rows)
        if built is None:
            built = shared_row_index(self.indices, num_rows, *tables, sparse_grad=sparse_grad)
            if built is not None:
                self._row_index = (num_rows, built)
        return built

    def built_row_index(self, num_rows: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The row index :meth:`row_index` built over ``num_rows`` rows, or None."""
        kept = self._row_index
        return kept[1] if kept is not None and kept[0] == num_rows else None

    @staticmethod
    def all_experts(weights: torch.Tensor, **kwargs) -> "Routing":
        """A dense routing: every token uses all ``E`` experts with ``weights`` [T, E]."""
        tokens, experts = weights.shape
        indices = torch.arange(experts, device=weights.device).expand(tokens, experts)
        return Routing(indices=indices, weights=weights, dense=True, **kwargs)


def expert_usage(indices: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 dispatched: torch.Tensor | None = None, counts: torch.Tensor | None = None,
                 mass: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per expert: the number of dispatched (token, slot) pairs and their total selection
    weight, float32 [E] each, outside the autograd graph. ``counts`` (integer [E]) and
    ``mass`` ([E]): either when already known (a :class:`~sparseffn.ops.DispatchPlan`'s counts,
    a router's mass), not summed again; when both are summed, one ``index_add_`` into a
    [2, E] buffer does it (each row contiguous). Reads nothing on the host."""
    if mass is not None:
        mass = mass.detach().float()
        if counts is not None:
            return counts.float(), mass
    flat = indices.reshape(-1)
    keep = None if dispatched is None else dispatched.reshape(-1)
    mass_each = None
    if mass is None:
        mass_each = weights.detach().reshape(-1).float()
        if keep is not None:
            mass_each = torch.where(keep, mass_each, torch.zeros_like(mass_each))
    if counts is None:
        ones = torch.ones(flat.shape, device=flat.device, dtype=torch.float32) if keep is None \
            else keep.float()
        if mass_each is None:
            counts = sum_per_expert(flat, ones, num_experts)
        else:   # both: one scatter of the (1, weight) columns
            both = sum_per_expert(flat, torch.stack((ones, mass_each)), num_experts)
            return both[0], both[1]
    if mass is None:
        mass = sum_per_expert(flat, mass_each, num_experts)
    return counts.float(), mass


def _usage_of(routing: Routing, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`expert_usage` of a routing, from what its store already computed: the plan's
    counts and mass, or the table rows' index (every pair dispatched), else summed here."""
    plan, mass = routing.built_plan(num_experts), routing.mass
    if plan is not None:
        return expert_usage(routing.indices, routing.weights, num_experts, routing.dispatched,
                            plan.counts, plan.mass if mass is None else mass)
    row_index = routing.built_row_index(num_experts)
    if row_index is not None and routing.dispatched is None:
        return row_usage(routing.indices, routing.weights, num_experts, row_index, mass)
    return expert_usage(routing.indices, routing.weights, num_experts, routing.dispatched,
                        None, mass)


def _inside_func_transform() -> bool:
    """True inside a ``torch.func`` transform (``grad``, ``vjp``, ``vmap``, ...); False while
    ``torch.compile`` traces. There a forward records no usage: torch.func refuses in-place
    changes of tensors the function did not receive, the usage buffers among them
    (BatchNorm's running statistics are refused alike), and under ``vmap`` the counts of one
    entry would be summed into an unbatched tensor."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._functorch.peek_interpreter_stack() is not None


def recomputing() -> bool:
    """True while a forward runs again inside a backward pass: the recomputation of
    activation checkpointing (``torch.utils.checkpoint``, reentrant or not)."""
    if torch.compiler.is_compiling():
        return False
    return torch._C._current_graph_task_id() != -1


class _AddAuxLossGradient(torch.autograd.Function):
    """The identity on ``y`` whose backward also sends ``d(objective)/d(aux) = 1`` into the
    weighted auxiliary loss ``aux`` (a scalar).

    Used only in the recomputation of reentrant activation checkpointing: there the first
    forward ran without autograd, so the ``aux_loss(model)`` a training loop added was a
    constant, and the recomputed forward is the only graph the aux loss can enter.
    (The same injection in a non-reentrant recomputation is harmless: that graph is only
    read for its saved tensors.)"""

    @staticmethod
    def forward(ctx, y, aux):
        ctx.aux_dtype, ctx.aux_device = aux.dtype, aux.device
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=ctx.aux_device)


class _Transient:
    """What one forward leaves on a layer for the helpers to collect: the unweighted aux
    losses (in the autograd graph) and the routing statistics. Never copied, pickled or saved:
    a deep copy or an unpickled layer starts empty (so ``copy.deepcopy`` and
    ``torch.optim.swa_utils.AveragedModel`` work after a training forward)."""

    __slots__ = ("aux_losses", "routing_stats", "observer", "summing", "usage_paused",
                 "token_mask", "kept_rows")

    def __init__(self) -> None:
        self.aux_losses: dict[str, torch.Tensor] = {}
        self.routing_stats: dict[str, torch.Tensor] = {}
        # inside sparseffn.summing_aux_losses: each call adds its aux losses to the last ones
        self.summing = False
        # called with each forward's Routing while a sparseffn.analysis.RoutingRecorder is on
        self.observer = None
        # inside sparseffn.no_usage_statistics: a forward records no usage (a copy made there
        # counts again, as the block's setting is not the layer's)
        self.usage_paused = False
        # inside sparseffn.skipping_padding: the mask [...] of the tokens a forward computes
        self.token_mask: torch.Tensor | None = None
        # the rows [T'] of the flattened input the last forward computed (None: all), which
        # an activation checkpoint's recomputation of it computes again
        self.kept_rows: torch.Tensor | None = None

    def __deepcopy__(self, memo) -> "_Transient":
        return _Transient()

    def __reduce__(self):
        return (_Transient, ())


class SparseFFN(nn.Module):
    """Base of every drop-in FFN layer: ``forward(x: [..., d_model]) -> [..., d_model]``.

    After each forward a layer holds:
      aux_losses: unweighted auxiliary losses by name (scalar tensors, in the graph);
      aux_loss_weights: the weight of each in the training objective;
      routing_stats: per-expert ``counts`` (dispatched (token, slot) pairs) and selection
        ``mass`` of the last forward, and the router's own statistics (``dropped_fraction``
        where capacity applies);
    and accumulates, in the non-persistent buffers ``usage_counts`` / ``usage_mass`` (moved
    by ``.to()``, not saved in a state dict), the same per-expert sums across forwards until
    :meth:`reset_usage` (for the expert-usage analyses of Csordás et al. 2023, Fig. 3).
    Inside :func:`sparseffn.no_usage_statistics` (generation) a forward records no usage:
    the buffers stay as they are and ``routing_stats`` keeps only the router's statistics.

    Transient state survives the ecosystem: ``copy.deepcopy`` after a training forward,
    ``torch.inference_mode`` then a normal forward, activation checkpointing (a recomputed
    forward records nothing and, under reentrant checkpointing, adds the aux-loss gradient
    itself), meta-device construction then ``to_empty`` and ``reset_parameters``.
    """

    d_model: int
    #: Whether a forward records its usage (``counts`` / ``mass`` and the accumulated
    #: buffers); a layer's own setting. Inside :func:`sparseffn.no_usage_statistics`
    #: (generation) no forward records it either way: see :attr:`counts_usage`.
    records_usage = True
    #: The ``routing_stats`` a forward keeps only when it records usage.
    usage_stats: tuple[str, ...] = ("counts", "mass")

    def __init__(self) -> None:
        super().__init__()
        self._transient = _Transient()
        self.aux_loss_weights: dict[str, float] = {}

    @property
    def counts_usage(self) -> bool:
        """Whether the next forward records its usage: :attr:`records_usage`, and not inside
        :func:`sparseffn.no_usage_statistics` or a ``torch.func`` transform."""
        return (self.records_usage and not self._transient.usage_paused
                and not _inside_func_transform())

    @property
    def aux_losses(self) -> dict[str, torch.Tensor]:
        return self._transient.aux_losses

    @aux_losses.setter
    def aux_losses(self, value: dict[str, torch.Tensor]) -> None:
        self._transient.aux_losses = value

    @property
    def routing_stats(self) -> dict[str, torch.Tensor]:
        return self._transient.routing_stats

    @routing_stats.setter
    def routing_stats(self, value: dict[str, torch.Tensor]) -> None:
        self._transient.routing_stats = value

    def _start_forward(self, x: torch.Tensor) -> None:
        """Check ``x`` (:meth:`_check_input`) and let go of what the last forward left: its
        aux losses keep its autograd graph alive, and with it each parameter's AccumulateGrad
        node, which the graph this forward builds would reuse on the CUDA stream it was made
        on (a CUDA graph captured after an eager step on the default stream then fails, and
        PyTorch warns that "the AccumulateGrad node's stream does not match"). Kept inside
        :func:`sparseffn.summing_aux_losses` (each call adds to the last) and in an
        activation checkpoint's recomputation (which records nothing)."""
        self._check_input(x)
        transient = self._transient
        if not transient.summing and not recomputing():
            transient.aux_losses = {}
            transient.routing_stats = {}

    def _check_input(self, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(f"{type(self).__name__} expects a floating-point tensor, got "
                            f"{getattr(x, 'dtype', type(x).__name__)}")
        if x.dim() < 1 or x.shape[-1] != self.d_model:
            raise ValueError(f"{type(self).__name__} expects input of shape [..., d_model="
                             f"{self.d_model}], got {tuple(x.shape)}")
        if not torch.is_autocast_enabled(x.device.type):
            dtype = self._parameter_dtype(x.dtype)
            if x.dtype != dtype:
                raise TypeError(f"{type(self).__name__} holds {dtype} parameters and got "
                                f"{x.dtype} input: convert one to the other (layer.to(dtype)) "
                                f"or run under torch.autocast")

    def _parameter_dtype(self, default: torch.dtype) -> torch.dtype:
        """The dtype of the first floating-point parameter (``default`` when none), in the
        order of ``parameters()``. The layer's own parameters and its first child's are looked
        at directly: ``parameters()`` walks every submodule, microseconds on every forward."""
        # Plain loops, not next(iterator, default): Dynamo before PyTorch 2.9 cannot trace that.
        nearest = [self]
        for child in self._modules.values():
            nearest.append(child)
            break
        for module in nearest:
            for p in module._parameters.values():
                if p is not None and p.is_floating_point():
                    return p.dtype
        for p in self.parameters():
            if p.is_floating_point():
                return p.dtype
        return default

    def _init_usage(self, num_experts: int) -> None:
        """Register the usage buffers for ``num_experts`` experts (at construction)."""
        self.register_buffer("usage_counts", torch.zeros(num_experts), persistent=False)
        self.register_buffer("usage_mass", torch.zeros(num_experts), persistent=False)

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.cuda()``, ``.half()`` ... move the usage buffers but keep them float32:
        counts summed in bfloat16 stop growing at 256."""
        result = super()._apply(fn, recurse)
        for name in ("usage_counts", "usage_mass"):
            buffer = self._buffers.get(name)
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != torch.float32:
                self._buffers[name] = buffer.float()
        return result

    def _record_routing(self, routing: Routing, num_experts: int,
                        y: torch.Tensor | None = None) -> torch.Tensor | None:
        """Keep the routing's aux losses and usage from this forward; returns ``y`` (with the
        aux-loss gradient attached during a reentrant checkpoint's recomputation)."""
        if recomputing():
            return self._attach_aux_gradient(routing, y)
        if self._transient.summing:    # a layer called several times in one forward
            summed = dict(self.aux_losses)
            for name, loss in routing.aux_losses.items():
                summed[name] = summed[name] + loss if name in summed else loss
            self.aux_losses = summed
        else:
            self.aux_losses = dict(routing.aux_losses)
        if self.counts_usage:
            self._record_usage(*_usage_of(routing, num_experts), routing.stats)
        else:
            self.routing_stats = dict(routing.stats)
        if self._transient.observer is not None:
            self._transient.observer(routing)
        return y

    def _attach_aux_gradient(self, routing: Routing, y: torch.Tensor | None):
        if y is None or not torch.is_grad_enabled():
            return y
        weighted = [self.aux_loss_weights[name] * loss for name, loss in routing.aux_losses.items()
                    if loss.requires_grad and self.aux_loss_weights.get(name)]
        if not weighted:
            return y
        return _AddAuxLossGradient.apply(y, torch.stack(weighted).sum())

    def _record_usage(self, counts: torch.Tensor, mass: torch.Tensor,
                      stats: dict[str, torch.Tensor]) -> None:
        """Keep this forward's per-expert ``counts`` and ``mass`` (float32 [E], outside the
        autograd graph) and other ``stats`` in ``routing_stats``, and add them to the
        accumulated usage."""
        self.routing_stats = {"counts": counts, "mass": mass, **stats}
        usage = self._buffers.get("usage_counts")    # not Module.__getattr__: every forward
        if usage is None:
            return
        if usage.shape != counts.shape:
            raise ValueError(f"{type(self).__name__}: routing over {counts.shape[0]} experts, "
                             f"but usage is kept for {usage.shape[0]}")
        usage_mass = self._buffers["usage_mass"]
        usage.add_(counts.to(usage.dtype))
        usage_mass.add_(mass.to(usage_mass.dtype))

    def sparse_grad_parameters(self) -> list[nn.Parameter]:
        """Parameters whose gradients are sparse tensors (none, unless a layer says so)."""
        return []

    @torch.no_grad()
    def reset_usage(self) -> None:
        """Zero the accumulated per-expert usage (in place: the buffers stay where they are)."""
        for name in ("usage_counts", "usage_mass"):
            buffer = getattr(self, name, None)
            if buffer is not None:
                buffer.zero_()


def _input_dtype(module: nn.Module, x: torch.Tensor) -> torch.dtype | None:
    """A router's or store's ``input_dtype(x)`` (None for one that does not say)."""
    said = getattr(module, "input_dtype", None)
    return said(x) if callable(said) else None


class RoutedFFN(SparseFFN):
    """A layer that is a router plus an expert store (../DESIGN.md).

    One ``forward`` for all of them: check the input, flatten it to [T, d_model], route
    (:meth:`route`, by default ``router(x)``), compute (``store(x, routing)``), record the aux
    losses and the usage. The aux-loss weights come from the router, so no layer can forget
    them.

    Subclasses build ``router`` and ``store`` and may override :meth:`route` (a fast
    feed-forward tree routes differently in its soft and hard modes). A submodule ``shared``,
    where a subclass adds one, is experts that every token uses: its ``dense_output(x, None)``
    [T, d_out] is added to the store's output (:class:`~sparseffn.layers.MoE`'s
    ``shared_experts``). ``_renamed_parameters``
    maps state-dict keys of earlier releases to today's, so old checkpoints still load.

    forward(x: [..., d_model]) -> [..., store.d_out]
    """

    _renamed_parameters: dict[str, str] = {}

    def __init__(self, router: nn.Module, store: nn.Module) -> None:
        super().__init__()
        self.router = router
        self.store = store
        self.d_model = store.d_model
        self.num_experts = store.num_experts
        self.aux_loss_weights = dict(router.aux_loss_weights())
        self._init_usage(store.num_experts)

    def route(self, x: torch.Tensor) -> Routing:
        """The routing of the flattened tokens x [T, d_model]."""
        return self.router(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if exporting_to_onnx():
            return self._onnx_forward(x)
        if torch.jit.is_tracing():
            raise NotImplementedError(
                f"{type(self).__name__}: TorchScript tracing (torch.jit.trace, or "
                f"torch.onnx.export(..., dynamo=False)) cannot record sparseffn's operators, "
                f"and the program it made would compute wrong outputs. Use torch.export, or "
                f"for ONNX torch.onnx.export(..., dynamo=True) or sparseffn.to_onnx")
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        self._start_forward(x)
        x_flat = x.reshape(-1, self.d_model)
        tokens = x_flat.shape[0]    # (not x.shape[:-1].numel(), which fixes symbolic sizes)
        rows = self._kept_rows(x)
        if rows is not None:                    # inside sparseffn.skipping_padding
            x_flat = x_flat.index_select(0, rows)
        x_router, x_store = self._cast_once(x_flat)
        routing = self.route(x_router)
        y = self.store(x_store, routing)                                 # [T, d_out]
        shared = self._modules.get("shared")
        if shared is not None:          # experts every token uses (MoEConfig.shared_experts)
            y = y + shared.dense_output(x_store, None)
        y = self._record_routing(routing, self.num_experts, y)
        if rows is not None:                    # the tokens left out get zeros
            y = y.new_zeros(tokens, y.shape[-1]).index_copy(0, rows, y)
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _onnx_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The forward that ``torch.onnx.export(model, ...)`` traces: an ONNX program computes
        inference, so a layer in training mode (routing noise, capacity drops, usage counts)
        is refused, and the layer runs without autograd, as eager inference runs under
        ``no_grad`` (the few-token expert path, no aux losses)."""
        if self.training:
            raise ValueError(f"{type(self).__name__} is in training mode: an ONNX program "
                             f"computes inference; call model.eval() before torch.onnx.export")
        # tracing_forms: for torch.cond's branches (the expert MLP's If), which Dynamo
        # traces, reading PyTorch's ONNX flag as False
        with torch.no_grad(), tracing_forms():
            return self._forward(x)

    def _kept_rows(self, x: torch.Tensor) -> torch.Tensor | None:
        """The rows of the flattened ``x`` [..., d_model] this forward computes (int64 [T']),
        or None for all of them: inside :func:`sparseffn.skipping_padding`, those its mask
        keeps (found on the host: one synchronisation; the mask has ``x``'s shape without its
        last dimension, or, for ``x`` flattened to [T, d_model] as OPT flattens its MLP's
        input, T elements in row-major order); in an activation checkpoint's
        recomputation, the rows of the forward it repeats, which ran inside the block while
        the backward may run outside it."""
        transient = self._transient
        if transient.token_mask is None and transient.kept_rows is None:
            return None
        if recomputing():
            return transient.kept_rows
        mask = transient.token_mask
        if mask is None:
            transient.kept_rows = None
            return None
        flattened = x.dim() == 2 and mask.numel() == x.shape[0]
        if mask.shape != x.shape[:-1] and not flattened:
            raise ValueError(f"{type(self).__name__}: skipping_padding's mask has shape "
                             f"{tuple(mask.shape)}, but this layer's input is "
                             f"{tuple(x.shape)}: the mask must have the input's shape without "
                             f"its last dimension (e.g. [batch, seq] for [batch, seq, d_model]), "
                             f"or as many elements as a flattened input has rows")
        kept = mask.to(x.device).reshape(-1).nonzero().squeeze(1)
        if exporting():   # a bound for the data-dependent count: without
            # it the export's runtime checks of sizes derived from it (k pairs a token) were
            # up to 2^64 - 4, which no int64 of the ONNX graph holds
            torch._check(kept.shape[0] <= 2 ** 31 - 1)
        transient.kept_rows = kept
        return transient.kept_rows

    def _cast_once(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The router's and the store's inputs: ``x`` [T, d_model] for both, or ``x`` in the
        reduced dtype, cast once, where the router and the store would each cast a float32
        ``x`` to it (under autocast, a router with ``precision="autocast"`` and an MLP store).
        The forward is the same; one [T, d_model] copy is made and kept for the backward
        instead of two; the input gradient is the two parts summed in that dtype and widened
        by one operator (:func:`~sparseffn.ops.precision.cast_for_two`), as for one
        ``nn.Linear``, instead of two casts to float32 and a float32 sum."""
        dtype = _input_dtype(self.router, x)
        if dtype is None or x.dtype != torch.float32 or dtype != _input_dtype(self.store, x):
            return x, x
        return cast_for_two(x, dtype)

    def reset_parameters(self) -> None:
        """Initialise the router, the store and any shared experts again, and zero the usage
        buffers."""
        self.router.reset_parameters()
        self.store.reset_parameters()
        shared = self._modules.get("shared")
        if shared is not None:
            shared.reset_parameters()
        self.reset_usage()

    def sparse_grad_parameters(self) -> list[nn.Parameter]:
        return self.store.sparse_grad_parameters()

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        for old, new in self._renamed_parameters.items():
            if prefix + old in state_dict and prefix + new not in state_dict:
                state_dict[prefix + new] = state_dict.pop(prefix + old)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
