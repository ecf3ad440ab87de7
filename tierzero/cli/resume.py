"""Where `tierzero train` resumes from, when it saves a checkpoint, and when a non-finite loss stops it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from tierzero.checkpoint import find_checkpoint
from tierzero.checkpoint.manifest import Manifest

__all__ = ["NonFiniteLoss", "NonFiniteLosses", "checkpoint_due", "no_checkpoint_under", "resume_from"]


def resume_from(engine: Any, root: Path, step: int | None, *, show: bool, out: TextIO) -> int:
    """Load the newest complete checkpoint under `root` (or step `step`'s), saying why newer ones were
    passed over; returns the optimizer step the run is at."""
    try:
        chosen = find_checkpoint(root, step=step, note=lambda line: out.write(f"{line}\n") if show else None)
    except FileNotFoundError as exc:
        if step is not None:
            raise FileNotFoundError(f"--resume {step}: {exc}") from None
        raise FileNotFoundError(no_checkpoint_under(root)) from None
    loaded = engine.load_checkpoint(chosen)
    at = _recount(engine, Manifest.read(loaded).config.get("gradient_accumulation_steps"))
    if show:
        out.write(f"resumed from {loaded} at step {at}\n")
    return at


def _recount(engine: Any, saved_accumulation: Any) -> int:
    """The loop steps (of train.steps) the checkpoint's run had done: its micro-steps over the
    gradient_accumulation_steps it ran with. A resume under another accumulation re-counts the
    micro-steps in the new one, so that the steps shown, the steps left and the saved steps' names
    (optimizer steps) agree, rather than the old micro-steps being divided by the new count."""
    accumulation = engine.cfg.gradient_accumulation_steps
    saved = saved_accumulation if type(saved_accumulation) is int and saved_accumulation >= 1 else accumulation
    at = engine.micro_steps // saved
    engine.micro_steps = at * accumulation
    return at


def no_checkpoint_under(root: Path) -> str:
    """The refusal of a `--resume` that finds nothing to resume from under `root` (there or not)."""
    return f"--resume found no complete checkpoint under {root}: run without --resume to start from step 0"


def checkpoint_due(cfg: Any, steps_done: int) -> bool:
    """After the last step, and every checkpoint.every steps, when checkpoint.dir is set."""
    every = cfg.checkpoint.every
    return cfg.checkpoint.dir is not None and (steps_done == cfg.train.steps or (every > 0 and steps_done % every == 0))


class NonFiniteLoss(ValueError):
    """The run stopped on a NaN or inf loss: one line, exit 2 (a ValueError, as every user-facing stop)."""


@dataclass(slots=True)
class NonFiniteLosses:
    """The steps in a row whose loss was NaN or inf: the run stops at `limit` (train.max_nonfinite),
    or at the last step when its loss is one, so that nothing is saved or exported from such a step.

    Only the loss counts: an fp16 step the loss scaler skipped for overflowed gradients has a finite loss.
    """

    limit: int
    in_a_row: int = 0

    def saves(self, loss: float, *, step: int, steps: int) -> bool:
        """Whether step `step` (from 1) of `steps` may be saved: True for a finite loss; NonFiniteLoss
        when this one is the limit's or the last step's; False for one the limit still tolerates."""
        if math.isfinite(loss):
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        if self.in_a_row < self.limit and step < steps:
            return False
        row = f" ({self.in_a_row} steps in a row)" if self.in_a_row > 1 else ""
        raise NonFiniteLoss(
            f"step {step}/{steps}: the loss is {loss}{row} (train.max_nonfinite {self.limit}): the run stops and saves "
            "nothing from this step; lower optimizer.lr, check the data, or raise train.max_nonfinite, then --resume "
            "from the last checkpoint"
        )
