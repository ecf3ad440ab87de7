"""The NVMe tier's files: the run directory, this rank's swap and owner files, and their clean-up.

Layout on disk: `<path>/<run id>/rank<r>.swap` (mode 0600) and `rank<r>.owner` (pid,
host, start time) in a run directory of mode 0700 that the ranks of one job share. The
files go away when their tier closes, at interpreter exit, when the tier is collected,
and on SIGINT, SIGTERM and SIGHUP; a run killed harder than that leaves a directory
that `tierzero clean` (clean.py) finds.

[Note: swap files no other user can redirect]
`tiers.nvme.path` may be a directory others can write to (/tmp, a shared scratch disk),
where a planted symlink could turn the tier's writes onto another file. So:
- A fresh run id carries 64 random bits and its directory must not exist yet: mkdir
  (0700) fails on anything planted there, symlinks included.
- A given run id (the ranks of one job share one) may name a directory another rank
  made first: it is opened with O_NOFOLLOW | O_DIRECTORY and must belong to this user
  with mode 0700, which no other user can arrange.
- Every file inside is created and reopened relative to that directory's descriptor,
  never by path, with O_NOFOLLOW, and a reopened swap file must be the very file
  created (same st_dev and st_ino), so renaming the directory away or swapping a file
  in it afterwards redirects nothing.
- Whatever other users leave under the path is only read, by the leftover scan, and only
  as [Note: files in a shared directory] (common/safe_files.py) allows: a run directory of
  another user is passed over, and an owner file that is a FIFO, a device, a symlink, too
  large, another user's or not a record is named once and makes its directory no leftover.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

from tierzero.common.safe_files import RefusedFile, load_json, say_once
from tierzero.common.sizes import format_size
from tierzero.common.slices import IO_ALIGNMENT, aligned_empty

log = logging.getLogger(__name__)


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


@dataclass(slots=True)
class RunFiles:
    """This rank's files: their names, the run directory's descriptor and what this record created.

    `remove` takes no lock and only unlinks what this record made, so a signal handler may
    call it at any moment, any number of times.
    """

    run_dir: Path
    rank: int
    dir_fd: int = -1
    """The run directory, opened without following links; files inside are opened relative to it."""
    made_dir: bool = False
    made: list[str] = field(default_factory=list)
    """Names created by this record: clean-up never touches another rank's or process's files."""
    swap_id: tuple[int, int] | None = None
    """(st_dev, st_ino) of the swap file created; a reopen must find the same."""
    pid: int = field(default_factory=os.getpid)
    """The creating process. A forked child (a DataLoader worker) inherits this record and
    the exit-time finalizer, and must leave its parent's files alone."""

    @property
    def swap(self) -> Path:
        return self.run_dir / f"rank{self.rank}.swap"

    @property
    def owner(self) -> Path:
        return self.run_dir / f"rank{self.rank}.owner"

    def remove(self) -> None:
        if os.getpid() != self.pid:
            return
        if self.dir_fd >= 0:
            for name in tuple(self.made):
                try:
                    os.unlink(name, dir_fd=self.dir_fd)
                except FileNotFoundError:
                    pass
        if self.made_dir or self.dir_fd >= 0:
            for path in (self.run_dir, _moved_to(self.dir_fd) or self.run_dir):
                with contextlib.suppress(OSError):  # only when the other ranks' files are gone too
                    os.rmdir(path)

    def close(self) -> None:
        """`remove`, then closes the directory's descriptor and leaves the signal registry. Idempotent."""
        self.remove()
        # -1 first: a handler that runs between the two lines never sees a closed (or reused) number.
        fd, self.dir_fd = self.dir_fd, -1
        if fd >= 0 and os.getpid() == self.pid:
            os.close(fd)
        _LIVE.pop(id(self), None)


# [Note: process-wide registry] A signal arrives with no tier in hand, so the handler
# reaches the live tiers' files through this mapping (and whatever else `on_signals`
# named: a checkpoint root's lock, a half-written checkpoint). It holds the small RunFiles
# records, never the tiers, so registering keeps no dropped tier (and its memory and
# threads) alive; a record leaves it only once its files are gone (`RunFiles.close`),
# so a signal that lands while a dropped tier's finalizer is still stopping its
# workers removes the files too. Interpreter exit needs no registry: each tier's
# weakref.finalize runs at exit. The set of warned paths makes the O_DIRECT warning
# appear once per process.
_LIVE: dict[int, Removable] = {}
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_INSTALL_LOCK = threading.Lock()
_previous: dict[int, Any] = {}
"""Signal -> the handler ours replaced and chains to; a signal is in here once ours is installed."""
_held = 0
_deferred: list[int] = []
_warned_buffered: set[Path] = set()


