"""Learning-rate schedules as pure functions of the step, so that a resumed run needs only
the step to continue them exactly.

- ``cosine`` (Csordás et al. 2023 App. A.4): linear warm-up over ``warmup_steps``, then cosine
decay from
  the peak to ``final_lr_ratio · lr`` (0 in the paper) at the last step.
- ``one_cycle`` (Chaunin & Mikhailovskiy §3.1; Smith & Topin's one-cycle policy as PyTorch's
  ``OneCycleLR`` defines it): cosine rise from ``lr / 25`` to ``lr`` over the first 30% of the
  steps, then cosine fall to ``lr / (25 · 10⁴)``. Momentum is not cycled.
- ``constant``: linear warm-up, then ``lr``.
"""

from __future__ import annotations

import math

SCHEDULES = ("cosine", "one_cycle", "constant")


def _cosine(start: float, end: float, fraction: float) -> float:
    return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * min(max(fraction, 0.0), 1.0)))


def lr_factor(schedule: str, step: int, total_steps: int, warmup_steps: int = 0,
              final_lr_ratio: float = 0.0, pct_start: float = 0.3, div_factor: float = 25.0,
              final_div_factor: float = 1e4) -> float:
    """The learning rate at ``step`` (0-based) as a fraction of the peak ``lr``."""
    if schedule == "one_cycle":
        # the peak is at step pct_start · total - 1 (a float), as in OneCycleLR
        peak = max(pct_start * total_steps - 1.0, 1e-9)
        low = 1.0 / div_factor
        if step <= peak:
            return _cosine(low, 1.0, step / peak)
        return _cosine(1.0, low / final_div_factor, (step - peak) / max(total_steps - 1 - peak, 1e-9))
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        span = max(1, total_steps - 1 - warmup_steps)
        return _cosine(1.0, final_lr_ratio, (step - warmup_steps) / span)
    raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
