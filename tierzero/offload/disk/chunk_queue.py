"""The mechanism under the NVMe tier: the chunked, bounded I/O queue, its bounce blocks and checksums.

A request (all or part of a region, read or written) is cut into `block_size` chunks. Chunks from all
requests wait in one FIFO; at most `queue_depth` of them are in flight at once, each run
by a worker of a backend (nvme_backends.py). A chunk
goes straight to or from the caller's tensor when direct I/O allows it, else through a
bounce buffer from a pool that never holds more than `queue_depth` buffers.
"""

from __future__ import annotations

import enum
import math
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import torch
from xxhash import xxh3_64_intdigest

from tierzero.common.slices import IO_ALIGNMENT, align_up, aligned_empty
from tierzero.offload.base import BounceStats, ChecksumError

# XXH3-64: 9.8 GiB/s on one thread of the Zen 1 dev VM against 6.1 for CRC-32C, 18.9 against
# 11.9 on two: both drop the GIL on large buffers, so the I/O threads checksum side by side.
# Checksums live only in memory, so the function never has to match across runs.
checksum = xxh3_64_intdigest

_ZEROS = memoryview(bytes(IO_ALIGNMENT))

#: The largest span one checksum covers; see [Note: checksums by region position].
CHECKSUM_SPAN = 1 << 20


class BouncePool:
    """Aligned staging blocks for chunks that cannot move straight to or from the caller's tensor.

    Two sizes: one `IO_ALIGNMENT` block for the partial tail of an aligned tensor, one
    `block_size` block for a chunk of an unaligned tensor. Each in-flight chunk holds at
    most one block, so with at most `limit` chunks in flight the pool keeps at most
    `limit` blocks: when it must grow past that, a free block of the other size is dropped.
    An observer (`observe`) hears of every byte made or dropped, for the store's accounting.
    """

    def __init__(self, *, block_size: int, limit: int) -> None:
        self._block_size, self._limit = block_size, limit
        self._idle: list[torch.Tensor] = []
        self._count = 0
        self._lock = threading.Lock()
        self._on_change: Callable[[int], None] | None = None
        self.bytes = 0
        self.peak_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        size = IO_ALIGNMENT if nbytes <= IO_ALIGNMENT else self._block_size
        with self._lock:
            for i, block in enumerate(self._idle):
                if block.numel() == size:
                    return self._idle.pop(i)
            if self._count == self._limit:
                assert self._idle, "more chunks in flight than the queue depth"
                self._changed(-self._idle.pop().numel())
                self._count -= 1
            self._count += 1  # reserved before allocating, so that concurrent takes never pass the limit
        try:
            block = aligned_empty(size)
        except BaseException:
            # A block too big for the machine fails the chunk; the pool must still close cleanly.
            with self._lock:
                self._count -= 1
            raise
        with self._lock:
            self._changed(size)
        return block

    def give(self, block: torch.Tensor) -> None:
        with self._lock:
            self._idle.append(block)

    def observe(self, on_change: Callable[[int], None]) -> None:
        """Report bytes made or dropped to `on_change(delta)`, starting with those held now."""
        with self._lock:
            assert self._on_change is None, "the bounce pool already has an observer"
            self._on_change = on_change
            if self.bytes:
                on_change(self.bytes)

    def stats(self) -> BounceStats:
        with self._lock:
            return BounceStats(block_size=self._block_size, limit=self._limit, held=self.bytes, peak_held=self.peak_bytes)

    def close(self) -> None:
        """Drops every block; the tier's chunks have all ended."""
        with self._lock:
            assert len(self._idle) == self._count, "bounce pool closed while a chunk holds a block"
            self._idle.clear()
            self._count = 0
            self._changed(-self.bytes)

    def _changed(self, delta: int) -> None:
        """Lock held."""
        self.bytes += delta
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        if self._on_change is not None and delta:
            self._on_change(delta)


class Op(enum.Enum):
    READ = "read"
    WRITE = "write"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """A span whose bytes read back do not match the checksum written: region position and length."""

    start: int
    length: int
    actual: int
    expected: int


