"""Which checkpoint a root holds: complete step directories, newest first, never one outside the root.

A step directory is complete exactly when it is a real directory named by its step and
holds a manifest (written last). The directories decide, not `latest` (which is for people
and tools): a save killed between its rename and the pointer's update has still written a
complete, newer checkpoint. A step directory that is a symbolic link is never followed:
one pointing out of the root would otherwise be loaded by every later `--resume` (and
never pruned). When the newest step directory is passed over for an older one, the
caller is told why, in one line.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tierzero.checkpoint.format import CheckpointError, read_json
from tierzero.checkpoint.manifest import FORMAT, MANIFEST, is_step_name
from tierzero.common.safe_files import say_once

__all__ = [
    "LATEST", "TMP_PREFIX", "CheckpointFallbackWarning", "find_checkpoint", "list_checkpoints", "refuse_used_root",
    "run_checkpoints", "run_of",
]  # fmt: skip

log = logging.getLogger(__name__)

LATEST = "latest"
TMP_PREFIX = ".tmp-"


class CheckpointFallbackWarning(UserWarning):
    """A newer step directory was passed over: the checkpoint loaded is an older one."""


@dataclass(frozen=True, slots=True)
class _Skipped:
    path: Path
    reason: str


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root` (step-named directories with a manifest), oldest first."""
    return _scan(Path(root))[0]


def run_checkpoints(root: str | Path, run_id: str) -> list[Path]:
    """The complete checkpoints under `root` that the run `run_id` wrote, oldest first: the only ones
    its saves count and prune. Any other step directory is named once in the log and left alone."""
    own = []
    for path in list_checkpoints(root):
        if run_of(path) == run_id:
            own.append(path)
        else:
            say_once(log, f"tierzero: {path} is not a checkpoint of this run: it is never pruned or counted by it")
    return own


def refuse_used_root(root: str | Path) -> None:
    """A fresh run's checkpoint root holds no run's checkpoints: a root belongs to one run, so that no
    run prunes, or resumes from, another's steps. ValueError naming `--resume` and a fresh directory."""
    used = list_checkpoints(root)
    if used:
        steps = ", ".join(p.name for p in used[-3:])
        raise CheckpointError(
            f"checkpoint.dir {root} already holds another run's checkpoints (steps {steps}): continue that run "
            "with --resume, or give this one a fresh checkpoint.dir"
        )


def run_of(directory: Path) -> str | None:
    """The run id `directory`'s manifest names; None when it names none or cannot be read."""
    try:
        engine = read_json(directory / MANIFEST).get("engine")
    except (OSError, CheckpointError):
        return None
    run = engine.get("run_id") if isinstance(engine, dict) else None
    return run if isinstance(run, str) else None


def _scan(root: Path) -> tuple[list[Path], list[_Skipped]]:
    if not root.is_dir():
        return [], []
    complete, skipped = [], []
    for path in root.iterdir():
        if is_step_name(path.name):
            reason = _incomplete(path)
            if reason is None:
                complete.append(path)
            else:
                skipped.append(_Skipped(path, reason))
    return sorted(complete, key=_step), sorted(skipped, key=lambda s: _step(s.path))


def _step(path: Path) -> int:
    return int(path.name)


def _incomplete(path: Path) -> str | None:
    """Why the step directory `path` is not a checkpoint to load, or None when it is one."""
    if path.is_symlink():
        return f"it is a symbolic link to {os.readlink(path)}, and step directories are never followed out of their root"
    if not path.is_dir():
        return "it is not a directory"
    manifest = path / MANIFEST
    if manifest.is_symlink() or not manifest.is_file():
        return f"it holds no {MANIFEST}: its save never finished, or the manifest was removed"
    try:
        written_by = read_json(manifest).get("format")
    except (OSError, CheckpointError):
        return None  # unreadable: loading it says why, rather than passing over it quietly
    if written_by != FORMAT:
        return f"its {MANIFEST} is not a tierzero checkpoint's (format {str(written_by)[:40]!r}): another program's directory, left alone"
    return None


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointFallbackWarning, stacklevel=3)


def find_checkpoint(path: str | Path, *, step: int | None = None, note: Callable[[str], None] | None = None) -> Path:
    """`path` itself when it is a checkpoint, else the newest complete one under it (or the one of `step`).

    Raises FileNotFoundError when there is none (listing the steps there are), CheckpointError
    for a step directory that cannot be loaded; `note` (default: a CheckpointFallbackWarning)
    hears, one line each, why newer step directories were passed over.
    """
    path = Path(path)
    if path.name.startswith(TMP_PREFIX):
        raise CheckpointError(f"{path} is a half-written checkpoint (a save that never finished): load a step directory instead")
    if is_step_name(path.name) and ((path / MANIFEST).exists() or _holds_rank_files(path)):
        reason = _incomplete(path)
        if reason is not None:
            raise CheckpointError(f"{path} cannot be loaded: {reason}; {_available(path.parent)}")
        return path
    if (path / MANIFEST).exists():
        return path
    complete, skipped = _scan(path)
    if step is not None:
        chosen = path / str(step)
        if chosen not in complete:
            why = next((f" ({s.reason})" for s in skipped if _step(s.path) == step), "")
            raise FileNotFoundError(f"no complete checkpoint of step {step} under {path}{why}; {_available(path)}")
        return chosen
    if not complete:
        why = f" ({skipped[-1].path.name}: {skipped[-1].reason})" if skipped else ""
        raise FileNotFoundError(
            f"no complete checkpoint under {path} (a step directory holding {MANIFEST}){why}: "
            "save one first, or pass the directory of an existing checkpoint"
        )
    newest = complete[-1]
    for passed in (s for s in skipped if _step(s.path) > _step(newest)):
        (note or _warn)(f"loading {newest}, not the newer {passed.path}: {passed.reason}")
    return newest


def _holds_rank_files(path: Path) -> bool:
    try:
        return any(p.name.startswith("rank-") for p in path.iterdir())
    except OSError:
        return False


def _available(root: Path) -> str:
    steps = [p.name for p in list_checkpoints(root)]
    return f"complete checkpoints under {root}: steps {', '.join(steps)}" if steps else f"there is no complete checkpoint under {root}"
