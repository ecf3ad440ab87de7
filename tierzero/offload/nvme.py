"""The NVMe tier: one preallocated swap file per rank, read and written in aligned chunks.

The whole capacity is allocated at start-up, so a full disk stops the job before
training. Where the files live and how they are cleaned up is in `nvme_files.py`.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import psutil
import torch

from tierzero.common.sizes import format_size
from tierzero.common.slices import IO_ALIGNMENT, Tier, align_up
from tierzero.config import NvmeTierConfig
from tierzero.offload.base import BounceStats, Region, TierCapacityError, TierStorage, TierTraits
from tierzero.offload.disk.backends import AiofilesBackend, ThreadBackend
from tierzero.offload.disk.busy import Busy, BusyClock
from tierzero.offload.disk.chunk_queue import (
    BouncePool,
    ChecksumTable,
    ChunkIO,
    ChunkQueue,
    Op,
    Request,
    checksum_granule,
)
from tierzero.offload.disk.files import (
    RunFiles,
    create_swap,
    new_run_id,
    register,
    reopen,
    reopen_direct,
)
from tierzero.offload.disk.leftovers import warn_leftovers

_RunFiles = RunFiles
"""The old name: tests/unit/test_bench.py patches `nvme._RunFiles.remove`."""

BACKENDS = ("pread", "aiofiles")


class ExtentAllocator:
    """First-fit allocation of `IO_ALIGNMENT`-aligned extents in `[0, capacity)`, coalescing on free.

    Not thread-safe on its own: the tier serialises calls under its lock.
    """

    def __init__(self, capacity: int) -> None:
        assert capacity % IO_ALIGNMENT == 0
        self.capacity = capacity
        self.used = 0
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []
        self._taken: dict[int, int] = {}

    def allocate(self, nbytes: int, *, label: str) -> int:
        # An empty slice still gets one block so that every region has its own offset.
        size = align_up(max(nbytes, 1))
        for i, (start, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, length - size)
                self._taken[start] = size
                self.used += size
                return start
        what = label
        if self.used + size <= self.capacity:
            largest = max((length for _, length in self._free), default=0)
            what = f"{label} (free space is fragmented: largest free extent {format_size(largest)})"
        raise TierCapacityError(Tier.NVME, need=size, used=self.used, capacity=self.capacity, what=what)

    def free(self, offset: int) -> None:
        size = self._taken.pop(offset)
        self.used -= size
        i = 0
        while i < len(self._free) and self._free[i][0] < offset:
            i += 1
        start, end = offset, offset + size
        if i < len(self._free) and self._free[i][0] == end:
            end += self._free.pop(i)[1]
        if i > 0 and sum(self._free[i - 1]) == start:
            start = self._free[i - 1][0]
            i -= 1
            del self._free[i]
        self._free.insert(i, (start, end - start))

    def extent_size(self, offset: int) -> int | None:
        return self._taken.get(offset)

    @property
    def free_extents(self) -> list[tuple[int, int]]:
        """(offset, length) of each free extent, in file order."""
        return list(self._free)


class NvmeTier(TierStorage):
    """Regions are extents of this rank's swap file; bytes move in `block_size` chunks,
    at most `queue_depth` of them in flight, on `threads` workers.

    `capacity` is rounded up to a multiple of 4096. `submit_read`/`submit_write` return
    futures and move all of a region or, with `start`, part of it (the swapper's chunked
    device<->NVMe path); the caller keeps the tensor untouched until its future is done,
    and orders a read after a pending write of the same region itself (the swapper
    does). With `verify`, the bytes written are checksummed by position in the region
    and checked when read back, whole or in part ([Note: checksums by region position]
    in nvme_io.py); bytes never written have nothing to check against.
    """

    tier = Tier.NVME
    traits = TierTraits(in_memory=False, direct_io=True, ranged=True, cached=True)

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        capacity: int,
        rank: int = 0,
        run_id: str | None = None,
        block_size: int = 8 << 20,
        queue_depth: int = 16,
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
        warn_leftovers(self.path)
        size = align_up(capacity)
        self._files = RunFiles(self.path / self.run_id, rank)
        # Before the first file exists, so that a signal during start-up removes what there is.
        register(self._files)
        fd = -1
        try:
            fd = create_swap(self._files, base=self.path, size=size, fresh=not run_id)
            fd, self.direct = reopen_direct(self._files, fd, base=self.path)
            self._lock = threading.Lock()
            self._allocator = ExtentAllocator(size)
            self._checksums: dict[int, ChecksumTable] = {}
            self._pool = BouncePool(block_size=block_size, limit=queue_depth)
            self._queue = ChunkQueue(queue_depth=queue_depth, block_size=block_size)
            self.busy = BusyClock()
            engine = self._start_engine(fd)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self._files.close()
            raise
        self._closed = False
        self._finalizer = weakref.finalize(self, _release, self._queue, engine, self._pool, fd, self._files)

    def _start_engine(self, fd: int) -> ThreadBackend | AiofilesBackend:
        io = ChunkIO(path=self._files.swap, direct=self.direct, pool=self._pool)
        done = self._queue.done
        engine: ThreadBackend | AiofilesBackend
        if self.backend == "pread":
            engine = ThreadBackend(fd=fd, io=io, threads=self.threads, done=done)
        else:
            files, handles = self._files, self.queue_depth
            engine = AiofilesBackend(
                path=files.swap, reopen=lambda flags: reopen(files, flags), io=io, threads=self.threads,
                handles=handles, done=done,
            )
        self._queue.launch = engine.launch
        return engine

    @classmethod
    def from_config(
        cls, nvme: NvmeTierConfig, *, rank: int, capacity: int | None = None, run_id: str | None = None
    ) -> NvmeTier:
        """Builds the tier from the `tiers.nvme` section; `capacity` overrides its `capacity`."""
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

    def bounce_stats(self) -> BounceStats:
        """Host memory of the bounce blocks, now and at peak, bounded by queue_depth x block_size."""
        return self._pool.stats()

    def observe_bounce(self, on_change: Callable[[int], None]) -> None:
        """Have `on_change(delta)` told of every bounce byte made or dropped, from now on."""
        self._pool.observe(on_change)

    def busy_now(self) -> Busy:
        return self.busy.now()

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
                self._checksums[offset] = ChecksumTable(checksum_granule(self.block_size))
        return Region(tier=Tier.NVME, nbytes=nbytes, label=label, offset=offset)

    def free(self, region: Region) -> None:
        with self._lock:
            assert region.offset is not None and self._allocator.extent_size(region.offset) is not None, (
                f"{region.label} freed twice or not from this tier"
            )
            self._allocator.free(region.offset)
            self._checksums.pop(region.offset, None)

    def read(self, region: Region, dst: torch.Tensor, *, start: int = 0) -> None:
        self.submit_read(region, dst, start=start).result()

    def write(self, region: Region, src: torch.Tensor, *, start: int = 0) -> None:
        self.submit_write(region, src, start=start).result()

    def submit_read(self, region: Region, dst: torch.Tensor, *, start: int = 0) -> Future[None]:
        """Starts reading `dst.numel()` bytes at `start` in the region (a multiple of 4096) into `dst`;
        the future ends when every chunk has landed."""
        return self._submit(Op.READ, region, dst, start)

    def submit_write(self, region: Region, src: torch.Tensor, *, start: int = 0) -> Future[None]:
        """Starts writing `src` at `start` in the region (a multiple of 4096). A write that ends at the
        region's end is zero-padded to 4096 on disk; one that ends before must end on a multiple of 4096."""
        return self._submit(Op.WRITE, region, src, start)

    def close(self) -> None:
        """Waits for chunks in flight, fails those not started, removes the files. Idempotent, and
        quiet after a failed construction (which removed what it had made before raising)."""
        if not hasattr(self, "_finalizer"):
            return
        with self._lock:
            self._closed = True
        self._finalizer()

    def __enter__(self) -> NvmeTier:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"NvmeTier({self._files.swap}, used={format_size(self.used)} of {format_size(self.capacity)}, "
            f"direct={self.direct}, backend={self.backend})"
        )

    def _submit(self, op: Op, region: Region, tensor: torch.Tensor, start: int) -> Future[None]:
        _check_range(op, region, tensor, start)
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
            offset=region.offset + start,
            start=start,
            tensor=tensor,
            view=memoryview(tensor.numpy()),
            future=future,
            remaining=0,
            checksums=checksums,
        )
        way = "read" if op is Op.READ else "write"
        self.busy.started(way, tensor.numel())
        try:
            self._queue.submit(request, tensor.numel())
        except BaseException:
            self.busy.ended(way)
            raise
        future.add_done_callback(lambda _: self.busy.ended(way))
        return future

    def _check_open(self, label: str) -> None:
        if self._closed:
            raise ValueError(f"cannot use {label}: the NVMe tier at {self._files.swap} is closed")