def _forget_in_child() -> None:
    """A forked child owns none of these files, and may have been forked from another thread
    while the main thread held signals back."""
    global _held
    _LIVE.clear()
    _held = 0
    _deferred.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def register(files: RunFiles) -> None:
    """Have SIGINT, SIGTERM and SIGHUP remove `files` until `files.close()`; installs the
    handlers once. Call it before the first file exists."""
    on_signals(files)


class Removable(Protocol):
    """What a signal removes: `remove()` may run at any moment, any number of times, in the main thread."""

    def remove(self) -> None: ...


def on_signals(what: Removable) -> None:
    """Have SIGINT, SIGTERM and SIGHUP call `what.remove()` (a checkpoint root's lock file, a
    half-written checkpoint) until `forget(what)`; see [Note: signal clean-up]."""
    _LIVE[id(what)] = what
    _install_handlers()


def forget(what: Removable) -> None:
    """`what` is gone or kept on purpose: signals no longer remove it."""
    _LIVE.pop(id(what), None)


def new_run_id() -> str:
    """A fresh run id: `tz-<date>-<time>-<pid>-<64 random bits>`. Ranks of one job share one
    (rank 0 makes it and broadcasts it); nobody else can guess it before it exists."""
    return f"tz-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{secrets.token_hex(8)}"


def create_swap(files: RunFiles, *, base: Path, size: int, fresh: bool) -> int:
    """Creates (`fresh`) or joins the run dir, then the owner file and the preallocated swap
    file; returns the swap file's descriptor. See [Note: swap files no other user can redirect].

    On failure removes what it created and nothing else: other ranks' files and whatever
    else lives under `base` are left as they were.
    """
    free = shutil.disk_usage(base).free
    if size > free:
        raise NvmeSpaceError(path=base, need=size, free=free)
    fd = -1
    try:
        _open_run_dir(files, fresh=fresh)
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(), "rank": files.rank}
        with os.fdopen(_create(files, files.owner.name), "w") as out:
            json.dump(owner, out)
        fd = _create(files, files.swap.name)
        st = os.fstat(fd)
        files.swap_id = (st.st_dev, st.st_ino)
        os.posix_fallocate(fd, 0, size)
    except BaseException as exc:
        if fd >= 0:
            os.close(fd)
        files.close()
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NvmeSpaceError(path=base, need=size, free=shutil.disk_usage(base).free) from exc
        raise
    return fd


def _moved_to(dir_fd: int) -> str | None:
    """Where the directory open at `dir_fd` is now, when the path still names it: a swap path renamed
    mid-run moves the run directory away from `RunFiles.run_dir`, and its descriptor follows it."""
    try:
        path, st = os.readlink(f"/proc/self/fd/{dir_fd}"), os.fstat(dir_fd)
        now = os.lstat(path)
    except OSError:
        return None
    return path if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino) else None


