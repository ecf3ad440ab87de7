"""The checkpoint root a run writes: checked before the first step, and locked for the run's life.

A directory that cannot take a checkpoint used to be found at the first save, after every
step had run. `probe_root` (each rank, before the engine is built) does what a save does,
on a probe: create the directory, a directory in it, a file in that, write, fsync, remove.
`claim_root` (collective, once the engine exists) takes the root's lock and checks that a
checkpoint of this run fits in the free space.

[Note: checkpoint root lock]
Two runs on one root destroy each other's work: one's pruning deletes the other's
checkpoints and its in-progress `.tmp-*` save. Rank 0 alone holds an exclusive `flock` on
`root/.lock` (an advisory lock: it keeps out tierzero runs, not other programs) from start-up
to exit; the kernel drops it when the process dies, however it dies. Only rank 0 takes it,
so the ranks of one job never wait for each other (flock locks are per open file: two ranks
on one host would conflict), and rank 0's refusal is agreed by every rank (agree.py).
The lock file names its holder (pid and host) for the refusal to quote. It is removed
while still locked, at release; a run that opened the file just before that finds, once it
holds the lock, that the name now points elsewhere (or nowhere), and opens it again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import socket
import warnings
from pathlib import Path

from tierzero.checkpoint.agree import RankFailure, all_gather_objects, on_every_rank
from tierzero.checkpoint.engine_state import checkpoint_nbytes
from tierzero.checkpoint.find import LATEST, TMP_PREFIX, refuse_used_root, run_checkpoints
from tierzero.checkpoint.format import DIR_MODE, create_file, make_private_dir
from tierzero.checkpoint.protocol import Checkpointable
from tierzero.common.safe_files import same_file
from tierzero.common.sizes import format_size
from tierzero.offload.disk.files import forget, on_signals

__all__ = ["LOCK_FILE", "CheckpointDirError", "RootLock", "claim_root", "failure_fix", "probe_root"]

LOCK_FILE = ".lock"
PROBE_PREFIX = ".probe-"
_PROBE_BYTES = 4096

#: errno -> what it means for a checkpoint directory, and what to do about it.
_CAUSES: dict[int, tuple[str, str]] = {
    errno.ENOSPC: ("no space left on the device", "free space or pick another checkpoint.dir"),
    errno.EDQUOT: ("disk quota exceeded", "free space within the quota or pick another checkpoint.dir"),
    errno.EROFS: ("the file system is read-only", "remount it read-write or pick another checkpoint.dir"),
    errno.EACCES: ("permission denied", "make it writable by this user or pick another checkpoint.dir"),
    errno.EPERM: ("operation not permitted", "make it writable by this user or pick another checkpoint.dir"),
    errno.ENOTDIR: ("a file stands where a directory is needed", "move that file or pick another checkpoint.dir"),
    errno.EEXIST: ("a file stands where a directory is needed", "move that file or pick another checkpoint.dir"),
    errno.EIO: ("an I/O error", "check the disk (dmesg) or pick another checkpoint.dir"),
}


class CheckpointDirError(OSError):
    """The checkpoint root cannot be written, has no room, or another run holds it: found before any step."""


def failure_fix(code: int | None) -> str:
    """What to do about a checkpoint directory that failed with `code` (an errno, or None)."""
    return _CAUSES.get(code or 0, ("", "check the path or pick another checkpoint.dir"))[1]


def _failed(root: Path, action: str, exc: OSError, *, blocker: Path | None = None) -> CheckpointDirError:
    cause, fix = _CAUSES.get(exc.errno or 0, (exc.strerror or type(exc).__name__, "check the path or pick another checkpoint.dir"))
    where = f" at {blocker}" if blocker is not None and blocker != root else ""
    error = CheckpointDirError(f"checkpoint.dir {root}: cannot {action} ({cause}{where}): {fix}")
    error.errno = exc.errno
    return error


def probe_root(root: Path) -> None:
    """Create `root` (0700) if needed and do on a probe what a save does; CheckpointDirError saying what failed."""
    blocker = _file_in_the_way(root)
    if blocker is not None:
        raise _failed(root, "create the directory", NotADirectoryError(errno.ENOTDIR, ""), blocker=blocker)
    try:
        if not root.is_dir():  # mkdir of an existing directory says EACCES, not EEXIST, where its parent is not ours
            root.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    except OSError as exc:
        raise _failed(root, "create the directory", exc) from None
    probe = root / f"{PROBE_PREFIX}{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
    action = "create a directory in it"
    try:
        make_private_dir(probe)
        action = "create a file in it"
        with create_file(probe / "probe") as f:
            action = "write to a file in it"
            f.write(b"\0" * _PROBE_BYTES)
            f.flush()
            action = "fsync a file in it"
            os.fsync(f.fileno())
        action = "remove a file from it"
        (probe / "probe").unlink()
        probe.rmdir()
    except OSError as exc:
        with contextlib.suppress(OSError):
            (probe / "probe").unlink()
        with contextlib.suppress(OSError):
            probe.rmdir()
        raise _failed(root, action, exc) from None


def _file_in_the_way(root: Path) -> Path | None:
    """The nearest of `root` and its parents that exists and is not a directory (mkdir says only ENOTDIR)."""
    for path in (root, *root.parents):
        try:
            if path.exists():
                return None if path.is_dir() else path
        except OSError:
            return None  # unreadable: mkdir will say why
    return None


class RootLock:
    """The run's hold on a checkpoint root (see [Note: checkpoint root lock]); `release()` is idempotent."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path, self._fd = path, fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    @classmethod
    def acquire(cls, root: Path) -> RootLock:
        """Lock `root` for this process, or raise CheckpointDirError naming the run that holds it."""
        path = root / LOCK_FILE
        for _ in range(16):
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as exc:
                raise _failed(root, "create its lock file", exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 256, 0).decode(errors="replace").strip() or "its pid not yet written"
                os.close(fd)
                raise CheckpointDirError(
                    f"checkpoint.dir {root} is in use by another run ({holder}): wait for it to end, or pick another "
                    "checkpoint.dir; two runs on one directory delete each other's checkpoints"
                ) from None
            except OSError as exc:
                os.close(fd)
                # A file system without locks (some network and FUSE mounts): run, but say what is not guarded.
                warnings.warn(f"checkpoint.dir {root} cannot be locked ({exc.strerror}): a second run on it would not be refused", stacklevel=2)
                return cls(path, None)
            if same_file(fd, path):
                os.ftruncate(fd, 0)
                os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
                lock = cls(path, fd)
                on_signals(lock)  # SIGTERM or SIGHUP ends the run without its close: the file goes anyway
                return lock
            os.close(fd)  # the holder removed the file between our open and our lock: open the new one
        raise CheckpointDirError(f"checkpoint.dir {root}: its lock file {path} keeps being replaced: is another program removing it?")

    def remove(self) -> None:
        """The lock file, unlinked if it is still this lock's (from a signal handler: the descriptor stays)."""
        fd = self._fd
        with contextlib.suppress(OSError):
            if fd is not None and same_file(fd, self.path):
                self.path.unlink()

    def release(self) -> None:
        forget(self)
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if same_file(fd, self.path):
                self.path.unlink()
        except OSError:
            pass  # the lock itself goes with the descriptor
        finally:
            os.close(fd)