def _check_range(op: Op, region: Region, tensor: torch.Tensor, start: int) -> None:
    """A user error unless `tensor` is a flat byte tensor for `[start, start + numel)` of the region."""
    if (
        tensor.dtype != torch.uint8
        or tensor.dim() != 1
        or tensor.device.type != "cpu"
        or not tensor.is_contiguous()
        or (start == 0 and tensor.numel() > region.nbytes)
    ):
        raise ValueError(
            f"NVMe {op.value} of {region.label} needs a contiguous 1-D uint8 CPU tensor of {region.nbytes} bytes, "
            f"got {tensor.dtype} of shape {tuple(tensor.shape)} on {tensor.device}: "
            "pass a flat byte view (t.view(-1).view(torch.uint8))"
        )
    end = start + tensor.numel()
    if start < 0 or start % IO_ALIGNMENT or end > region.nbytes:
        raise ValueError(
            f"NVMe {op.value} of {region.label}: bytes [{start}, {end}) do not fit its {region.nbytes} bytes "
            f"at a multiple of {IO_ALIGNMENT}: pass start as a multiple of {IO_ALIGNMENT} and at most "
            f"region.nbytes - start bytes"
        )
    if op is Op.WRITE and end % IO_ALIGNMENT and end != region.nbytes:
        # The last block is written whole (zero-padded), which would clobber the bytes after `end`.
        raise ValueError(
            f"NVMe write of {region.label}: a partial write must end on a multiple of {IO_ALIGNMENT} "
            f"or at the region's end ({region.nbytes}), got bytes [{start}, {end}): write whole blocks"
        )


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
    # The bounce pool may hold queue_depth blocks (nvme_io.BouncePool); each is allocated
    # whole, so a block the machine cannot hold fails at the first unaligned transfer.
    bound, available = block_size * queue_depth, psutil.virtual_memory().available
    if bound > available:
        raise ValueError(
            f"tiers.nvme.block_size {format_size(block_size)} x tiers.nvme.queue_depth {queue_depth} = "
            f"{format_size(bound)} of bounce blocks, {format_size(available)} of memory available: "
            "lower tiers.nvme.block_size (8 MiB is the default) or tiers.nvme.queue_depth"
        )


def _release(
    queue: ChunkQueue, engine: ThreadBackend | AiofilesBackend, pool: BouncePool, fd: int, files: RunFiles
) -> None:
    if os.getpid() != files.pid:
        return  # a forked child: the workers and locks belong to the parent
    try:
        queue.close()
        engine.close()
        pool.close()
    finally:
        # Even when the workers cannot be stopped cleanly (interpreter exit), the files go.
        os.close(fd)
        files.close()


