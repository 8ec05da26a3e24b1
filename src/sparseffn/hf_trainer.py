"""Hugging Face's ``Trainer`` for a model with sparseffn layers: :class:`SparseTrainerMixin`,
and :class:`SparseTrainer` and :class:`SparseSeq2SeqTrainer` made with it. Import them from
``sparseffn.hf`` (this module imports ``transformers``)."""

from __future__ import annotations

import sys

import torch
import transformers

from . import hf
from .analysis.summary import collapse_warning, usage_health
from .auxiliary import (aux_loss, all_reduce_usage, reset_usage, routing_stats,
                        sparse_grad_parameters)
from .distributed import (all_reduce_sparse_grads, ddp_ignore_sparse_grad_parameters,
                          ddp_ignore_usage_buffers)
from .optim import MixedAdamW, clip_grad_norm_, param_groups

# The Trainer's ``optim`` names of PyTorch's AdamW, whose update MixedAdamW makes
ADAMW_OPTIMS = ("adamw_torch", "adamw_torch_fused")
# A layer's usage warns of a collapse only when its logging window routed this many slots
# per expert: under uniform routing an expert gets none with probability about e^-10 then
MIN_SLOTS_PER_EXPERT = 10


class SparseTrainerMixin:
    """What a Hugging Face ``Trainer`` needs for a model with sparseffn layers, for any
    ``Trainer`` subclass: put it first, ``class SparseSFTTrainer(SparseTrainerMixin,
    trl.SFTTrainer)``, as :class:`SparseTrainer` and :class:`SparseSeq2SeqTrainer` are made.
    Arguments as the ``Trainer``'s, and:

    - ``aux_loss=True``: :func:`sparseffn.hf.add_aux_loss` on the model, so the aux losses
      (balance, entropy) train with the loss the Trainer reads;
    - ``skip_padding=True``: :func:`sparseffn.hf.skip_padding` on the model, so padding takes
      no part in routing, capacities and the aux losses.

    (Both are hooks on the model, saved with it; a model built by ``model_init`` gets them
    too.) With the Trainer's AdamW (``optim`` ``"adamw_torch"`` or
    ``"adamw_torch_fused"``, the defaults) the optimiser is :class:`sparseffn.optim.MixedAdamW`
    over :func:`sparseffn.param_groups`:

    - parameters with sparse gradients (PKM/PEER tables built with ``sparse_grad=True``)
      train, where the Trainer's AdamW raises;
    - no weight decay on the per-expert and FFF leaf biases, which the Trainer's rule (by
      parameter name: "bias", norms) decays.

    Gradient clipping (``max_grad_norm``) and the gradient norm it logs take sparse
    gradients (:func:`sparseffn.clip_grad_norm_`), where PyTorch's raises. Another ``optim``,
    or ``optimizer_cls_and_kwargs``, is the Trainer's own, and a ValueError if the model has
    parameters with sparse gradients, as is FSDP or DeepSpeed with them; an optimiser passed
    in ``optimizers`` is used as given.

    Each training log (every ``logging_steps``) adds, over the steps since the last one:
    ``aux_loss`` (the mean of the forwards' aux losses, unweighted), and the usage of the
    least balanced layer, ``usage_entropy_min`` (normalised, 1 = uniform) and
    ``starved_fraction_max`` (the share of experts nearly unused), as
    :mod:`sparseffn.analysis` defines them. The usage statistics start again after each log
    (the window of ``sparseffn train``'s collapse monitor), and a warning is printed the first
    time a layer looks collapsed over a window that routed at least
    :data:`MIN_SLOTS_PER_EXPERT` slots per expert (fewer starve experts by chance).

    Over several processes (DDP, as ``torchrun`` or ``accelerate launch`` start it): DDP
    leaves the sparse-gradient tables alone (it cannot reduce sparse gradients); they start
    as rank 0's and their gradients are averaged by
    :func:`sparseffn.distributed.all_reduce_sparse_grads` at each optimiser step, before
    clipping. Each rank keeps its own usage statistics (DDP would overwrite them with rank
    0's; :func:`sparseffn.all_reduce_usage` sums them).
    """

    def __init__(self, *args, aux_loss: bool = True, skip_padding: bool = True,
                 **kwargs) -> None:
        self._sparseffn_hooks = (aux_loss, skip_padding)
        self._aux_sum, self._aux_forwards = torch.zeros(()), 0   # since the last log
        self._warned_of_collapse = False
        super().__init__(*args, **kwargs)
        if self.model is not None and self.model_init is None:   # (model_init's: below)
            self._prepare(self.model)

    def call_model_init(self, *args, **kwargs):
        return self._prepare(super().call_model_init(*args, **kwargs))

    def _prepare(self, model):
        """The hooks, and what DDP must leave alone: sparse tables (rank 0's everywhere, as
        DDP no longer broadcasts them) and usage statistics. Returns ``model``."""
        aux_loss, skip_padding = self._sparseffn_hooks
        if aux_loss:
            hf.add_aux_loss(model)
        if skip_padding:
            hf.skip_padding(model)
        ddp_ignore_usage_buffers(model)          # no effect in one process
        ddp_ignore_sparse_grad_parameters(model)
        if self.args.world_size > 1:
            with torch.no_grad():
                for table in sparse_grad_parameters(model):
                    torch.distributed.broadcast(table, src=0)
        return model

    def training_step(self, model, inputs, *args, **kwargs):
        loss = super().training_step(model, inputs, *args, **kwargs)
        if self.args.world_size > 1 and self.accelerator.sync_gradients:
            all_reduce_sparse_grads(self.model)     # the last micro-batch's backward: DDP's
        return loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        out = super().compute_loss(model, inputs, *args, **kwargs)
        if torch.is_grad_enabled():      # a training forward (evaluation's computes none)
            aux = aux_loss(self.model).detach().float()
            self._aux_sum = self._aux_sum.to(aux.device) + aux     # no host read here
            self._aux_forwards += 1
        return out

    def log(self, logs: dict, *args, **kwargs) -> None:
        if "loss" in logs:       # a training log (every process calls log)
            logs = {**logs, **self._routing_logs()}
        super().log(logs, *args, **kwargs)

    def _routing_logs(self) -> dict:
        """The aux loss and the least balanced layer's usage since the last log."""
        out = {}
        if self._aux_forwards:
            aux = self._aux_sum / self._aux_forwards
            if self.args.world_size > 1:
                aux = self.accelerator.reduce(aux, "mean")
            out["aux_loss"] = float(aux)
            self._aux_sum, self._aux_forwards = torch.zeros(()), 0
        if self.args.world_size > 1:
            all_reduce_usage(self.model)
        health = usage_health(self.model)
        # slots routed per expert in the window: with a few, uniform routing starves experts
        per_expert = {name: float(stats["usage_counts"].sum()) / stats["usage_counts"].numel()
                      for name, stats in routing_stats(self.model).items()
                      if "usage_counts" in stats}
        reset_usage(self.model)
        if health:
            out["usage_entropy_min"] = min(e for e, _ in health.values())
            out["starved_fraction_max"] = max(s for _, s in health.values())
            collapsed = [name for name in health if collapse_warning(*health[name])
                         and per_expert.get(name, 0.0) >= MIN_SLOTS_PER_EXPERT]
            if collapsed and not self._warned_of_collapse and self.is_world_process_zero():
                self._warned_of_collapse = True
                worst = collapsed[0]
                print(f"{type(self).__name__} step {self.state.global_step}: expert usage "
                      f"looks collapsed in {worst} ({collapse_warning(*health[worst])}); see "
                      f"usage_entropy_min / starved_fraction_max in the logs", file=sys.stderr)
        return out

    def create_optimizer(self, model=None):
        if self.optimizer is not None:
            return self.optimizer
        model = self.model if model is None else model
        sparse = sparse_grad_parameters(model)
        optim = getattr(self.args.optim, "value", self.args.optim)
        given = getattr(self, "optimizer_cls_and_kwargs", None)    # (not in older Trainers)
        if optim not in ADAMW_OPTIMS or given:
            if sparse:
                raise ValueError(f"{type(self).__name__}: the model has {len(sparse)} "
                                 f"parameters with sparse gradients (sparse_grad=True), which "
                                 f"only its AdamW (optim in {ADAMW_OPTIMS}) trains; got "
                                 f"optim={optim!r}"
                                 + (" and optimizer_cls_and_kwargs" if given else ""))
            return super().create_optimizer(model)
        if sparse and (getattr(self, "is_fsdp_enabled", False)
                       or getattr(self, "is_deepspeed_enabled", False)):
            raise ValueError(f"{type(self).__name__}: the model has {len(sparse)} parameters "
                             f"with sparse gradients (sparse_grad=True), which FSDP and "
                             f"DeepSpeed cannot shard or reduce; train them under DDP, or "
                             f"build the layers with sparse_grad=False")
        groups = param_groups(model, self.args.weight_decay)
        if sparse:
            groups.append({"params": sparse, "weight_decay": 0.0, "name": "sparse_grad"})
        self.optimizer = MixedAdamW(groups, lr=self.args.learning_rate,
                                    betas=(self.args.adam_beta1, self.args.adam_beta2),
                                    eps=self.args.adam_epsilon,
                                    fused=True if optim == "adamw_torch_fused" else None)
        return self.optimizer

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # the Trainer clips, and measures the norm it logs, with accelerator.clip_grad_norm_
        accelerator = self.accelerator
        clip = accelerator.clip_grad_norm_

        def clip_grad_norm(parameters, max_norm, norm_type=2, **kwargs):
            params = list(parameters)
            if not any(p.grad is not None and p.grad.is_sparse for p in params):
                return clip(params, max_norm, norm_type, **kwargs)
            accelerator.unscale_gradients()      # as accelerate's own does first (fp16)
            return clip_grad_norm_(params, max_norm, norm_type)

        accelerator.clip_grad_norm_ = clip_grad_norm


class SparseTrainer(SparseTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` with :class:`SparseTrainerMixin`: see it."""


class SparseSeq2SeqTrainer(SparseTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` (BART, T5, Whisper; ``predict_with_generate``) with
    :class:`SparseTrainerMixin`: see it."""
