"""The squares of a step's gradient slices, summed as each unit's gradient lands.

Clipping and fp16's overflow check need the norm of all gradients before the step.
Reading every gradient slice back from its tier for it (from NVMe, a full pass over the
gradients) would cost as much as the step's own gradient reads; instead each unit adds
its squares at the moment its summed slice is in hand anyway: right after its last
reduce-scatter lands (stages 2, 3) or its scatter is copied in (stage 1). A unit whose
gradient pieces are held for the step ([Note: held gradient pieces] in grads/held.py) is
counted when the norm is taken instead, every such unit's pieces in one native call
(`add_later`): the same pass over its gradient, without the bookkeeping of a call each.

A host slice's squares are summed in the order [Note: the squares' order] (native/squares.py)
writes down: exact squares in lanes, blocks that threads share, natively in one pass at memory speed where
the library is built. The landing of a fresh slice (`add_into` in grads/landing.py) sums each
gradient as it writes it (`Squares.land`), with the bits of summing the landed slice
afterwards, one read of the gradient fewer. A device's slice is summed in one dot: its kernels
pay per launch, not per cache miss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tierzero.native.squares import Squares

__all__ = ["GradNorm", "clip_coefficient", "square_sum"]


@dataclass(slots=True)
class GradNorm:
    """This rank's running sum of squared gradients for the coming step, and the units in it."""

    enabled: bool = False
    """Set by the engine when a step needs the norm (clipping, fp16 overflow checks)."""
    _parts: list[torch.Tensor | Squares] = field(default_factory=list)
    """Each unit's sum in the order the units came: a 0-d tensor, or the `Squares` of pieces counted at `take`."""
    _later: list[tuple[Squares, Sequence[tuple[int, torch.Tensor]]]] = field(default_factory=list)
    _units: set[str] = field(default_factory=set)

    def add(self, unit: str, grads: torch.Tensor) -> None:
        """Count the squares of `grads`, the unit's gradient slice for this step."""
        self.add_sum(unit, square_sum(grads))

    def add_sum(self, unit: str, squares: torch.Tensor) -> None:
        """Count the unit's squares already summed (`square_sum`'s, or a landing's `Squares.total`)."""
        self._parts.append(squares)
        self._units.add(unit)

    def add_later(self, unit: str, pieces: Sequence[tuple[int, torch.Tensor]]) -> None:
        """Count the squares of the unit's held pieces ((offset, host tensor) in the slice's order, left
        unchanged until then) when the sum is taken: every held unit's in one native call, where a call
        each in backward cost 0.1-0.15 ms a unit beside its pass (bench step-host at 100M, session 39).
        The sum is the same: each unit's is its own, added in the order the units came."""
        squares = Squares()
        self._later.append((squares, pieces))
        self._parts.append(squares)
        self._units.add(unit)

    def counted(self, unit: str) -> bool:
        return unit in self._units

    def take(self, *, device: torch.device) -> torch.Tensor:
        """The sum so far (a 0-d fp32 tensor), and a fresh start for the next step."""
        if self._later:
            Squares.add_many(self._later)
        total = None
        for part in self._parts:
            value = part.total if isinstance(part, Squares) else part
            total = value if total is None else total + value
        self.reset()
        return torch.zeros((), dtype=torch.float32, device=device) if total is None else total

    def reset(self) -> None:
        self._parts, self._later, self._units = [], [], set()


def clip_coefficient(total_norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), at most 1."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def square_sum(grads: torch.Tensor) -> torch.Tensor:
    """The sum of `grads`' squares in fp32 (a 0-d tensor on its device): in the squares' order in host memory."""
    if grads.device.type != "cpu":
        g = grads.float()
        return g.dot(g)
    squares = Squares()
    squares.add(grads.reshape(-1), 0)
    return squares.total
