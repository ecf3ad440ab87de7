"""Leftover swap run directories of dead processes: finding them, the start-up notice, `tierzero clean`.

A run killed harder than its clean-up can handle (SIGKILL, the OOM killer, a power
cut) leaves `<path>/<run id>/` with its preallocated swap files. A directory is a
leftover only when every `rank*.owner` in it names a process on this host that is gone
(nvme_files.owner_alive); anything else, a live run or one whose owner file is still
being written, is never touched.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from tierzero.offload.nvme_files import owner_alive, read_owner
from tierzero.sizes import format_size

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
    for run_dir in sorted(p for p in Path(path).iterdir() if p.is_dir() and not p.is_symlink()):
        owners = [read_owner(f) for f in sorted(run_dir.glob("rank*.owner"))]
        if not owners or any(o is None or o.get("host") != host or owner_alive(o) for o in owners):
            continue
        try:
            size = sum(f.lstat().st_blocks * 512 for f in run_dir.iterdir())
        except FileNotFoundError:
            continue  # another process is removing it right now
        found.append(Leftover(dir=run_dir, pid=int(owners[0]["pid"]), size_bytes=size))
    return found


def leftovers_notice(path: Path, leftovers: list[Leftover]) -> str:
    """The one line that start-up logs about `leftovers` under `path`."""
    size = format_size(sum(x.size_bytes for x in leftovers))
    return (
        f"tierzero: {_dirs(len(leftovers), 'leftover swap run')} under {path} ({size}) "
        f"from dead processes: remove {'it' if len(leftovers) == 1 else 'them'} with `tierzero clean {path}`"
    )


def warn_leftovers(path: Path) -> None:
    """Logs one line (a warning) about leftovers under `path` not named before in this process."""
    fresh = [x for x in find_leftovers(path) if x.dir not in _noticed]
    if fresh:
        _noticed.update(x.dir for x in fresh)
        log.warning(leftovers_notice(path, fresh))


def add_clean_command(commands: argparse._SubParsersAction) -> None:
    clean = commands.add_parser(
        "clean",
        help="remove the swap files that dead runs left under a tiers.nvme.path",
        description="Lists the run directories under PATH whose processes on this host are all dead "
        "(with their size and pid) and removes them. Directories of live runs are never touched.",
    )
    clean.add_argument("path", metavar="PATH", help="the tiers.nvme.path to clean")
    clean.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    clean.set_defaults(func=run_clean)


def run_clean(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    """Lists the leftovers, one line each, and removes them unless `--dry-run`; 1 if some could not be removed."""
    out = out or sys.stdout
    path = Path(args.path)
    if not path.is_dir():
        raise ValueError(f"{path} is not a directory: pass the tiers.nvme.path that holds the run directories")
    leftovers = find_leftovers(path)
    if not leftovers:
        out.write(f"no leftover swap run directories under {path}\n")
        return 0
    for leftover in leftovers:
        out.write(f"{leftover.dir}  {format_size(leftover.size_bytes)}  pid {leftover.pid}\n")
    total = format_size(sum(x.size_bytes for x in leftovers))
    if args.dry_run:
        out.write(f"would remove {_dirs(len(leftovers))} ({total}); run without --dry-run to remove them\n")
        return 0
    failed = []
    for leftover in leftovers:
        try:
            shutil.rmtree(leftover.dir)
        except OSError as exc:
            failed.append(f"could not remove {leftover.dir}: {exc.strerror or exc}")
    for line in failed:
        out.write(line + "\n")
    gone = [x for x in leftovers if not x.dir.exists()]
    out.write(f"removed {_dirs(len(gone))} ({format_size(sum(x.size_bytes for x in gone))})\n")
    return 1 if failed else 0


def _dirs(count: int, words: str = "run") -> str:
    return f"{count} {words} director{'y' if count == 1 else 'ies'}"
