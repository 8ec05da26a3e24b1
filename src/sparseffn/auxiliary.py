"""Collect the auxiliary losses and routing statistics that layers record at each forward.

    loss = task_loss + sparseffn.aux_loss(model)

works for any model containing sparseffn layers, however deeply nested.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from .routers.base import Router
from .routing import RoutedFFN, SparseFFN


def _layers(model: nn.Module):
    for name, module in model.named_modules():
        if isinstance(module, SparseFFN):
            yield name, module


def aux_loss(model: nn.Module) -> torch.Tensor:
    """Σ over sparse layers and their losses of ``weight · loss`` from the last forward (of
    every call of a layer inside :func:`summing_aux_losses`).

    A scalar tensor (zero when the model has no sparse layers or none has run). Every loss a
    layer records must have a weight (zero is a weight): a loss without one raises a KeyError
    naming the layer, rather than being dropped silently.

    A forward in evaluation mode without autograd records no aux losses (nothing can train on
    them; see :attr:`~sparseffn.routers.Router.computes_aux_losses`): after one, this is zero.
    To measure them on held-out data, run the forward inside :func:`computing_aux_losses`."""
    total = None
    for name, layer in _layers(model):
        for loss_name, value in layer.aux_losses.items():
            try:
                weight = layer.aux_loss_weights[loss_name]
            except KeyError:
                raise KeyError(f"sparse layer {name or '<root>'} ({type(layer).__name__}) "
                               f"recorded the aux loss {loss_name!r} but has no weight for it "
                               f"(aux_loss_weights: {sorted(layer.aux_loss_weights)})") from None
            if weight:
                term = weight * value
                total = term if total is None else total + term
    if total is None:
        param = next(model.parameters(), None)
        return torch.zeros((), device=param.device if param is not None else None)
    return total


@contextlib.contextmanager
def summing_aux_losses(model: nn.Module):
    """Inside, every sparse layer of ``model`` adds up the aux losses of all its calls instead
    of keeping the last call's: for a layer applied several times in one forward (shared across
    depth, as in a Universal Transformer). Entering clears the layers' aux losses, so wrap one
    training step's forward; :func:`aux_loss` inside or after the block gives the sum, as if
    each call were its own layer. Usage statistics count every call either way.

        with sparseffn.summing_aux_losses(model):
            loss = task_loss(model(x)) + sparseffn.aux_loss(model)
    """
    layers = [layer for _, layer in _layers(model)]
    for layer in layers:
        layer.aux_losses = {}
    with _transient_on_each(layers, "summing", True):
        yield


@contextlib.contextmanager
def computing_aux_losses(model: nn.Module):
    """Inside, the routers of ``model`` compute their aux losses in evaluation mode without
    autograd too, where they skip them otherwise: for the balance of the routing on held-out
    data, with the model as it runs at inference (no dropout, no noise, evaluation capacity).

        model.eval()
        with torch.no_grad(), sparseffn.computing_aux_losses(model):
            model(x_val)
        terms = sparseffn.aux_loss_terms(model)
    """
    with _setting_on_each([m for m in model.modules() if isinstance(m, Router)],
                          "aux_losses_in_eval", True):
        yield


@contextlib.contextmanager
def no_usage_statistics(model: nn.Module):
    """Inside, the sparse layers of ``model`` record no expert usage: a forward leaves
    ``usage_counts`` / ``usage_mass`` as they are, and its ``routing_stats`` hold only what
    the router measured anyway (``dropped_fraction``, ...), none of the layer's
    ``usage_stats`` (``counts``, ``mass``; FFF's soft ``entropy``). The outputs and aux losses
    are the same.

    For generation, where counting is most of what a decode step's router does beyond
    routing: at one token, about 6 of a MoE layer's 14 computing operators.
    :func:`sparseffn.models.generate.generate` and its ``Decoder`` run inside it unless told
    to record; wrap other decoding loops (Hugging Face's ``generate()``) yourself:

        with torch.no_grad(), sparseffn.no_usage_statistics(model):
            out = model.generate(prompt, max_new_tokens=100)

    The expert-usage analyses and the trainer's collapse monitor read these statistics; they
    see nothing of what runs inside. The block's setting is not the layers' own
    (``records_usage``, which it leaves as it is): a copy of a layer made inside it
    (``copy.deepcopy``, ``torch.save`` of the module) counts usage."""
    with _transient_on_each([layer for _, layer in _layers(model)], "usage_paused", True):
        yield


@contextlib.contextmanager
def skipping_padding(model: nn.Module, attention_mask: torch.Tensor):
    """Inside, every routed layer of ``model`` (a router plus an expert store: σ-MoE, MoE with
    any router, FFF, PKM, PEER, the top-k MLP) computes only the tokens where
    ``attention_mask`` is nonzero (Hugging Face's ``attention_mask``: 1 for a token, 0 for
    padding). The others get a zero output and a zero input gradient, and take no part in
    anything computed over the batch: the aux losses, a capacity (Switch, GShard: padding no
    longer takes a real token's place), S-BASE's balanced assignment, PEER's query
    BatchNorm, the usage statistics.

        with sparseffn.skipping_padding(model, batch["attention_mask"]):
            loss = model(**batch).loss + sparseffn.aux_loss(model)
        loss.backward()

    ``attention_mask``: [...] with the shape of each layer's input without its last dimension
    (``[batch, seq]`` for ``[batch, seq, d_model]``), or as many elements as an input
    flattened to ``[batch·seq, d_model]`` has rows (OPT's MLP), in row-major order; a
    ValueError says so otherwise. Give
    it the part of a model the mask is about: of an encoder-decoder (T5), the encoder
    (``model.get_encoder()``) with the source's mask; its decoder's tokens are others. Finding
    the kept tokens reads the mask on the host once per layer call (a graph break under
    ``torch.compile``). Activation checkpointing's recomputation, in a backward run inside or
    outside the block, computes the rows the forward computed. The dense MLP and the classic
    dense-gated mixtures compute every token as before: each token's output depends on that
    token alone."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"skipping_padding: attention_mask must be a tensor, got "
                        f"{type(attention_mask).__name__}")
    layers = [layer for _, layer in _layers(model) if isinstance(layer, RoutedFFN)]
    with _transient_on_each(layers, "token_mask", attention_mask):
        yield


@contextlib.contextmanager
def _transient_on_each(layers: list[SparseFFN], name: str, value):
    """Set ``name`` in each layer's transient state (``routing._Transient``, which copies of a
    layer do not carry) to ``value`` and, after, back to what each had."""
    before = [getattr(layer._transient, name) for layer in layers]
    for layer in layers:
        setattr(layer._transient, name, value)
    try:
        yield
    finally:
        for layer, had in zip(layers, before):
            setattr(layer._transient, name, had)


@contextlib.contextmanager
def _setting_on_each(modules: list[nn.Module], name: str, value: bool):
    """Set the instance attribute ``name`` of each of ``modules`` to ``value``, and, after,
    back to what each had (deleting it where it had none: back to the class's default)."""
    before = [module.__dict__.get(name) for module in modules]
    for module in modules:
        setattr(module, name, value)
    try:
        yield
    finally:
        for module, had in zip(modules, before):
            if had is None:
                delattr(module, name)
            else:
                setattr(module, name, had)


def aux_loss_terms(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every unweighted auxiliary loss of the last forward (summed over a layer's calls inside
    :func:`summing_aux_losses`), as ``"layer.path/loss": value``."""
    return {f"{name or '<root>'}/{loss_name}": value
            for name, layer in _layers(model) for loss_name, value in layer.aux_losses.items()}


def routing_stats(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """Per layer: the last forward's ``counts`` / ``mass`` and the accumulated ``usage_counts``
    / ``usage_mass`` (float32 [num_experts] each)."""
    out = {}
    for name, layer in _layers(model):
        stats = dict(layer.routing_stats)
        if hasattr(layer, "usage_counts"):
            stats["usage_counts"] = layer.usage_counts
            stats["usage_mass"] = layer.usage_mass
        if stats:
            out[name or "<root>"] = stats
    return out


def usage_buffer_names(model: nn.Module) -> list[str]:
    """The names in ``model.named_buffers()`` of every sparse layer's accumulated usage."""
    return [f"{name}.{buffer}" if name else buffer for name, layer in _layers(model)
            for buffer in ("usage_counts", "usage_mass") if buffer in layer._buffers]


def all_reduce_usage(model: nn.Module, group=None) -> None:
    """Sum every sparse layer's accumulated ``usage_counts`` / ``usage_mass`` over the
    processes of ``group`` (default: the world), so that each data-parallel replica holds the
    usage of the global batch. One collective for the whole model; a no-op when
    ``torch.distributed`` is not initialised. Call it once before reading the usage (and
    ``reset_usage`` after): calling it twice would count the other replicas twice.

    Under ``DistributedDataParallel``, call
    :func:`sparseffn.distributed.ddp_ignore_usage_buffers` before wrapping the model: by
    default DDP broadcasts rank 0's buffers before every forward, the usage included. Handed
    such a DDP module, this raises a RuntimeError rather than sum rank 0's usage once per
    rank."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    _check_usage_kept_per_rank(model, group)
    buffers = [buffer for _, layer in _layers(model)
               for buffer in (getattr(layer, "usage_counts", None), getattr(layer, "usage_mass", None))
               if buffer is not None]
    if not buffers:
        return
    flat = torch.cat([b.reshape(-1).to(torch.float64) for b in buffers])
    dist.all_reduce(flat, group=group)
    offset = 0
    with torch.no_grad():
        for b in buffers:
            b.copy_(flat[offset:offset + b.numel()].view_as(b))
            offset += b.numel()


def _check_usage_kept_per_rank(model: nn.Module, group) -> None:
    """Raise if ``model`` is a DDP module that broadcasts the usage buffers from rank 0."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    if not (isinstance(model, DistributedDataParallel) and model.broadcast_buffers
            and dist.get_world_size(group) > 1):
        return
    broadcast = [name for name in usage_buffer_names(model.module)
                 if name not in model.parameters_to_ignore]
    if broadcast:
        raise RuntimeError(
            f"all_reduce_usage: this DistributedDataParallel broadcasts rank 0's buffers before "
            f"every forward, the accumulated usage included ({broadcast[0]}, ...), so every rank "
            f"holds rank 0's usage and the sum would count it once per rank. Call "
            f"sparseffn.distributed.ddp_ignore_usage_buffers(model) before wrapping the model "
            f"(or build DistributedDataParallel with broadcast_buffers=False).")


def reset_usage(model: nn.Module) -> None:
    """Zero the accumulated expert usage of every sparse layer."""
    for _, layer in _layers(model):
        layer.reset_usage()


def sparse_grad_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of sparse layers built with ``sparse_grad=True`` (PKM values, PEER
    expert tables), whose gradients are sparse tensors. They need an optimiser that takes
    sparse gradients (``torch.optim.SparseAdam``, SGD); the other parameters keep theirs::

        sparse = sparseffn.sparse_grad_parameters(model)
        dense = sparseffn.dense_grad_parameters(model)
        optimizers = [torch.optim.Adam(dense), torch.optim.SparseAdam(sparse)]

    Clip with :func:`sparseffn.clip_grad_norm_` (``torch.nn.utils.clip_grad_norm_`` raises on
    sparse gradients)."""
    return [p for _, layer in _layers(model) for p in layer.sparse_grad_parameters()]


def dense_grad_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter of ``model`` not in :func:`sparse_grad_parameters` (in
    ``model.parameters()`` order): the ones an ordinary optimiser takes."""
    sparse = {id(p) for p in sparse_grad_parameters(model)}
    return [p for p in model.parameters() if id(p) not in sparse]