def _open_run_dir(files: RunFiles, *, fresh: bool) -> None:
    run_dir = files.run_dir
    with _signals_deferred():
        try:
            os.mkdir(run_dir, 0o700)
            files.made_dir = True
        except FileExistsError:
            if fresh:
                raise ValueError(
                    f"{run_dir} already exists though its run id was drawn at random just now: something planted it; "
                    f"remove it and make {run_dir.parent} writable by you alone"
                ) from None
    try:
        fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise ValueError(
            f"{run_dir} is a symlink or not a directory: remove it, or pick another run id or tiers.nvme.path"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid == os.geteuid() and files.made_dir:
            os.fchmod(fd, 0o700)  # mkdir's mode is filtered by the umask
            st = os.fstat(fd)
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != 0o700:
            raise ValueError(
                f"{run_dir} belongs to uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}, the NVMe tier "
                f"needs uid {os.geteuid()} and mode 0700: something else made it; remove it or pick another run id"
            )
    except BaseException:
        os.close(fd)
        raise
    files.dir_fd = fd  # only now: a directory refused is not this record's to remove


def _create(files: RunFiles, name: str) -> int:
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    with _signals_deferred():
        try:
            fd = os.open(name, flags, 0o600, dir_fd=files.dir_fd)
        except FileExistsError:
            raise ValueError(
                f"{files.run_dir / name} already exists: another process uses run id {files.run_dir.name}, pick another"
            ) from None
        files.made.append(name)
    os.fchmod(fd, 0o600)
    return fd


def reopen(files: RunFiles, flags: int) -> int:
    """A new descriptor of this rank's swap file: opened relative to the run directory with
    O_NOFOLLOW, and refused unless it is the file that `create_swap` made."""
    try:
        fd = os.open(files.swap.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=files.dir_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOENT):
            raise
        raise _replaced(files.swap) from None
    st = os.fstat(fd)
    if (st.st_dev, st.st_ino) != files.swap_id:
        os.close(fd)
        raise _replaced(files.swap)
    return fd


def _replaced(path: Path) -> ValueError:
    return ValueError(
        f"{path} is no longer the swap file the NVMe tier created (removed, or replaced by a symlink or another "
        f"file): nothing was written to it; stop whatever changes {path.parent} and start again"
    )


def reopen_direct(files: RunFiles, fd: int, *, base: Path) -> tuple[int, bool]:
    """Swaps `fd` for an O_DIRECT descriptor of the same file where the filesystem allows it (at
    open and at a first aligned read); otherwise keeps `fd` and warns once per `base`."""
    try:
        direct_fd = reopen(files, os.O_RDWR | os.O_DIRECT)
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


# [Note: signal clean-up]
# SIGINT, SIGTERM and SIGHUP each get one handler per process, from the main thread
# (only it may set handlers), installed before a tier makes its first file. It is never
# installed over an ignored signal (the process survives it and keeps its files) nor
# over a handler set from C (which cannot be chained). When it runs it unlinks the live
# tiers' files, then hands the signal on: to the Python handler it replaced, which is
# called; else to the default action, re-raised so that the process dies by the signal
# as before. SIGINT chained to a Python handler unlinks nothing: Python turns it into
# KeyboardInterrupt, which code may catch and carry on after, and an uncaught one ends
# the process through the exit-time finalizers, which remove the files. Unlinking only
# leaves open descriptors working, so a chained handler can still read the tier (to
# save a checkpoint); the space returns when the process ends. The handler runs in the
# main thread between bytecodes, so it may land between a system call that creates a
# file and the line that records it: `_signals_deferred` marks those pairs, and a
# signal arriving inside one is re-raised when the pair is done.


def _install_handlers() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    with _INSTALL_LOCK:
        for signum in _SIGNALS:
            if signum in _previous:
                continue
            previous = signal.getsignal(signum)
            if previous is signal.SIG_IGN or previous is None:
                continue
            _previous[signum] = previous
            signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame: Any) -> Any:
    if _held:
        _deferred.append(signum)
        return None
    previous = _previous[signum]
    if not (signum == signal.SIGINT and callable(previous)):
        for files in list(_LIVE.values()):
            files.remove()
    if callable(previous):
        return previous(signum, frame)
    signal.signal(signum, signal.SIG_DFL)
    # Raised in this thread, not the process: a process-wide signal may be delivered to
    # another thread after kill() returns, once the line below has put this handler back.
    signal.pthread_kill(threading.get_ident(), signum)
    signal.signal(signum, _on_signal)  # only reached where the signal is blocked
    return None


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """Holds back this module's signal handling in the main thread until the block ends."""
    global _held
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _held += 1
    try:
        yield
    finally:
        _held -= 1
        if not _held and _deferred:
            pending = list(dict.fromkeys(_deferred))
            _deferred.clear()
            for signum in pending:
                os.kill(os.getpid(), signum)


OWNER_LIMIT = 4096
"""Bytes an owner record may hold; its writer's is under 200."""
PID_MAX = 1 << 22
"""Linux's largest pid (`/proc/sys/kernel/pid_max` can be no higher)."""


def read_owner(path: Path) -> dict[str, Any] | None:
    """An owner record, or None while it is unreadable (its rank may be writing it right now) and
    when it is refused: not this user's small regular file, or not a record of a pid, host and
    start time (named once in the log). See [Note: files in a shared directory]."""
    try:
        record = load_json(path, limit=OWNER_LIMIT)
    except RefusedFile as exc:
        say_once(log, f"tierzero: ignoring {exc}")
        return None
    except (OSError, ValueError):
        return None
    if not _owner_record(record):
        say_once(log, f"tierzero: ignoring {path}: not an owner record (a pid, host and start time)")
        return None
    return record


def _owner_record(record: Any) -> bool:
    if not isinstance(record, dict):
        return False
    pid, started, host = record.get("pid"), record.get("started"), record.get("host")
    return (
        type(pid) is int and 0 < pid <= PID_MAX
        and type(started) in (int, float) and math.isfinite(started)
        and isinstance(host, str)
    )  # fmt: skip


def owner_alive(owner: dict[str, Any]) -> bool:
    """Whether the owner's process still runs; a pid reused by a process started later does not count.
    A pid psutil cannot look up counts as alive: what is not understood is never cleaned."""
    try:
        created = psutil.Process(int(owner["pid"])).create_time()
    except psutil.NoSuchProcess:
        return False
    except (psutil.AccessDenied, ValueError, OverflowError):
        return True
    return created <= float(owner["started"]) + 1.0


def free_space(path: str | None) -> int | None:
    """Free bytes on the disk that holds `path`; None without a path or where it cannot be read."""
    if path is None:
        return None
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None
