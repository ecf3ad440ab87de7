"""One micro-step of the training loop, shared by `tierzero train` and `tierzero estimate`'s dry run."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["PARTS", "micro_step"]

PARTS = ("forward", "backward", "step")
"""The parts of a micro-step `micro_step`'s `mark` hears begin, in order."""


def micro_step(
    engine: Any, x: torch.Tensor, y: torch.Tensor, *, is_hf: bool, mark: Callable[[str], None] | None = None
) -> torch.Tensor:
    """Forward, loss, backward and `engine.step()` on one micro-batch; the detached loss.

    `tierzero estimate` runs the same function on the meta device, so what it predicts
    is what this loop does; `mark` hears each of its `PARTS` begin, which the estimate
    counts traffic by.
    """
    mark = mark or _unmarked
    mark("forward")
    if is_hf:
        logits = engine(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    else:
        _, loss = engine(x, y)
    mark("backward")
    engine.backward(loss)
    mark("step")
    engine.step()
    return loss.detach()


def _unmarked(phase: str) -> None:
    """The training loop's `mark`: nothing to hear."""
