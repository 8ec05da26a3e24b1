"""Parameter groups for optimisers with weight decay, and the Adam optimisers the trainer
and the benchmarks use.

The usual rule (nanoGPT, timm, the Hugging Face Trainer) decays every parameter of two or
more dimensions and no bias or normalisation gain. Sparse layers have biases of two
dimensions (one row per expert or FFF leaf: ``[experts, width]``), which that rule would
decay; :func:`param_groups` asks the modules for them instead.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .auxiliary import dense_grad_parameters, sparse_grad_parameters

# The module method by which a module names its parameters that are biases of any shape.
NO_DECAY_METHOD = "no_weight_decay_parameters"


def no_weight_decay_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters that modules of ``model`` declare as biases through a
    ``no_weight_decay_parameters()`` method (sparseffn's expert stores: per-expert and
    per-leaf biases). Give your own modules the method to add theirs."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        method = getattr(module, NO_DECAY_METHOD, None)
        if callable(method):
            for p in method():
                found[id(p)] = p
    return list(found.values())


def param_groups(model: nn.Module, weight_decay: float, *,
                 decay_embeddings: bool = True) -> list[dict]:
    """Two parameter groups for an optimiser (``torch.optim.AdamW(param_groups(model, 0.1))``):
    ``{"name": "decay", "weight_decay": weight_decay}`` and ``{"name": "no_decay",
    "weight_decay": 0.0}``.

    No decay: every parameter of fewer than two dimensions (biases, LayerNorm/RMSNorm gains,
    whatever their module), the biases sparseffn's layers declare (per-expert and FFF leaf
    biases, ``[experts, width]``; see :func:`no_weight_decay_parameters`), and, with
    ``decay_embeddings=False``, the weights of ``nn.Embedding`` / ``nn.EmbeddingBag``.
    Decay: every other parameter. Frozen parameters (``requires_grad=False``) are left out,
    and so are parameters with sparse gradients (:func:`sparseffn.sparse_grad_parameters`:
    PKM/PEER tables built with ``sparse_grad=True``), which need an optimiser of their own
    (``torch.optim.SparseAdam``). Shared (tied) parameters appear once, in
    ``model.named_parameters()`` order.
    """
    if isinstance(weight_decay, bool) or not isinstance(weight_decay, (int, float)) \
            or not math.isfinite(weight_decay) or weight_decay < 0:
        raise ValueError(f"weight_decay must be a non-negative finite number, got {weight_decay!r}")
    skip = {id(p) for p in sparse_grad_parameters(model)}
    no_decay = {id(p) for p in no_weight_decay_parameters(model)}
    if not decay_embeddings:
        no_decay |= {id(m.weight) for m in model.modules()
                     if isinstance(m, (nn.Embedding, nn.EmbeddingBag))}
    decayed, kept = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in skip:
            continue
        (kept if p.dim() < 2 or id(p) in no_decay else decayed).append(p)
    return [{"params": decayed, "weight_decay": float(weight_decay), "name": "decay"},
            {"params": kept, "weight_decay": 0.0, "name": "no_decay"}]


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False, foreach: bool | None = None
                    ) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_``, with its arguments, also for sparse gradients (PKM/
    PEER tables built with ``sparse_grad=True``, on which PyTorch's raises): every gradient is
    multiplied by ``min(1, max_norm / (norm + 1e-6))``, ``norm`` the ``norm_type``-norm of all
    of them together, and ``norm`` is returned (a 0-d tensor). A sparse gradient counts as the
    dense one it stands for: it is coalesced first (gradients added over micro-batches hold a
    row once per micro-batch until then), which reads its row count on the host, as the
    optimiser's own coalescing would. ``parameters``: an iterable of tensors, or one tensor."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    norm = gradient_norm(params, norm_type, error_if_nonfinite, foreach)
    scale_gradients_(params, max_norm, norm, foreach)
    return norm


def clip_grad_value_(parameters, clip_value: float, foreach: bool | None = None) -> None:
    """``torch.nn.utils.clip_grad_value_``, also for sparse gradients (on which PyTorch's
    raises): every gradient element clamped to ``[-clip_value, clip_value]``. A sparse
    gradient is coalesced first, so a row it holds several times (once per micro-batch) is
    clamped as the dense gradient's sum, not addend by addend."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    dense = [p for p in params if not p.grad.is_sparse]
    if dense:     # (PyTorch's raises on an empty list)
        torch.nn.utils.clip_grad_value_(dense, clip_value, foreach)
    for p in params:
        if p.grad.is_sparse:
            _dense_part(p).clamp_(-clip_value, clip_value)


