"""The NVMe tier: one preallocated swap file per rank, read and written in aligned chunks.

Layout on disk: `<path>/<run id>/rank<r>.swap` (mode 0600) and `rank<r>.owner` (pid,
host, start time) in a run directory of mode 0700 that the ranks of one job share. The
whole capacity is allocated at start-up, so a full disk stops the job before training.
The files go away on `close()`, at interpreter exit, when the tier is collected, and on
SIGTERM; a run killed harder than that leaves a directory that `find_leftovers` finds.
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
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch

from tierzero.offload.base import IO_ALIGNMENT, Region, Tier, TierStorage, align_up, aligned_empty
from tierzero.offload.nvme_io import (
    AiofilesBackend,
    BouncePool,
    ChunkIO,
    ChunkQueue,
    ExtentAllocator,
    Op,
    Request,
    ThreadBackend,
)
from tierzero.sizes import format_size

BACKENDS = ("pread", "aiofiles")


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
class _RunFiles:
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
# reaches the live tiers through this WeakSet; weak, so that registering never keeps a
# dropped tier (and its memory and threads) alive. Interpreter exit needs no registry:
# each tier's weakref.finalize runs at exit. The sets of warned paths make each warning
# appear once per process, as a warning about a path is news only the first time.
_LIVE: weakref.WeakSet[NvmeTier] = weakref.WeakSet()
_SIGTERM_LOCK = threading.Lock()
_sigterm_installed = False
_warned_buffered: set[Path] = set()
_warned_leftovers: set[Path] = set()
os.register_at_fork(after_in_child=_LIVE.clear)


class NvmeTier(TierStorage):
    """Regions are extents of this rank's swap file; bytes move in `block_size` chunks,
    at most `queue_depth` of them in flight, on `threads` workers.

    `capacity` is rounded up to a multiple of 4096. `submit_read`/`submit_write` return
    futures; the caller keeps the tensor untouched until its future is done, and orders a
    read after a pending write of the same region itself (the swapper does). With
    `verify`, every chunk written is checksummed and checked when read back; a region
    never written has nothing to check against and reads back unchecked.
    """

    tier = Tier.NVME

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int,
        rank: int = 0,
        run_id: str | None = None,
        block_size: int = 8 << 20,
        queue_depth: int = 8,
        threads: int = 8,
        verify: bool = False,
        backend: str = "pread",
    ) -> None:
        _check_settings(
            capacity=capacity, rank=rank, block_size=block_size, queue_depth=queue_depth, threads=threads,
            backend=backend,
        )
        self.path = Path(path)
        if not self.path.is_dir():
            raise ValueError(f"tiers.nvme.path {self.path} is not a directory: create it or pick another path")
        self.rank, self.block_size, self.queue_depth, self.threads = rank, block_size, queue_depth, threads
        self.backend, self.verify = backend, verify
        self.run_id = run_id or new_run_id()
        if "/" in self.run_id or self.run_id in (".", ".."):
            raise ValueError(f"run_id must be a plain directory name, got {self.run_id!r}")
        _warn_leftovers(self.path)
        size = align_up(capacity)
        self._files, fd = _create_swap(self.path, self.path / self.run_id, rank=rank, size=size)
        try:
            fd, self.direct = _reopen_direct(self._files.swap, fd, base=self.path)
            self._lock = threading.Lock()
            self._allocator = ExtentAllocator(size)
            self._checksums: dict[int, dict[int, int]] = {}
            self._pool = BouncePool(block_size=block_size, limit=queue_depth)
            self._queue = ChunkQueue(queue_depth=queue_depth, block_size=block_size)
            engine = self._start_engine(fd)
        except BaseException:
            os.close(fd)
            self._files.remove()
            raise
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, self._queue, engine, fd, self._files)
        _LIVE.add(self)
        _install_sigterm_handler()

    def _start_engine(self, fd: int) -> ThreadBackend | AiofilesBackend:
        io = ChunkIO(path=self._files.swap, direct=self.direct, pool=self._pool)
        done = self._queue.done
        engine: ThreadBackend | AiofilesBackend
        if self.backend == "pread":
            engine = ThreadBackend(fd=fd, io=io, threads=self.threads, done=done)
        else:
            swap, handles = self._files.swap, self.queue_depth
            engine = AiofilesBackend(path=swap, io=io, threads=self.threads, handles=handles, done=done)
        self._queue.launch = engine.launch
        return engine

    @classmethod
    def from_config(cls, cfg: Any, *, rank: int, capacity: int | None = None, run_id: str | None = None) -> NvmeTier:
        """Builds the tier from `cfg.tiers.nvme`; `capacity` overrides `tiers.nvme.capacity`."""
        nvme = cfg.tiers.nvme
        if nvme.path is None:
            raise ValueError(
                "state is offloaded to nvme but tiers.nvme.path is not set: set it to a directory on a local NVMe disk"
            )
        capacity = capacity if capacity is not None else nvme.capacity
        if capacity is None:
            raise ValueError(
                "tiers.nvme.capacity is not set: set it (e.g. '64GiB') to the swap space this rank may use"
            )
        return cls(
            nvme.path,
            capacity=capacity,
            rank=rank,
            run_id=run_id,
            block_size=nvme.block_size,
            queue_depth=nvme.queue_depth,
            threads=nvme.threads,
            verify=nvme.verify,
            backend=nvme.backend,
        )

    @property
    def capacity(self) -> int:
        return self._allocator.capacity

    @property
    def used(self) -> int:
        return self._allocator.used

    @property
    def file_path(self) -> Path:
        return self._files.swap

    @property
    def run_dir(self) -> Path:
        return self._files.run_dir

    @property
    def bounce_bytes(self) -> int:
        """Bytes of bounce blocks held now (at most queue_depth x block_size)."""
        return self._pool.bytes

    @property
    def bounce_peak_bytes(self) -> int:
        return self._pool.peak_bytes

    @property
    def inflight_peak(self) -> int:
        """Most chunks ever in flight at once; never above queue_depth."""
        return self._queue.inflight_peak

    def allocate(self, nbytes: int, *, label: str) -> Region:
        if nbytes < 0:
            raise ValueError(f"cannot allocate {nbytes} bytes for {label}: sizes are >= 0")
        with self._lock:
            self._check_open(label)
            offset = self._allocator.allocate(nbytes, label=label)
            if self.verify:
                self._checksums[offset] = {}
        return Region(tier=Tier.NVME, nbytes=nbytes, label=label, offset=offset)

    def free(self, region: Region) -> None:
        with self._lock:
            assert region.offset is not None and self._allocator.extent_size(region.offset) is not None, (
                f"{region.label} freed twice or not from this tier"
            )
            self._allocator.free(region.offset)
            self._checksums.pop(region.offset, None)

    def read(self, region: Region, dst: torch.Tensor) -> None:
        self.submit_read(region, dst).result()

    def write(self, region: Region, src: torch.Tensor) -> None:
        self.submit_write(region, src).result()

    def submit_read(self, region: Region, dst: torch.Tensor) -> Future[None]:
        """Starts reading the region into `dst`; the future ends when every chunk has landed."""
        return self._submit(Op.READ, region, dst)

    def submit_write(self, region: Region, src: torch.Tensor) -> Future[None]:
        """Starts writing `src` into the region (zero-padded to 4096 on disk)."""
        return self._submit(Op.WRITE, region, src)

    def close(self) -> None:
        """Waits for chunks in flight, fails those not started, removes the files. Idempotent."""
        with self._lock:
            self._closed = True
        self._finalizer()
        _LIVE.discard(self)

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NvmeTier({self._files.swap}, used={format_size(self.used)} of {format_size(self.capacity)}, "
            f"direct={self.direct}, backend={self.backend})"
        )

    def _submit(self, op: Op, region: Region, tensor: torch.Tensor) -> Future[None]:
        if (
            tensor.dtype != torch.uint8
            or tensor.dim() != 1
            or tensor.numel() != region.nbytes
            or tensor.device.type != "cpu"
            or not tensor.is_contiguous()
        ):
            raise ValueError(
                f"NVMe {op.value} of {region.label} needs a contiguous 1-D uint8 CPU tensor of {region.nbytes} bytes, "
                f"got {tensor.dtype} of shape {tuple(tensor.shape)} on {tensor.device}: "
                "pass a flat byte view (t.view(-1).view(torch.uint8))"
            )
        with self._lock:
            self._check_open(region.label)
            extent = None if region.offset is None else self._allocator.extent_size(region.offset)
            if region.tier is not Tier.NVME or extent is None or extent < region.nbytes:
                raise ValueError(
                    f"{region.label} is not a live region of {self._files.swap}: "
                    "it was freed or comes from another tier"
                )
            checksums = self._checksums.get(region.offset) if self.verify else None
        future: Future[None] = Future()
        request = Request(
            op=op,
            label=region.label,
            offset=region.offset,
            tensor=tensor,
            view=memoryview(tensor.numpy()),
            future=future,
            remaining=0,
            checksums=checksums,
        )
        self._queue.submit(request, region.nbytes)
        return future

    def _check_open(self, label: str) -> None:
        if self._closed:
            raise ValueError(f"cannot use {label}: the NVMe tier at {self._files.swap} is closed")


def new_run_id() -> str:
    """A fresh run id: `tz-<date>-<time>-<pid>-<random>`. Ranks of one job share one (rank 0
    makes it and broadcasts it); the random part keeps two tiers of one process apart."""
    return f"tz-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{os.urandom(2).hex()}"


def _check_settings(*, capacity: int, rank: int, block_size: int, queue_depth: int, threads: int, backend: str) -> None:
    if capacity <= 0:
        raise ValueError(f"tiers.nvme.capacity must be > 0 bytes, got {capacity}")
    if rank < 0:
        raise ValueError(f"rank must be >= 0, got {rank}")
    if block_size <= 0 or block_size % IO_ALIGNMENT:
        raise ValueError(f"tiers.nvme.block_size must be a positive multiple of {IO_ALIGNMENT}, got {block_size}")
    if queue_depth < 1 or threads < 1:
        raise ValueError(f"tiers.nvme.queue_depth and .threads must be >= 1, got {queue_depth} and {threads}")
    if backend not in BACKENDS:
        raise ValueError(f"tiers.nvme.backend must be one of {', '.join(BACKENDS)}, got {backend!r}")


def _create_swap(base: Path, run_dir: Path, *, rank: int, size: int) -> tuple[_RunFiles, int]:
    """Creates the run dir, the owner file and the preallocated swap file.

    On failure removes what it created and nothing else: other ranks' files and whatever
    else lives under `base` are left as they were.
    """
    free = shutil.disk_usage(base).free
    if size > free:
        raise NvmeSpaceError(path=base, need=size, free=free)
    files = _RunFiles(run_dir, run_dir / f"rank{rank}.swap", run_dir / f"rank{rank}.owner")
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


def _reopen_direct(path: Path, fd: int, *, base: Path) -> tuple[int, bool]:
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


def _release(queue: ChunkQueue, engine: ThreadBackend | AiofilesBackend, fd: int, files: _RunFiles) -> None:
    if os.getpid() != files.pid:
        return  # a forked child: the workers and locks belong to the parent
    try:
        queue.close()
        engine.close()
    finally:
        # Even when the workers cannot be stopped cleanly (interpreter exit), the files go.
        os.close(fd)
        files.remove()


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
    for tier in list(_LIVE):
        tier._files.remove()
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


def _warn_leftovers(path: Path) -> None:
    for leftover in find_leftovers(path):
        if leftover.dir in _warned_leftovers:
            continue
        _warned_leftovers.add(leftover.dir)
        warnings.warn(
            f"leftover tierzero run directory {leftover.dir} from a dead run (pid {leftover.pid}), "
            f"{format_size(leftover.size_bytes)}: delete it to free the space",
            stacklevel=3,
        )
