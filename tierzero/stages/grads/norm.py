"""The squares of a step's gradient slices, summed as each unit's gradient lands.

Clipping and fp16's overflow check need the norm of all gradients before the step.
Reading every gradient slice back from its tier for it (from NVMe, a full pass over the
gradients) would cost as much as the step's own gradient reads; instead each unit adds
its squares at the moment its summed slice is in hand anyway: right after its last
reduce-scatter lands (stages 2, 3) or its scatter is copied in (stage 1).

[Note: the norm in chunks]
In host memory a slice's squares are summed `NORM_CHUNK` elements at a time, each chunk's
dot product added to the last in slice order: a bf16 chunk is widened into one reused fp32
buffer while it is in cache, where `grads.float()` made a whole fp32 copy of every unit's
gradient (an allocation and a pass of 4 bytes an element: 22 ms of a 100M step on the
session-28 host). The landing of a fresh slice (`add_into` in grads/landing.py) sums each
chunk just after it writes it, the same chunks in the same order: the same bits as summing
the landed slice afterwards, one read of the gradient fewer. The widening and the landing's
`g + 0.0` run natively where the library is built (native/convert.py), with torch's bits. A device's slice is summed in
one dot, as before: its kernels pay per launch, not per cache miss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from tierzero.native.convert import widen_into

__all__ = ["NORM_CHUNK", "GradNorm", "SquareSum", "clip_coefficient", "norm_chunks", "square_sum"]

NORM_CHUNK = 1 << 20
"""Elements of a host slice summed at a time ([Note: the norm in chunks]): 4 MiB of fp32 scratch."""


@dataclass(slots=True)
class GradNorm:
    """This rank's running sum of squared gradients for the coming step, and the units in it."""

    enabled: bool = False
    """Set by the engine when a step needs the norm (clipping, fp16 overflow checks)."""
    _sum: torch.Tensor | None = None
    _units: set[str] = field(default_factory=set)

    def add(self, unit: str, grads: torch.Tensor) -> None:
        """Count the squares of `grads`, the unit's gradient slice for this step."""
        self.add_sum(unit, square_sum(grads))

    def add_sum(self, unit: str, squares: torch.Tensor) -> None:
        """Count the unit's squares already summed (`square_sum`'s, or a landing's `SquareSum`)."""
        self._sum = squares if self._sum is None else self._sum + squares
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


class SquareSum:
    """The sum of a host slice's squares, taken chunk by chunk in slice order ([Note: the norm in chunks])."""

    __slots__ = ("_buffer", "total")

    def __init__(self, dtype: torch.dtype, *, device: torch.device) -> None:
        self._buffer = None if dtype == torch.float32 else torch.empty(NORM_CHUNK, dtype=torch.float32, device=device)
        self.total = torch.zeros((), dtype=torch.float32, device=device)

    def add(self, chunk: torch.Tensor) -> None:
        """Add the squares of the slice's next chunk (at most `NORM_CHUNK` elements)."""
        wide = chunk if self._buffer is None else self._buffer[: chunk.numel()]
        if wide is not chunk and not widen_into(chunk, wide):
            wide.copy_(chunk)
        self.total = self.total + wide.dot(wide)


def norm_chunks(numel: int) -> list[tuple[int, int]]:
    """The (start, end) of each chunk a host slice of `numel` elements is summed in, in order."""
    return [(lo, min(lo + NORM_CHUNK, numel)) for lo in range(0, numel, NORM_CHUNK)]


def square_sum(grads: torch.Tensor) -> torch.Tensor:
    """The sum of `grads`' squares in fp32 (a 0-d tensor on its device): by chunks in host memory."""
    if grads.device.type != "cpu":
        g = grads.float()
        return g.dot(g)
    squares = SquareSum(grads.dtype, device=grads.device)
    for lo, hi in norm_chunks(grads.numel()):
        squares.add(grads[lo:hi])
    return squares.total
