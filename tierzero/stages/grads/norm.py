"""The squares of a step's gradient slices, summed as each unit's gradient lands.

Clipping and fp16's overflow check need the norm of all gradients before the step.
Reading every gradient slice back from its tier for it (from NVMe, a full pass over the
gradients) would cost as much as the step's own gradient reads; instead each unit adds
its squares at the moment its summed slice is in hand anyway: right after its last
reduce-scatter lands (stages 2, 3) or its scatter is copied in (stage 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["GradNorm", "clip_coefficient"]


@dataclass(slots=True)
class GradNorm:
    """This rank's running sum of squared gradients for the coming step, and the units in it."""

    enabled: bool = False
    """Set by the engine when a step needs the norm (clipping, fp16 overflow checks)."""
    _sum: torch.Tensor | None = None
    _units: set[str] = field(default_factory=set)

    def add(self, unit: str, grads: torch.Tensor) -> None:
        g = grads.float()
        sq = g.dot(g)
        self._sum = sq if self._sum is None else self._sum + sq
        self._units.add(unit)

    def counted(self, unit: str) -> bool:
        return unit in self._units

    def take(self, *, device: torch.device) -> torch.Tensor:
        """The sum so far (a 0-d fp32 tensor), and a fresh start for the next step."""
        total = torch.zeros((), dtype=torch.float32, device=device) if self._sum is None else self._sum
        self.reset()
        return total

    def reset(self) -> None:
        self._sum, self._units = None, set()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))
