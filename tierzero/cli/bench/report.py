"""How benchmark results leave the process: a text table, a PNG plot, JSON, a config snippet.

Nothing here measures; it formats what the benchmarks measured.
"""

from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import psutil
import torch
import yaml

_SIZE_UNITS = ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"))


@dataclass(frozen=True, slots=True, kw_only=True)
class PlotBar:
    """One bar of the plot: a sweep point's median, its spread, and fio beside it."""

    label: str
    direction: str
    gbps: float
    low: float
    high: float
    fio_gbps: float | None


def size_text(nbytes: int) -> str:
    """The exact size in the largest binary unit that divides it, as a config accepts it."""
    for unit, name in _SIZE_UNITS:
        if nbytes >= unit and nbytes % unit == 0:
            return f"{nbytes // unit}{name}"
    return str(nbytes)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table, columns right-aligned except the first."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        first, *rest = (str(c) for c in cells)
        return "  ".join([first.ljust(widths[0]), *(c.rjust(w) for c, w in zip(rest, widths[1:]))])

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])


def nvme_config_snippet(*, block_size: int, queue_depth: int, threads: int, backend: str) -> str:
    """The `tiers.nvme` settings as YAML, ready to paste into a tierzero config."""
    settings = {
        "block_size": size_text(block_size),
        "queue_depth": queue_depth,
        "threads": threads,
        "backend": backend,
    }
    return yaml.safe_dump({"tiers": {"nvme": settings}}, sort_keys=False)


def _mount_of(path: Path) -> tuple[str, str]:
    """(filesystem type, device) of the mount holding `path`: the longest matching mount point."""
    resolved, best = str(path.resolve()), ("", "", "")
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") or "/"
        inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best[0]):
            best = (mount, part.fstype, part.device)
    return best[1] or "unknown", best[2] or "unknown"


def machine_info(path: Path, *, fio: str | None) -> dict[str, Any]:
    """What the numbers depend on: CPUs, memory, kernel, the filesystem under `path`, versions."""
    fstype, device = _mount_of(path)
    return {
        "hostname": platform.node(),
        "cpus": os.cpu_count(),
        "memory_bytes": psutil.virtual_memory().total,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "path": str(path),
        "filesystem": fstype,
        "device": device,
        "fio": fio,
    }


def now_text() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=2) + "\n")


def write_plot(bars: Sequence[PlotBar], path: Path, *, title: str) -> None:
    """Horizontal bars per sweep point, read and write side by side, fio as a black tick."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directions = sorted({bar.direction for bar in bars})
    height = max(3.0, 0.3 * max(sum(b.direction == d for b in bars) for d in directions) + 1.5)
    fig, axes = plt.subplots(1, len(directions), figsize=(6 * len(directions), height), squeeze=False)
    for axis, direction in zip(axes[0], directions):
        mine = [bar for bar in bars if bar.direction == direction]
        ys = list(range(len(mine)))
        spread = [[b.gbps - b.low for b in mine], [b.high - b.gbps for b in mine]]
        axis.barh(ys, [b.gbps for b in mine], xerr=spread, color="tab:blue", label="tierzero (median)")
        fio = [(y, b.fio_gbps) for y, b in zip(ys, mine) if b.fio_gbps is not None]
        if fio:
            axis.scatter([v for _, v in fio], [y for y, _ in fio], marker="|", s=200, color="black", label="fio")
        axis.set_yticks(ys, [b.label for b in mine], fontsize=7)
        axis.set_xlabel("GB/s")
        axis.set_title(direction)
        axis.legend(loc="best", fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


class Judged(Protocol):
    """A benchmark's result that says whether it met its target (bench moments, zeropp)."""

    def format(self) -> str: ...

    def to_json(self) -> str: ...

    def met(self) -> bool: ...


def finish(result: Judged, json_path: str | None) -> int:
    """A judged benchmark's end: its table printed, its JSON written where asked; exit 0 when it met its target, else 1."""
    print(result.format())
    if json_path:
        Path(json_path).write_text(result.to_json() + "\n")
    return 0 if result.met() else 1
