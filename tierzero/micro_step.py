"""One micro-step of the training loop, shared by `tierzero train` and `tierzero estimate`'s dry run."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["micro_step"]


def micro_step(engine: Any, x: torch.Tensor, y: torch.Tensor, *, is_hf: bool) -> torch.Tensor:
    """Forward, loss, backward and `engine.step()` on one micro-batch; the detached loss.

    `tierzero estimate` runs the same function on the meta device, so what it predicts
    is what this loop does.
    """
    if is_hf:
        logits = engine(input_ids=x).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    else:
        _, loss = engine(x, y)
    engine.backward(loss)
    engine.step()
    return loss.detach()