def gradient_norm(params: list[nn.Parameter], norm_type: float = 2.0,
                  error_if_nonfinite: bool = False, foreach: bool | None = None) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of ``params`` together (those with a
    gradient), as ``torch.nn.utils.get_total_norm``; a sparse gradient is coalesced in place
    and counted by its values (its other rows are zeros, which no norm counts)."""
    return torch.nn.utils.get_total_norm([_dense_part(p) for p in params if p.grad is not None],
                                         norm_type, error_if_nonfinite, foreach)


def scale_gradients_(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor,
                     foreach: bool | None = None) -> None:
    """Multiply every gradient of ``params`` by ``min(1, max_norm / (norm + 1e-6))``, as
    ``torch.nn.utils.clip_grads_with_norm_`` (on the device, no host read); a sparse one's
    values in place (it stays coalesced: ``Tensor.mul_`` would mark it uncoalesced)."""
    params = [p for p in params if p.grad is not None]
    sparse = [p for p in params if p.grad.is_sparse]
    torch.nn.utils.clip_grads_with_norm_([p for p in params if not p.grad.is_sparse],
                                         max_norm, norm, foreach)
    if sparse:
        coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for p in sparse:
        p.grad._values().mul_(coefficient.to(p.grad.device, p.grad.dtype))


def _dense_part(p: nn.Parameter) -> torch.Tensor:
    """``p.grad``, or, for a sparse gradient, its values after coalescing it in place."""
    if not p.grad.is_sparse:
        return p.grad
    if not p.grad.is_coalesced():
        p.grad = p.grad.coalesce()
    return p.grad._values()


# Devices whose parameters torch.optim.Adam(fused=True) updates with one fused kernel.
FUSED_ADAM_DEVICES = ("cpu", "cuda")


def fused_adam_fits(params) -> bool:
    """Whether ``torch.optim.Adam(params, fused=True)`` takes these parameters (or parameter
    groups): floating point, each on a device of :data:`FUSED_ADAM_DEVICES`."""
    for item in params:
        for p in (item["params"] if isinstance(item, dict) else [item]):
            if not (p.is_floating_point() and p.device.type in FUSED_ADAM_DEVICES):
                return False
    return True


def adam_optimizers(model: nn.Module, lr: float, betas: tuple[float, float] = (0.9, 0.999),
                    weight_decay: float = 0.0) -> list[torch.optim.Optimizer]:
    """The optimisers of one training step: ``torch.optim.Adam`` for the parameters with dense
    gradients (weight decay, Adam's L2 term, on the groups of :func:`param_groups` when
    nonzero) and, where the model has parameters with sparse gradients
    (:func:`sparseffn.sparse_grad_parameters`), ``torch.optim.SparseAdam`` for them.

    Adam runs fused (``fused=True``: one kernel for every parameter instead of several
    operators per parameter) where every parameter fits (:func:`fused_adam_fits`), as
    PyTorch's default does not do on the CPU: the update of an 8-million-parameter LM took
    4.1 ms instead of 16.2 on 2 CPU cores. The update is the same Adam; its rounding may
    differ from the unfused one's in the last bits. An optimiser state saved unfused (a
    checkpoint from before) resumes unfused: ``load_state_dict`` restores the saved groups'
    settings, ``fused`` among them."""
    params = param_groups(model, weight_decay) if weight_decay else dense_grad_parameters(model)
    optimizers = [torch.optim.Adam(params, lr=lr, betas=betas,
                                   fused=True if fused_adam_fits(params) else None)]
    sparse = sparse_grad_parameters(model)
    if sparse:   # PKM values / PEER experts with sparse gradients (sparse_grad = true)
        optimizers.append(torch.optim.SparseAdam(sparse, lr=lr, betas=betas))
    return optimizers


class MixedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` that also takes parameters with sparse gradients (PKM/PEER tables
    built with ``sparse_grad=True``), for training loops that hold one optimiser, such as
    Hugging Face's ``Trainer`` (see :class:`sparseffn.hf.SparseTrainer`).

    Every parameter with a dense gradient gets AdamW's update, fused or foreach as AdamW
    chooses. A parameter whose gradient is sparse gets, in its rows that the gradient holds,
    ``torch.optim.SparseAdam``'s arithmetic ("lazy" Adam: the other rows and their moments
    stay as they are), without weight decay, as SparseAdam has none (decaying every row at
    each step would touch the whole table, which sparse gradients exist to avoid); its
    bias correction counts the steps in which it had a gradient. Its state (``step``,
    ``exp_avg``, ``exp_avg_sq``) is kept as AdamW keeps a parameter's, so ``state_dict()`` and
    ``load_state_dict()`` work as AdamW's. ``amsgrad`` is refused for a sparse gradient (as
    SparseAdam has none). Arguments as ``torch.optim.AdamW``'s.

    The sparse gradients are set aside by a step pre-hook registered at construction and
    handled by a step post-hook, so a step pre-hook registered later sees them as ``None``.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2,
                 **kwargs) -> None:
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         **kwargs)
        self._register_sparse_hooks()

    def __setstate__(self, state: dict) -> None:
        super().__setstate__(state)
        if "_set_aside" not in self.__dict__:      # unpickled: hooks are not pickled
            self._register_sparse_hooks()

    def _register_sparse_hooks(self) -> None:
        self._set_aside: list[tuple[dict, nn.Parameter, torch.Tensor]] = []
        self.register_step_pre_hook(_set_sparse_gradients_aside)
        self.register_step_post_hook(_update_sparse_rows)


def _set_sparse_gradients_aside(optimizer: MixedAdamW, args, kwargs) -> None:
    """MixedAdamW's step pre-hook: AdamW skips a parameter without a gradient. (What a step
    that raised before its post-hook left set aside is dropped, not applied later.)"""
    optimizer._set_aside = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None and p.grad.is_sparse:
                if group["amsgrad"]:
                    raise ValueError("MixedAdamW: amsgrad has no sparse form (as SparseAdam "
                                     "has none); a parameter has a sparse gradient")
                if p.grad.sparse_dim() != 1:
                    raise ValueError(f"MixedAdamW: a sparse gradient must hold whole rows "
                                     f"(sparse_dim 1, as embedding tables give), got "
                                     f"sparse_dim {p.grad.sparse_dim()}")
                optimizer._set_aside.append((group, p, p.grad))
                p.grad = None


@torch.no_grad()
def _update_sparse_rows(optimizer: MixedAdamW, args, kwargs) -> None:
    """MixedAdamW's step post-hook: SparseAdam's update (``torch.optim.SparseAdam``) of the
    rows each set-aside gradient holds, its gradient given back."""
    set_aside, optimizer._set_aside = optimizer._set_aside, []
    for group, p, grad in set_aside:
        p.grad = grad
        grad = (-grad if group["maximize"] else grad).coalesce()
        if grad._values().numel() == 0:
            continue
        state = optimizer.state[p]
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        step = float(state["step"])
        beta1, beta2 = group["betas"]
        rows, values = grad._indices()[0], grad._values()
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        # old <- b * old + (1 - b) * new, as old += (1 - b) * (new - old), in the rows read
        old_avg = exp_avg.index_select(0, rows)
        avg_update = (values - old_avg).mul_(1 - beta1)
        exp_avg.index_add_(0, rows, avg_update)
        old_sq = exp_avg_sq.index_select(0, rows)
        sq_update = values.pow(2).sub_(old_sq).mul_(1 - beta2)
        exp_avg_sq.index_add_(0, rows, sq_update)
        numer = avg_update.add_(old_avg)
        denom = sq_update.add_(old_sq).sqrt_().add_(group["eps"])
        step_size = group["lr"] * math.sqrt(1 - beta2 ** step) / (1 - beta1 ** step)
        p.index_add_(0, rows, numer.div_(denom).mul_(-step_size))