def claim_root(engine: Checkpointable, root: Path, *, fresh: bool = False) -> RootLock:
    """Collective: rank 0 locks `root` and checks that one checkpoint of this run fits, and with
    `fresh` (a run that resumes nothing) that no run's checkpoints are there; every rank agrees.

    Returns the lock (held on rank 0 only) for the caller to release when the run ends.
    """
    comm = engine.comm
    need = sum(all_gather_objects(comm, checkpoint_nbytes(engine)))
    lock = RootLock(root / LOCK_FILE, None)

    def claim() -> None:
        nonlocal lock
        if comm.rank != 0:
            return
        lock = RootLock.acquire(root)  # first: a root in use says so, whatever it holds
        if fresh:
            refuse_used_root(root)
        stat = os.statvfs(root)
        free = stat.f_bavail * stat.f_frsize
        if free < need:
            raise CheckpointDirError(
                f"checkpoint.dir {root} has {format_size(free)} free, a checkpoint of this run takes about "
                f"{format_size(need)}: free space or pick another checkpoint.dir"
            )

    try:
        on_every_rank(comm, claim, fail=lambda failure: _agreed(failure, comm.world_size))
    except BaseException:
        lock.release()
        raise
    return lock


def _agreed(failure: RankFailure, world_size: int) -> CheckpointDirError:
    return CheckpointDirError(failure.message if world_size == 1 else str(failure))


def prune(root: Path, *, keep: int | None, current: Path, run_id: str) -> None:
    """Delete all but the newest `keep` checkpoints of the run `run_id`, and `.tmp-*` directories of saves that died."""
    for stale in root.glob(f"{TMP_PREFIX}*"):
        if stale.is_symlink():  # never followed: planted, or an old copy's link
            stale.unlink(missing_ok=True)
        elif stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    for stale in root.glob(f".{LATEST}.tmp-*"):  # a pointer's temp file left by a killed save (never followed)
        stale.unlink(missing_ok=True)
    if keep is None:
        return
    complete = run_checkpoints(root, run_id)
    for old in complete[: max(0, len(complete) - keep)]:
        if old != current:
            shutil.rmtree(old, ignore_errors=True)