class ChecksumTable:
    """Checksums of one region's written bytes, keyed by position in the region.

    [Note: checksums by region position]
    A region is read and written whole or in part (the swapper moves it through
    staging buffers chunk by chunk), so a checksum cannot belong to a request: it
    belongs to a span of the region. Spans never cross a multiple of `granule`, a
    power of two that divides the block size, and the queue cuts every request at
    multiples of the block size *in the region*, so the chunks of a whole read and
    of a partial read see the same spans. A write records one span per granule it
    touches and drops the spans it overlaps; a read checks every span that lies
    inside its chunk. Bytes whose span was partly overwritten by an unaligned
    partial write (4096-aligned but not granule-aligned) stay unchecked until the
    next write covers them, as do spans that a partial read only partly covers.
    """

    def __init__(self, granule: int) -> None:
        assert granule % IO_ALIGNMENT == 0 and granule & (granule - 1) == 0, granule
        self._granule = granule
        self._spans: dict[int, list[tuple[int, int, int]]] = {}
        """Granule index -> (start, length, checksum) of the spans recorded in it."""
        self._lock = threading.Lock()

    def record(self, start: int, data: memoryview) -> None:
        """Checksums `data`, the bytes about to be written at region position `start`."""
        for lo, hi in self._cut(start, start + len(data)):
            span = (lo, hi - lo, checksum(data[lo - start : hi - start]))
            with self._lock:
                index = lo // self._granule
                kept = [s for s in self._spans.get(index, ()) if s[0] + s[1] <= lo or s[0] >= hi]
                self._spans[index] = [*kept, span]

    def check(self, start: int, data: memoryview) -> Mismatch | None:
        """The first recorded span inside `[start, start + len(data))` whose bytes differ, if any."""
        end = start + len(data)
        for index in range(start // self._granule, -(-end // self._granule)):
            with self._lock:
                spans = list(self._spans.get(index, ()))
            for lo, length, expected in spans:
                if lo >= start and lo + length <= end:
                    actual = checksum(data[lo - start : lo - start + length])
                    if actual != expected:
                        return Mismatch(start=lo, length=length, actual=actual, expected=expected)
        return None

    def _cut(self, start: int, end: int) -> list[tuple[int, int]]:
        bounds = [start, *range((start // self._granule + 1) * self._granule, end, self._granule), end]
        return [(lo, hi) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]


def checksum_granule(block_size: int) -> int:
    """The span of one checksum for a tier with this block size: a power of two dividing it."""
    return math.gcd(block_size, CHECKSUM_SPAN)


@dataclass(slots=True)
class Request:
    """One read or write of `tensor.numel()` bytes at region position `start`; done when its last chunk is."""

    op: Op
    label: str
    offset: int
    """File offset of the tensor's first byte: the region's offset plus `start`."""
    start: int
    tensor: torch.Tensor
    view: memoryview
    future: Future[None]
    remaining: int
    checksums: ChecksumTable | None
    error: BaseException | None = None


@dataclass(slots=True)
class Chunk:
    """At most `block_size` bytes of a request: `[start, start + length)` of its tensor."""

    request: Request
    start: int
    length: int

    @property
    def file_offset(self) -> int:
        return self.request.offset + self.start


@dataclass(slots=True)
class ChunkBuffers:
    """Where a chunk's bytes go: the iovecs of the system call and the bounce block, if any."""

    iov: list[memoryview]
    block: torch.Tensor | None = None
    head: int = 0
    """Bytes moved straight to or from the caller's tensor; the rest go through `block`."""


@dataclass(slots=True)
class ChunkIO:
    """Prepares and finishes the chunks of one swap file; the backend does the transfer between."""

    path: Path
    direct: bool
    pool: BouncePool

    def prepare(self, chunk: Chunk) -> ChunkBuffers:
        req, view = chunk.request, chunk.request.view[chunk.start : chunk.start + chunk.length]
        padded = align_up(chunk.length)
        if not self.direct:
            bufs = ChunkBuffers([view])
            if req.op is Op.WRITE and padded > chunk.length:
                bufs.iov.append(_ZEROS[: padded - chunk.length])
        elif (req.tensor.data_ptr() + chunk.start) % IO_ALIGNMENT == 0:
            head = chunk.length - chunk.length % IO_ALIGNMENT
            bufs = ChunkBuffers([view[:head]] if head else [], head=head)
        else:
            bufs = ChunkBuffers([])
        if self.direct and bufs.head < chunk.length:
            bounced = padded - bufs.head
            bufs.block = self.pool.take(bounced)
            bufs.iov.append(memoryview(bufs.block[:bounced].numpy()))
            if req.op is Op.WRITE:
                tail = chunk.length - bufs.head
                bufs.block[:tail].copy_(req.tensor[chunk.start + bufs.head : chunk.start + chunk.length])
                bufs.block[tail:bounced].zero_()
        if req.op is Op.WRITE and req.checksums is not None:
            # Recorded before the bytes reach the disk: a write that fails half-way
            # then reads back as a mismatch instead of as good data.
            req.checksums.record(req.start + chunk.start, view)
        return bufs

    def finish(self, chunk: Chunk, bufs: ChunkBuffers) -> None:
        req = chunk.request
        if req.op is Op.READ and bufs.block is not None:
            tail = chunk.length - bufs.head
            req.tensor[chunk.start + bufs.head : chunk.start + chunk.length].copy_(bufs.block[:tail])
        if req.op is Op.READ and req.checksums is not None:
            bad = req.checksums.check(req.start + chunk.start, req.view[chunk.start : chunk.start + chunk.length])
            if bad is not None:
                raise ChecksumError(
                    f"checksum mismatch reading {req.label}: {self.path} at offset {req.offset - req.start + bad.start} "
                    f"({bad.length} bytes) has checksum {bad.actual:016x}, {bad.expected:016x} was written; "
                    "the swap file was changed behind the tier or the disk returned bad data"
                )

    def release(self, bufs: ChunkBuffers | None) -> None:
        if bufs is not None and bufs.block is not None:
            self.pool.give(bufs.block)

    def describe_failure(self, chunk: Chunk, exc: BaseException) -> BaseException:
        """An OSError naming the region's label, the file and the offset; other errors unchanged."""
        if isinstance(exc, ChecksumError) or not isinstance(exc, OSError):
            return exc
        req = chunk.request
        wrapped = OSError(
            exc.errno,
            f"NVMe {req.op.value} of {req.label} failed: {self.path} at offset {chunk.file_offset} "
            f"({chunk.length} bytes): {exc.strerror or exc}",
        )
        wrapped.__cause__ = exc
        return wrapped


@dataclass(slots=True)
class ChunkQueue:
    """Dispatches chunks in FIFO order with at most `queue_depth` in flight across all requests.

    `launch(chunk)` starts a chunk on the backend, which must call `done(chunk, error)` exactly
    once when it ends. Chunks of a request that already failed are still passed through (the
    backend skips their I/O) so that completion counting stays in one place.
    """

    queue_depth: int
    block_size: int
    launch: Callable[[Chunk], None] | None = None
    """Set once the backend exists, as the backend reports to `done`."""
    inflight: int = 0
    inflight_peak: int = 0
    closed: bool = False
    _pending: deque[Chunk] = field(default_factory=deque)
    _idle: threading.Condition = field(default_factory=lambda: threading.Condition(threading.Lock()))

    def submit(self, request: Request, nbytes: int) -> None:
        # Cut at multiples of the block size in the region, not in the request, so that a
        # partial request's chunks line up with a whole one's (for the checksums).
        step, first, end = self.block_size, request.start, request.start + nbytes
        bounds = [first, *range((first // step + 1) * step, end, step), end]
        chunks = [Chunk(request, lo - first, hi - lo) for lo, hi in zip(bounds, bounds[1:]) if hi > lo]
        request.remaining = len(chunks)
        request.future.set_running_or_notify_cancel()
        if not chunks:
            request.future.set_result(None)
            return
        with self._idle:
            if self.closed:
                raise ValueError(f"cannot {request.op.value} {request.label}: the NVMe tier is closed")
            self._pending.extend(chunks)
            finished = self._pump()
        _settle_all(finished)

    def done(self, chunk: Chunk, error: BaseException | None) -> None:
        with self._idle:
            self.inflight -= 1
            finished = _count_done(chunk.request, error)
            if not self.closed:
                finished += self._pump()
            self._idle.notify_all()
        _settle_all(finished)

    def close(self) -> None:
        """Fails the chunks not yet started, then waits for those in flight."""
        finished: list[Request] = []
        with self._idle:
            self.closed = True
            while self._pending:
                req = self._pending.popleft().request
                closed = ValueError(f"the NVMe tier was closed before {req.label} was {req.op.value}")
                finished += _count_done(req, closed)
            self._idle.wait_for(lambda: self.inflight == 0)
        _settle_all(finished)

    def _pump(self) -> list[Request]:
        """Launches pending chunks up to the queue depth; returns the requests that ended here."""
        assert self.launch is not None, "chunk queued before a backend was attached"
        finished: list[Request] = []
        while self._pending and self.inflight < self.queue_depth:
            chunk = self._pending.popleft()
            try:
                self.launch(chunk)
            except RuntimeError as exc:
                # The backend is shutting down (interpreter exit): fail the chunk here,
                # since no worker will ever report it done.
                finished += _count_done(chunk.request, exc)
                continue
            self.inflight += 1
            self.inflight_peak = max(self.inflight_peak, self.inflight)
        return finished


def _count_done(req: Request, error: BaseException | None) -> list[Request]:
    if error is not None and req.error is None:
        req.error = error
    req.remaining -= 1
    return [req] if req.remaining == 0 else []


def _settle_all(requests: list[Request]) -> None:
    for req in requests:
        _settle(req)


def _settle(req: Request) -> None:
    if req.error is None:
        req.future.set_result(None)
    else:
        req.future.set_exception(req.error)
