"""Where a command writes: never onto, into or around what its run reads, and only where it can write.

[Note: an output never eats an input]
`consolidate --hf` and `train --export` replace the weight files of their directory and
plain `consolidate` replaces `model.safetensors`: pointed at the run's model.pretrained they
destroy the weights the run started from; pointed at the data, the tokenizer or the checkpoint
root they replace or mix with what the run reads. So before anything is built or written, the
output and each input are resolved (symlinks and `..` followed, as the writes would follow them)
and an output that is an input, lies inside one or holds one is refused in one line naming both
(`refuse_overlap`). An output that cannot be written is refused as early (`check_writable`): found
only after training, it would cost the run's weights when no checkpoint was saved.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

__all__ = ["check_writable", "input_root", "refuse_overlap"]

_GLOB_CHARS = frozenset("*?[")


def input_root(given: str | os.PathLike[str]) -> Path:
    """The path an input names, or for a glob such as `corpus/**/*.txt` the directory it searches (`corpus`)."""
    parts = Path(given).parts
    fixed = parts[: next((i for i, part in enumerate(parts) if _GLOB_CHARS & set(part)), len(parts))]
    return Path(*fixed) if fixed else Path(".")


def refuse_overlap(output: str | os.PathLike[str], inputs: Mapping[str, str | os.PathLike[str] | None], *, what: str) -> None:
    """ValueError when `output` is, lies inside or holds one of the named `inputs` (None: not set).

    `what` names the output as the user gave it, e.g. `--export` or `consolidate output`;
    `inputs` maps what each input is (`model.pretrained`) to its path or glob. See
    [Note: an output never eats an input].
    """
    out = Path(os.path.realpath(output))
    for label, given in inputs.items():
        if given is None:
            continue
        source = Path(os.path.realpath(input_root(given)))
        if out == source:
            relation = "is"
        elif source in out.parents:
            relation = "lies inside"
        elif out in source.parents:
            relation = "holds"
        else:
            continue
        raise ValueError(
            f"{what} {_shown(output, out)} {relation} the run's {label} {_shown(given, source)}: writing there would "
            "overwrite or delete what the run reads; name an output that neither is, holds nor lies inside it"
        )


def check_writable(path: str | os.PathLike[str], *, what: str, directory: bool) -> None:
    """OSError when `path` cannot be written: checked before a run, so a bad path costs seconds, not the run.

    A file (`directory=False`) is written in place: it must be a replaceable file, or new in an
    existing directory this user may write. A directory is created with its parents: it must be
    one this user may write, or its nearest existing ancestor must be.
    """
    target = Path(path)
    if directory:
        existing = next((p for p in (target, *target.parents) if p.exists()), Path("."))
        if not existing.is_dir():
            raise NotADirectoryError(f"{what} {target} cannot be created: {existing} is not a directory; name another path")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise PermissionError(f"{what} {target} cannot be written: {existing} is not writable by this user; name another path")
        return
    if target.is_dir():
        raise IsADirectoryError(f"{what} {target} is a directory: name a file")
    if target.exists():
        if not os.access(target, os.W_OK):
            raise PermissionError(f"{what} {target} cannot be replaced: it is not writable by this user; name another path")
        return
    parent = target.parent
    if not parent.is_dir():
        state = "is not a directory" if parent.exists() else "does not exist"
        raise FileNotFoundError(f"{what} {target} cannot be written: its directory {parent} {state}; create it or name another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{what} {target} cannot be written: its directory {parent} is not writable by this user; name another path")


def _shown(given: str | os.PathLike[str], real: Path) -> str:
    """The path as given, and where it leads when that is elsewhere (through `..` or a symlink)."""
    text = os.fspath(given)
    return text if Path(text).absolute() == real else f"{text} (which is {real})"
