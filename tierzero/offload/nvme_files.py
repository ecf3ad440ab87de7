"""The NVMe tier's files: the run directory, this rank's swap and owner files, and their clean-up.

Layout on disk: `<path>/<run id>/rank<r>.swap` (mode 0600) and `rank<r>.owner` (pid,
host, start time) in a run directory of mode 0700 that the ranks of one job share. The
files go away when their tier closes, at interpreter exit, when the tier is collected,
and on SIGTERM; a run killed harder than that leaves a directory that `find_leftovers`
finds.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import threading
import time
import warnings
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from tierzero.sizes import format_size
from tierzero.slices import IO_ALIGNMENT, aligned_empty


class NvmeSpaceError(OSError):
    """The disk under the NVMe tier cannot hold its capacity."""

    def __init__(self, *, path: Path, need: int, free: int) -> None:
        self.path, self.need, self.free = path, need, free
        super().__init__(
            errno.ENOSPC,
            f"NVMe tier needs {format_size(need)} at {path}, {format_size(free)} free: "
            "lower tiers.nvme.capacity or pick another path",
        )

    def __str__(self) -> str:
        return self.strerror


@dataclass(frozen=True, slots=True)
class Leftover:
    """A run directory whose owner processes on this host are all gone."""

    dir: Path
    pid: int
    size_bytes: int


@dataclass(slots=True)
class RunFiles:
    """This rank's files. `remove` takes no lock, so the SIGTERM handler may call it at any moment."""

    run_dir: Path
    swap: Path
    owner: Path
    pid: int = field(default_factory=os.getpid)
    """The creating process. A forked child (a DataLoader worker) inherits this record and
    the exit-time finalizer, and must leave its parent's files alone."""

    def remove(self) -> None:
        if os.getpid() != self.pid:
            return
        for path in (self.swap, self.owner):
            try:
                path.unlink()
            except FileNotFoundError:
                pass
        try:
            self.run_dir.rmdir()  # only when the other ranks' files are gone too
        except OSError:
            pass


# [Note: process-wide registry] SIGTERM arrives with no tier in hand, so the handler
# reaches the live tiers' files through this mapping, keyed weakly by tier so that
# registering never keeps a dropped tier (and its memory and threads) alive.
# Interpreter exit needs no registry: each tier's weakref.finalize runs at exit. The
# sets of warned paths make each warning appear once per process, as a warning about
# a path is news only the first time.
_LIVE: weakref.WeakKeyDictionary[object, RunFiles] = weakref.WeakKeyDictionary()
_SIGTERM_LOCK = threading.Lock()
_sigterm_installed = False
_warned_buffered: set[Path] = set()
_warned_leftovers: set[Path] = set()
os.register_at_fork(after_in_child=_LIVE.clear)


def register(owner: object, files: RunFiles) -> None:
    """Have SIGTERM remove `files` while `owner` (the tier) lives; installs the handler once."""
    _LIVE[owner] = files
    _install_sigterm_handler()


def unregister(owner: object) -> None:
    _LIVE.pop(owner, None)


def new_run_id() -> str:
    """A fresh run id: `tz-<date>-<time>-<pid>-<random>`. Ranks of one job share one (rank 0
    makes it and broadcasts it); the random part keeps two tiers of one process apart."""
    return f"tz-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(2).hex()}"


def create_swap(base: Path, run_dir: Path, *, rank: int, size: int) -> tuple[RunFiles, int]:
    """Creates the run dir, the owner file and the preallocated swap file.

    On failure removes what it created and nothing else: other ranks' files and whatever
    else lives under `base` are left as they were.
    """
    free = shutil.disk_usage(base).free
    if size > free:
        raise NvmeSpaceError(path=base, need=size, free=free)
    files = RunFiles(run_dir, run_dir / f"rank{rank}.swap", run_dir / f"rank{rank}.owner")
    try:
        run_dir.mkdir(mode=0o700)
        os.chmod(run_dir, 0o700)  # mkdir's mode is filtered by the umask
    except FileExistsError:
        if not run_dir.is_dir():
            raise ValueError(f"{run_dir} exists and is not a directory: pick another run id") from None
    created: list[Path] = []
    fd = -1
    try:
        for path in (files.owner, files.swap):
            try:
                new_fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            except FileExistsError:
                raise ValueError(
                    f"{path} already exists: another process uses run id {run_dir.name}, pick another"
                ) from None
            created.append(path)
            os.fchmod(new_fd, 0o600)
            if path == files.owner:
                owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "rank": rank}
                with os.fdopen(new_fd, "w") as out:
                    json.dump(owner, out)
            else:
                fd = new_fd
        os.posix_fallocate(fd, 0, size)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        for path in created:
            path.unlink(missing_ok=True)
        try:
            run_dir.rmdir()
        except OSError:
            pass
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NvmeSpaceError(path=base, need=size, free=shutil.disk_usage(base).free) from exc
        raise
    return files, fd


