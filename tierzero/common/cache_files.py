"""Files of what tierzero measured on this machine, kept across runs under `$TIERZERO_CACHE_DIR`
(default `~/.cache/tierzero`): the disk's rates and a block's compute rate (placement/history.py)
and the linear kernels each layer shape runs fastest on (kernels.py). Each is one JSON mapping,
replaced whole; a file that cannot be read counts as empty, never as trusted.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from tierzero.common.safe_files import RefusedFile, create_new, load_json, say_once, scratch_path

__all__ = ["CACHE_LIMIT", "cache_path", "read_json", "write_json"]

CACHE_LIMIT = 16 << 20
"""Bytes a cache file may hold; the largest seen hold a few KiB."""

log = logging.getLogger(__name__)


def cache_path(name: str) -> Path:
    """`name` in `$TIERZERO_CACHE_DIR` (default `~/.cache/tierzero`)."""
    root = os.environ.get("TIERZERO_CACHE_DIR") or Path.home() / ".cache" / "tierzero"
    return Path(root) / name


def read_json(path: Path) -> dict[str, object]:
    """The mapping in `path`; empty when it is missing, is not one or nests too deep, and when it is
    refused, named once in the log: not a regular file of this user, or over `CACHE_LIMIT`."""
    try:
        data = load_json(path, limit=CACHE_LIMIT)
    except RefusedFile as exc:
        say_once(log, f"tierzero: ignoring the cache file {exc}: it counts as empty")
        return {}
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, object]) -> None:
    """Replace `path` whole: a reader sees the old file or the new one, never part of it. The new
    file is made under a name no one can guess and renamed over `path`, so nothing planted at
    either name is written through (see [Note: files in a shared directory])."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = scratch_path(path)
    fd = create_new(scratch)  # before the try: a name it could not create is not its to remove
    try:
        with os.fdopen(fd, "w") as out:
            out.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
        os.replace(scratch, path)
    except BaseException:
        scratch.unlink(missing_ok=True)
        raise
