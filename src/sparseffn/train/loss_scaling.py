"""Dynamic loss scaling for ``train.fp16``: float16 autocast needs it, bfloat16 does not
(bfloat16 has float32's exponent range; float16's smallest normal is 6.1e-5, below which
small gradients lose their bits or flush to zero)."""

from __future__ import annotations

import torch


#: The loss scale an fp16 run starts from (GradScaler's default; tests start higher to force
#: skipped steps).
INITIAL_LOSS_SCALE = 2.0 ** 16


class LossScaling:
    """Dynamic loss scaling for ``train.fp16`` (Micikevicius et al. 2018, "Mixed Precision
    Training", arXiv:1710.03740), by ``torch.amp.GradScaler``: the loss is multiplied by the
    scale before backward so that small float16 gradients do not flush to zero, the gradients
    are divided by it before clipping and the update, and a step whose gradients hold an inf
    or NaN changes no parameter (and no optimizer state) and halves the scale; after 2000
    steps without one the scale doubles. ``skipped`` counts the skipped steps of the run.

    Not ``enabled`` (float32 and bf16 runs), it is the plain step: backward, the optimizers'
    steps, nothing skipped, no host read."""

    def __init__(self, device: torch.device, enabled: bool = True,
                 state: dict | None = None) -> None:
        self.enabled = enabled
        self.scaler = torch.amp.GradScaler(device.type, init_scale=INITIAL_LOSS_SCALE,
                                           enabled=enabled)
        self.skipped = 0
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
        for opt in _with_gradients(optimizers):
            self.scaler.unscale_(opt)

    def step(self, optimizers: list[torch.optim.Optimizer]) -> bool:
        """Step the optimizers unless a gradient is not finite, and update the scale;
        whether the step was skipped (one host read: the new scale; with fused Adam
        GradScaler itself reads nothing)."""
        if not self.enabled:
            for opt in optimizers:
                opt.step()
            return False
        for opt in _with_gradients(optimizers):
            self.scaler.step(opt)
        self.scaler.update()
        scale, self.scale = self.scale, self.scaler.get_scale()
        skipped = self.scale < scale     # GradScaler backs off exactly when it skipped
        self.skipped += skipped
        return skipped

    def state(self) -> dict:
        return {"scaler": self.scaler.state_dict(), "skipped": self.skipped}


def _with_gradients(optimizers: list[torch.optim.Optimizer]) -> list[torch.optim.Optimizer]:
    """The optimizers with a gradient to apply (GradScaler refuses one with none)."""
    return [opt for opt in optimizers
            if any(p.grad is not None for group in opt.param_groups for p in group["params"])]
