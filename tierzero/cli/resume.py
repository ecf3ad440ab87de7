"""Where `tierzero train` resumes from, and when it saves a checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any, TextIO

from tierzero.checkpoint import find_checkpoint

__all__ = ["checkpoint_due", "no_checkpoint_under", "resume_from"]


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
    at = engine.micro_steps // engine.cfg.gradient_accumulation_steps
    if show:
        out.write(f"resumed from {loaded} at step {at}\n")
    return at


def no_checkpoint_under(root: Path) -> str:
    """The refusal of a `--resume` that finds nothing to resume from under `root` (there or not)."""
    return f"--resume found no complete checkpoint under {root}: run without --resume to start from step 0"


def checkpoint_due(cfg: Any, steps_done: int) -> bool:
    """After the last step, and every checkpoint.every steps, when checkpoint.dir is set."""
    every = cfg.checkpoint.every
    return cfg.checkpoint.dir is not None and (steps_done == cfg.train.steps or (every > 0 and steps_done % every == 0))
