"""Files of what tierzero measured on this machine, kept across runs under `$TIERZERO_CACHE_DIR`
(default `~/.cache/tierzero`): the disk's rates and a block's compute rate (placement/history.py)
and the linear kernels each layer shape runs fastest on (kernels.py). Each is one JSON mapping,
replaced whole; a file that cannot be read counts as empty, never as trusted.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["cache_path", "read_json", "write_json"]


def cache_path(name: str) -> Path:
    """`name` in `$TIERZERO_CACHE_DIR` (default `~/.cache/tierzero`)."""
    root = os.environ.get("TIERZERO_CACHE_DIR") or Path.home() / ".cache" / "tierzero"
    return Path(root) / name


def read_json(path: Path) -> dict[str, object]:
    """The mapping in `path`; empty when it is missing or is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_json(path: Path, data: dict[str, object]) -> None:
    """Replace `path` whole: a reader sees the old file or the new one, never part of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_suffix(f".{os.getpid()}.tmp")
    scratch.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    os.replace(scratch, path)
