"""The memory limit a cgroup sets on this process, v1 or v2, and how much of it is used.

The process's cgroup is named by /proc/self/cgroup: on v1 the line whose controllers
include `memory` (under `<root>/memory`), on v2 the `0::/path` line (under `<root>`). A
limit on any ancestor binds as well (Slurm and Kubernetes often limit the job or pod and
leave the task's own cgroup unlimited), so every cgroup from the process's own up to the
mount is read and the one with the least headroom is kept. A container that sees the
host's path for its cgroup (no cgroup namespace) finds its own cgroup at the mount.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import psutil

from tierzero.common.sizes import format_size

__all__ = ["V1_UNLIMITED", "CgroupMemory", "cgroup_memory", "host_headroom", "memory_cgroup_of"]

V1_UNLIMITED = 1 << 60
"""A v1 `memory.limit_in_bytes` at or above this means no limit: v1 writes "unlimited" as
the largest page-aligned 64-bit count (9223372036854771712 on x86-64), never as a word."""

_FIX = "set tiers.cpu.capacity to give the cpu tier's budget yourself"
_LIMIT_FILE = {1: "memory.limit_in_bytes", 2: "memory.max"}
_USAGE_FILE = {1: "memory.usage_in_bytes", 2: "memory.current"}


@dataclass(frozen=True, slots=True, kw_only=True)
class CgroupMemory:
    """The binding memory limit of one cgroup and what that cgroup uses now."""

    version: int
    """1 or 2."""
    limit: int
    usage: int
    """Bytes charged to the cgroup, page cache included (reclaimable, so headroom is a floor)."""
    limit_file: Path

    @property
    def headroom(self) -> int:
        """Bytes the process may still take before the cgroup's limit stops it."""
        return max(0, self.limit - self.usage)

    def describe(self) -> str:
        """E.g. 'cgroup v1 /sys/fs/cgroup/memory/job/memory.limit_in_bytes 12.0 GiB with 3.0 GiB used'."""
        return f"cgroup v{self.version} {self.limit_file} {format_size(self.limit)} with {format_size(self.usage)} used"


def cgroup_memory(*, cgroup_root: Path, proc_self_cgroup: Path) -> CgroupMemory | None:
    """The limit with the least headroom over the process's cgroup and its ancestors.

    None where nothing limits the process: no /proc/self/cgroup (not Linux), no memory
    controller, or no limit on any cgroup up to the mount. A file that cannot be read
    as a byte count raises ValueError naming the file.
    """
    located = memory_cgroup_of(proc_self_cgroup)
    if located is None:
        return None
    version, relative = located
    mount = cgroup_root / "memory" if version == 1 else cgroup_root
    parts = PurePosixPath(relative).relative_to("/").parts
    found = [_read_limit(version, d) for d in (mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1))]
    limits = [m for m in found if m is not None]
    return min(limits, key=lambda m: m.headroom, default=None)


def host_headroom(*, cgroup_root: Path = Path("/sys/fs/cgroup"), proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> int:
    """Host memory this process may still take: psutil's available memory, or the headroom under a
    cgroup limit where that is less (an unreadable limit counts as none: the figure is a guide)."""
    available = psutil.virtual_memory().available
    try:
        cgroup = cgroup_memory(cgroup_root=cgroup_root, proc_self_cgroup=proc_self_cgroup)
    except ValueError:
        return available
    return available if cgroup is None else min(available, cgroup.headroom)


def memory_cgroup_of(proc_self_cgroup: Path) -> tuple[int, str] | None:
    """The cgroup version holding the memory controller and the process's path in it ('/a/b');
    None where there is none. A line that is not 'id:controllers:/path' raises ValueError."""
    try:
        text = proc_self_cgroup.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{proc_self_cgroup}: cannot read it ({exc.strerror}); {_FIX}") from None
    unified = None
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3 or not fields[2].startswith("/"):
            raise ValueError(f"{proc_self_cgroup}: expected 'id:controllers:/path' lines, got {line!r}; {_FIX}")
        hierarchy, controllers, path = fields
        if "memory" in controllers.split(","):
            return 1, path
        if hierarchy == "0" and controllers == "":
            unified = path
    # Hybrid systems list a v2 line too, but its memory controller is on v1 when v1 has it.
    return None if unified is None else (2, unified)


def _read_limit(version: int, directory: Path) -> CgroupMemory | None:
    """One cgroup's limit and usage; None where it sets no limit or is not there."""
    limit_file = directory / _LIMIT_FILE[version]
    limit = _read_bytes(limit_file, version=version, missing_ok=True)
    if limit is None or (version == 1 and limit >= V1_UNLIMITED):
        return None
    usage = _read_bytes(directory / _USAGE_FILE[version], version=version, missing_ok=False)
    assert usage is not None, "a usage file never reads as no limit"
    return CgroupMemory(version=version, limit=limit, usage=usage, limit_file=limit_file)


def _read_bytes(path: Path, *, version: int, missing_ok: bool) -> int | None:
    """A byte count; None for v2's "max", and for a missing file where `missing_ok`."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        if missing_ok:
            return None
        raise ValueError(f"cgroup v{version} file {path} is missing beside its limit; {_FIX}") from None
    except OSError as exc:
        raise ValueError(f"cgroup v{version} file {path}: cannot read it ({exc.strerror}); {_FIX}") from None
    if version == 2 and text == "max" and path.name == _LIMIT_FILE[2]:
        return None
    if not (text.isascii() and text.isdigit()):
        expected = "'max' or a byte count" if path.name == _LIMIT_FILE[2] else "a byte count"
        raise ValueError(f"cgroup v{version} file {path}: expected {expected}, got {text[:40]!r}; {_FIX}")
    return int(text)
