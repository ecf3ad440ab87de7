"""Learning-rate schedules: the multiplier of the base learning rate before each optimizer step.

`lr_lambda(schedule)` returns what `torch.optim.lr_scheduler.LambdaLR` takes: step k of the
optimizer (0-based, counted after each step, as in the usual `optimizer.step();
scheduler.step()` loop) runs at `base_lr * f(k)`. The three shapes are transformers'
`get_constant_schedule_with_warmup`, `get_linear_schedule_with_warmup` and
`get_cosine_schedule_with_warmup` (half a cosine); `min_lr_ratio` lifts the decay's floor
as transformers' `get_cosine_with_min_lr_schedule_with_warmup` does (0 gives the plain ones).
The warm-up may start above 0 (`warmup_start_ratio`) and climb as ln(k+1) / ln(warmup_steps)
(`warmup_type` log); with the defaults (linear, from 0) every value is transformers' own.

[Note: DeepSpeed's counting] DeepSpeed's engine steps its scheduler after each optimizer
step, from `last_batch_iteration = -1`: the first optimizer step runs at the rate set when
the scheduler was built (its warm-up start; WarmupCosineLR's is 0), step k >= 1 at the rate
of iteration k-1. So under convention deepspeed the warm-up and WarmupDecayLR's linear
decay run one step late, while WarmupCosineLR's cosine counts its progress from k
(iteration - warmup + 1) and stops at its end instead of climbing again. With the base
rate being warmup_max_lr (WarmupLR, WarmupDecayLR) or the optimizer's (WarmupCosineLR),
the multipliers below are DeepSpeed's rates divided by it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from tierzero.config.optim import SchedulerConfig

__all__ = ["Schedule", "lr_lambda"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """The `scheduler` section's numbers, with the total resolved; the fields with defaults give
    transformers' warm-up (linear, from 0)."""

    type: str
    warmup_steps: int
    total_steps: int
    min_lr_ratio: float
    warmup_type: str = "linear"
    warmup_start_ratio: float = 0.0
    convention: str = "transformers"

    def __post_init__(self) -> None:
        if self.warmup_type == "log" and self.warmup_steps == 1:
            raise ValueError("a log warm-up needs warmup_steps 0 or at least 2 (ln 1 = 0), got 1")

    @classmethod
    def of(cls, section: SchedulerConfig, *, train_steps: int) -> Schedule:
        """The schedule `section` describes, its total_steps null meaning `train_steps`."""
        return cls(
            type=section.type,
            warmup_steps=section.warmup_steps,
            total_steps=section.total_steps or train_steps,
            min_lr_ratio=section.min_lr_ratio,
            warmup_type=section.warmup_type,
            warmup_start_ratio=section.warmup_start_ratio,
            convention=section.convention,
        )


def lr_lambda(schedule: Schedule) -> Callable[[int], float]:
    """The multiplier of optimizer step `k` (0 for the first step) under `schedule`."""
    warmup, total, floor = schedule.warmup_steps, schedule.total_steps, schedule.min_lr_ratio
    start, late = schedule.warmup_start_ratio, schedule.convention == "deepspeed"
    span = max(1, total - warmup)
    log = schedule.warmup_type == "log"
    # DeepSpeed's order of operations (the reciprocal first), so its log warm-up is matched bit for bit.
    inverse_log = 1.0 / math.log(warmup) if log and warmup > 1 else 0.0

    def warming(step: int) -> float:
        climbed = inverse_log * math.log(step + 1) if log else float(step) / float(max(1, warmup))
        return start + (1.0 - start) * climbed  # exactly `climbed` when the start is 0

    def floored(factor: float) -> float:
        return factor * (1.0 - floor) + floor

    def multiplier(step: int) -> float:
        # See [Note: DeepSpeed's counting] above.
        if late and step == 0 and schedule.type == "cosine":
            return 0.0
        clock = max(0, step - 1) if late else step
        if clock < warmup:
            return warming(clock)
        if schedule.type == "constant":
            return 1.0
        if schedule.type == "linear":
            return floored(max(0.0, (total - clock) / span))
        progress = ((step if late else clock) - warmup) / span
        if late:
            progress = min(1.0, progress)
        return floored(max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress))))

    return multiplier
