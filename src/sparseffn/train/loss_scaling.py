"""Dynamic loss scaling for ``train.fp16``: float16 autocast needs it, bfloat16 does not
(bfloat16 has float32's exponent range; float16's smallest normal is 6.1e-5, below which
small gradients lose their bits or flush to zero)."""

from __future__ import annotations

from typing import Callable

import torch

from .step_losses import host_values


#: The loss scale an fp16 run starts from (GradScaler's default; tests start higher to force
#: skipped steps).
INITIAL_LOSS_SCALE = 2.0 ** 16


class LossScaling:
    """Dynamic loss scaling for ``train.fp16`` (Micikevicius et al. 2018, "Mixed Precision
    Training", arXiv:1710.03740), by ``torch.amp.GradScaler``: the loss is multiplied by the
    scale before backward so that small float16 gradients do not flush to zero, the gradients
    are divided by it before clipping and the update, and a step whose gradients hold an inf
    or NaN changes no parameter (and no optimizer state) and halves the scale; after 2000
    steps without one the scale doubles.

    The scale and the count of skipped steps stay on the device: :meth:`settle` reads them
    (one host read) into ``scale`` and ``skipped`` (the run's skipped steps), which hold the
    values of the last settle; :meth:`state` settles first.

    Not ``enabled`` (float32 and bf16 runs), it is the plain step: backward, the optimizers'
    steps, nothing skipped, no host read.

    ``agree``: with experts sharded across ranks, each rank checks only its own experts'
    gradients, so a step could overflow on one rank and not on another. ``agree(flag)`` takes
    this rank's overflow flag (a float tensor of one element on the device, 0 or 1) and
    leaves the maximum over the ranks in it (an all-reduce); a step is then skipped, and the
    scale halved, on every rank or on none. Such a step skips every optimizer's update, where
    one process skips only the optimizers whose gradients overflowed."""

    def __init__(self, device: torch.device, enabled: bool = True,
                 state: dict | None = None,
                 agree: Callable[[torch.Tensor], None] | None = None) -> None:
        self.enabled = enabled
        self._agree = agree
        self._device = device
        self.scaler = torch.amp.GradScaler(device.type, init_scale=INITIAL_LOSS_SCALE,
                                           enabled=enabled)
        self.skipped = 0
        self._unread: torch.Tensor | None = None   # int32 []: steps skipped since the settle
        if state is not None and enabled:
            self.scaler.load_state_dict(state["scaler"])
            self.skipped = state["skipped"]
        self.scale = self.scaler.get_scale()

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()

    def unscale(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Divide the gradients by the scale (before clipping reads their norm)."""
        if not self.enabled:
            return
        unscaled = _with_gradients(optimizers)
        for opt in unscaled:
            self.scaler.unscale_(opt)
        if self._agree is not None:
            self._agree_on_overflow(unscaled)

    def _agree_on_overflow(self, unscaled: list[torch.optim.Optimizer]) -> None:
        """Set every inf check GradScaler recorded for ``unscaled`` to whether any of them,
        on any rank, found an inf or NaN (on the device: no host read)."""
        flags = [flag for opt in unscaled for flag in
                 self.scaler._per_optimizer_states[id(opt)]["found_inf_per_device"].values()]
        found = (torch.stack([flag.reshape(()).float() for flag in flags]).amax() if flags
                 else torch.zeros((), device=self._device))
        self._agree(found)
        for flag in flags:
            flag.copy_(found)

    def step(self, optimizers: list[torch.optim.Optimizer]) -> None:
        """Step the optimizers unless a gradient is not finite, and update the scale; a
        skipped step is counted on the device (with fused Adam nothing here reads the
        device; a non-fused optimizer's step reads GradScaler's inf check)."""
        if not self.enabled:
            for opt in optimizers:
                opt.step()
            return
        for opt in _with_gradients(optimizers):
            self.scaler.step(opt)
        scale = self.scaler._get_scale_async()   # the tensor update() changes in place
        before = scale.clone()
        self.scaler.update()
        skipped = (scale < before).int()         # GradScaler backs off exactly when it skipped
        self._unread = skipped if self._unread is None else self._unread + skipped

    def settle(self) -> None:
        """Read the scale and the steps skipped since the last settle into ``scale`` and
        ``skipped`` (one host read; none if no step ran since)."""
        if self._unread is None:
            return
        scale, skipped = host_values([self.scaler._get_scale_async(), self._unread])
        self.scale, self.skipped, self._unread = scale, self.skipped + int(skipped), None

    def state(self) -> dict:
        self.settle()
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}


def _with_gradients(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers with a gradient to apply (GradScaler refuses one with none)."""
    return [opt for opt in optimizers
            if any(p.grad is not None for group in opt.param_groups for p in group["params"])]
