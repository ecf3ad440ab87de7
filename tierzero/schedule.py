"""Learning-rate schedules: the multiplier of the base learning rate before each optimizer step.

`lr_lambda(schedule)` returns what `torch.optim.lr_scheduler.LambdaLR` takes: step k of the
optimizer (0-based, counted after each step, as in the usual `optimizer.step();
scheduler.step()` loop) runs at `base_lr * f(k)`. The three shapes are transformers'
`get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup` and
`get_cosine_schedule_with_warmup` (half a cosine); `min_lr_ratio` lifts the decay's floor
as transformers' `get_cosine_with_min_lr_schedule_with_warmup` does (0 gives the plain ones).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Schedule", "lr_lambda"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """The `scheduler` section's numbers, with the total resolved."""

    type: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float


def lr_lambda(schedule: Schedule) -> Callable[[int], float]:
    """The multiplier of optimizer step `k` (0 for the first step) under `schedule`."""
    warmup, total, floor = schedule.warmup_steps, schedule.total_steps, schedule.min_lr_ratio

    def decayed(step: int) -> float:
        progress = (step - warmup) / max(1, total - warmup)
        if schedule.type == "linear":
            factor = max(0.0, (total - step) / max(1, total - warmup))
        else:
            factor = max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return factor * (1.0 - floor) + floor

    def multiplier(step: int) -> float:
        if step < warmup:
            return float(step) / float(max(1, warmup))
        return 1.0 if schedule.type == "constant" else decayed(step)

    return multiplier
