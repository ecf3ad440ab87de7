"""`tierzero clean`: remove the swap run directories that dead processes left under a path."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from typing import TextIO

from tierzero.cli.commands import COMMANDS
from tierzero.common.sizes import format_size
from tierzero.offload.disk.leftovers import count_dirs, find_leftovers


def add_clean_command(commands: argparse._SubParsersAction) -> None:
    clean = commands.add_parser(
        "clean",
        help=COMMANDS["clean"].help,
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
        out.write(f"would remove {count_dirs(len(leftovers))} ({total}); run without --dry-run to remove them\n")
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
    out.write(f"removed {count_dirs(len(gone))} ({format_size(sum(x.size_bytes for x in gone))})\n")
    return 1 if failed else 0
