"""Leftover swap run directories of dead processes: finding them, and the notice start-up logs.

A run killed harder than its clean-up can handle (SIGKILL, the OOM killer, a power
cut) leaves `<path>/<run id>/` with its preallocated swap files. A directory is a
leftover only when every `rank*.owner` in it names a process on this host that is gone
(files.owner_alive); anything else, a live run, one whose owner file is still being
written, another user's directory or one holding a file that is no owner record, is never
touched. `tierzero clean` (cli/clean.py) removes them.
"""

from __future__ import annotations

import logging
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

from tierzero.common.safe_files import is_ours
from tierzero.common.sizes import format_size
from tierzero.offload.disk.files import owner_alive, read_owner

log = logging.getLogger(__name__)

# Start-up names each leftover once per process: a second tier at the same path in the
# same job has nothing new to say.
_noticed: set[Path] = set()


@dataclass(frozen=True, slots=True)
class Leftover:
    """A run directory whose owner processes on this host are all gone."""

    dir: Path
    pid: int
    size_bytes: int


def find_leftovers(path: str | os.PathLike[str]) -> list[Leftover]:
    """Run directories under `path` whose owners all ran on this host and are all dead."""
    found = []
    host = socket.gethostname()
    for run_dir in sorted(Path(path).iterdir()):
        if not _own_directory(run_dir):
            continue
        owners = [read_owner(f) for f in sorted(run_dir.glob("rank*.owner"))]
        if not owners or any(o is None or o.get("host") != host or owner_alive(o) for o in owners):
            continue
        try:
            size = sum(f.lstat().st_blocks * 512 for f in run_dir.iterdir())
        except FileNotFoundError:
            continue  # another process is removing it right now
        found.append(Leftover(dir=run_dir, pid=int(owners[0]["pid"]), size_bytes=size))
    return found


def _own_directory(path: Path) -> bool:
    """Whether `path` is a directory of this user, not a symlink: another user's runs, and whatever
    they plant, are theirs to clean (see [Note: files in a shared directory])."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and is_ours(st)


def leftovers_notice(path: Path, leftovers: list[Leftover]) -> str:
    """The one line that start-up logs about `leftovers` under `path`."""
    size = format_size(sum(x.size_bytes for x in leftovers))
    return (
        f"tierzero: {count_dirs(len(leftovers), 'leftover swap run')} under {path} ({size}) "
        f"from dead processes: remove {'it' if len(leftovers) == 1 else 'them'} with `tierzero clean {path}`"
    )


def warn_leftovers(path: Path) -> None:
    """Logs one line (a warning) about leftovers under `path` not named before in this process."""
    fresh = [x for x in find_leftovers(path) if x.dir not in _noticed]
    if fresh:
        _noticed.update(x.dir for x in fresh)
        log.warning(leftovers_notice(path, fresh))


def count_dirs(count: int, words: str = "run") -> str:
    """`count` directories, in words: "1 run directory", "2 run directories"."""
    return f"{count} {words} director{'y' if count == 1 else 'ies'}"