def reopen_direct(path: Path, fd: int, *, base: Path) -> tuple[int, bool]:
    """Swaps `fd` for an O_DIRECT descriptor of `path` where the filesystem allows it (at
    open and at a first aligned read); otherwise keeps `fd` and warns once per `base`."""
    try:
        direct_fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
        try:
            os.preadv(direct_fd, [memoryview(aligned_empty(IO_ALIGNMENT).numpy())], 0)
        except OSError:
            os.close(direct_fd)
            raise
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        if base not in _warned_buffered:
            _warned_buffered.add(base)
            warnings.warn(
                f"{base} does not support O_DIRECT: the NVMe tier falls back to buffered I/O, "
                "which goes through the page cache; put tiers.nvme.path on a local ext4/xfs NVMe disk",
                stacklevel=3,
            )
        return fd, False
    os.close(fd)
    return direct_fd, True


def _install_sigterm_handler() -> None:
    """Once per process, from the main thread (only it may set handlers), and only where
    SIGTERM would otherwise kill the process or run a Python handler: where it is ignored,
    the process survives it and must keep its files."""
    global _sigterm_installed
    if threading.current_thread() is not threading.main_thread():
        return
    with _SIGTERM_LOCK:
        if _sigterm_installed:
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:
            return
        signal.signal(signal.SIGTERM, lambda signum, frame: _on_sigterm(previous))
        _sigterm_installed = True


def _on_sigterm(previous: Any) -> None:
    """Unlinks the live tiers' files, then hands SIGTERM back to the handler that was there.

    Only unlinks: open descriptors keep working on an unlinked file, so a previous Python
    handler that saves a checkpoint from the tier still can, and the disk space returns
    when the process ends. Under the default action the process dies by SIGTERM as before.
    """
    global _sigterm_installed
    for files in list(_LIVE.values()):
        files.remove()
    signal.signal(signal.SIGTERM, previous)
    _sigterm_installed = False
    os.kill(os.getpid(), signal.SIGTERM)


def find_leftovers(path: str | os.PathLike[str]) -> list[Leftover]:
    """Run directories under `path` whose owners all ran on this host and are all dead."""
    found = []
    host = socket.gethostname()
    for run_dir in sorted(p for p in Path(path).iterdir() if p.is_dir() and not p.is_symlink()):
        owners = [_read_owner(f) for f in sorted(run_dir.glob("rank*.owner"))]
        if not owners or any(o is None or o.get("host") != host or _alive(o) for o in owners):
            continue
        try:
            size = sum(f.lstat().st_blocks * 512 for f in run_dir.iterdir())
        except FileNotFoundError:
            continue  # another process is removing it right now
        found.append(Leftover(dir=run_dir, pid=int(owners[0]["pid"]), size_bytes=size))
    return found


def remove_leftovers(path: str | os.PathLike[str]) -> list[Leftover]:
    """Deletes what `find_leftovers` finds; returns it."""
    leftovers = find_leftovers(path)
    for leftover in leftovers:
        shutil.rmtree(leftover.dir, ignore_errors=True)
    return leftovers


def _read_owner(path: Path) -> dict[str, Any] | None:
    """The owner record, or None while it is unreadable (its rank may be writing it right now)."""
    try:
        record = json.loads(path.read_text())
        int(record["pid"]), float(record["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return record


def _alive(owner: dict[str, Any]) -> bool:
    """Whether the owner's process still runs; a pid reused by a process started later does not count."""
    try:
        created = psutil.Process(int(owner["pid"])).create_time()
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
    return created <= float(owner["started"]) + 1.0


def warn_leftovers(path: Path) -> None:
    for leftover in find_leftovers(path):
        if leftover.dir in _warned_leftovers:
            continue
        _warned_leftovers.add(leftover.dir)
        warnings.warn(
            f"leftover tierzero run directory {leftover.dir} from a dead run (pid {leftover.pid}), "
            f"{format_size(leftover.size_bytes)}: delete it to free the space",
            stacklevel=3,
        )
