"""Moves bytes between tiers, asynchronously, through a bounded pool of staging buffers.

Mechanism only: the store (and through it the prefetcher) says what to move; the
swapper says how. Three paths, chosen from where the two sides live:

- memory <-> memory (device <-> cpu): one tensor copy; on CUDA it runs on a
  dedicated copy stream, and the worker thread (never the caller) waits for its
  event, so that a transfer is done only once its bytes have moved and its host side
  may be freed; a host-to-device copy also hands the event to `Transfer.wait()`,
  which makes the caller's stream wait on it.
- cpu <-> nvme: direct; CPU-tier buffers are 4096-aligned, so the NVMe tier reads
  and writes them with direct I/O and no bounce copy.
- device <-> nvme: staged, chunk by chunk through the pool (see the note below);
  direct when the device is the host (`host_device`: a run without a GPU, whose
  device tier is `offload.cpu.HostDeviceTier`).

[Note: ordering and the staging pool]
Operations on one key run one after another, in submission order: a read waits
for the key's pending write and two writes land in order. Operations on
different keys run in parallel on the worker threads. A staged transfer keeps
several chunks in flight, but it only ever *blocks* on the pool while it holds
no buffer: when the pool is empty and it holds some, it finishes its own oldest
chunk instead. A blocked transfer therefore never holds a buffer that another
needs, so transfers sharing a small pool cannot deadlock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tierzero.common.slices import Tier
from tierzero.common.transfer import Transfer, TransferOutcome
from tierzero.config import SwapperConfig
from tierzero.offload.base import Region, TierStorage
from tierzero.offload.memory import MemoryTier
from tierzero.offload.staging import StagingBuffer, StagingPool, StagingStats
from tierzero.offload.tiers import traits_of

__all__ = ["Swapper"]

@dataclass(slots=True)
class _KeyTail:
    """The last operation submitted for a key, which the next one waits for."""

    future: Future[TransferOutcome]
    taints: bool
    """Whether a failure of this operation makes later reads of the key fail: true for a
    write (the bytes on the home are half-written) and for a read that failed for that reason."""
    handed: bool = False
    """Whether it was handed on (to a worker, or to its predecessor to start it): one that was not,
    because Ctrl-C landed in between, never runs."""


class Swapper:
    """Moves bytes between a tier's region and a memory tensor; see the module note."""

    def __init__(
        self,
        *,
        buffer_size: int,
        buffer_count: int,
        host: MemoryTier | None = None,
        workers: int = 4,
        host_device: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError(f"the swapper needs at least 1 worker thread, got {workers}")
        self._pool = StagingPool(buffer_size=buffer_size, buffer_count=buffer_count, host=host)
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tierzero-swap")
        self._tails: dict[Hashable, _KeyTail] = {}
        self._lock = threading.Lock()
        self._copy_stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self._closed = False
        self._staged_device = not host_device
        """Whether device<->NVMe moves go through the staging pool (always with a GPU)."""

    @classmethod
    def from_config(cls, section: SwapperConfig, *, host: MemoryTier | None = None, host_device: bool = False) -> Swapper:
        """From the `swapper` section."""
        return cls(buffer_size=section.buffer_size, buffer_count=section.buffer_count, host=host, host_device=host_device)

    @property
    def buffer_size(self) -> int:
        return self._pool.buffer_size

    def stats(self) -> StagingStats:
        return self._pool.stats()

    def observe_staging(self, on_change: Callable[[int], None]) -> None:
        """Have `on_change(delta)` told of every staging byte made or given back, from now on."""
        self._pool.observe(on_change)

    def read(self, *, key: Hashable, storage: TierStorage, region: Region, dst: torch.Tensor, dst_tier: Tier) -> Transfer:
        """Copy `region` (held by `storage`) into `dst`, a 1-D uint8 tensor in `dst_tier` memory."""
        self._check(region, dst, dst_tier)
        # Device memory on either side may still be in use on the caller's stream: a source
        # being produced, or a destination that kernels queued earlier still read (the caching
        # allocator hands a block back to its stream before those kernels ran). The copy
        # stream waits for everything queued on the caller's stream so far.
        source_on_device = region.buffer is not None and region.buffer.is_cuda
        produced = self._record_current_stream() if dst.is_cuda or source_on_device else None
        if storage.traits.direct_io and dst_tier is Tier.DEVICE and self._staged_device:
            return self._schedule(key, False, lambda: self._staged_read(storage, region, dst, produced))
        return self._schedule(key, False, lambda: self._direct(storage.read, region, dst, reading=True, produced=produced))

    def write(self, *, key: Hashable, storage: TierStorage, region: Region, src: torch.Tensor, src_tier: Tier) -> Transfer:
        """Copy `src`, a 1-D uint8 tensor in `src_tier` memory, into `region` (held by `storage`)."""
        self._check(region, src, src_tier)
        # The caller may have just produced `src` on its stream: the copy stream waits for that.
        produced = self._record_current_stream() if src.is_cuda else None
        if storage.traits.direct_io and src_tier is Tier.DEVICE and self._staged_device:
            return self._schedule(key, True, lambda: self._staged_write(storage, region, src, produced))
        return self._schedule(key, True, lambda: self._direct(storage.write, region, src, reading=False, produced=produced))

    def copy(self, *, key: Hashable, src: torch.Tensor, dst: torch.Tensor) -> Transfer:
        """Copy `src` into `dst`, 1-D uint8 tensors of one size in memory (device or host), after the
        key's previous operation. Done once the bytes have moved, on CUDA too: `src` may go then."""
        if self._closed:
            raise ValueError("the swapper is closed; open a new TieredStore to move more bytes")
        if src.dtype != torch.uint8 or dst.dtype != torch.uint8 or src.shape != dst.shape or src.dim() != 1:
            raise ValueError(f"copy needs two 1-D uint8 tensors of one size, got {tuple(src.shape)} and {tuple(dst.shape)}")
        produced = self._record_current_stream() if src.is_cuda or dst.is_cuda else None
        return self._schedule(key, False, lambda: self._memory_copy(src, dst, produced))

    def _memory_copy(self, src: torch.Tensor, dst: torch.Tensor, produced: torch.cuda.Event | None) -> TransferOutcome:
        if self._copy_stream is None or produced is None:
            dst.copy_(src)
            return TransferOutcome()
        return self._stream_copy(dst, src, produced)

    def _stream_copy(self, dst: torch.Tensor, src: torch.Tensor, produced: torch.cuda.Event | None) -> TransferOutcome:
        """`dst.copy_(src)` on the copy stream, after `produced`; done once the bytes have moved."""
        assert self._copy_stream is not None
        with torch.cuda.stream(self._copy_stream):
            if produced is not None:
                self._copy_stream.wait_event(produced)
            dst.copy_(src, non_blocking=True)
            for t in (dst, src):
                if t.is_cuda:
                    # The caching allocator must not hand this block to another stream before the copy ran.
                    t.record_stream(self._copy_stream)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        # Waited for here, in the worker (an event wait, which no sync check flags), not by the
        # caller: once the transfer is done, its host side may be read, freed and reused.
        event.synchronize()
        return TransferOutcome(event=event if dst.is_cuda else None)

    def close(self) -> None:
        """Wait for every submitted transfer, then release the staging buffers. Idempotent.

        A transfer that was never handed on is cancelled instead: Ctrl-C can land between
        `_schedule` naming it the key's tail and handing it to a worker, and it would never run,
        hanging the close (and the run) for good.
        """
        if self._closed:
            return
        self._closed = True
        with self._lock:
            pending = list(self._tails.values())
        for tail in pending:
            if tail.handed or not tail.future.cancel():
                tail.future.exception()
        self._executor.shutdown(wait=True)
        self._pool.close()

    def _check(self, region: Region, tensor: torch.Tensor, tier: Tier) -> None:
        if self._closed:
            raise ValueError("the swapper is closed; open a new TieredStore to move more bytes")
        if not traits_of(tier).in_memory:
            raise ValueError(f"the memory side of a transfer must be the device or cpu tier, got {tier.value}")
        if tensor.dtype != torch.uint8 or tensor.dim() != 1 or tensor.numel() != region.nbytes:
            raise ValueError(
                f"{region.label}: expected a 1-D uint8 tensor of {region.nbytes} bytes, "
                f"got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )

    def _schedule(self, key: Hashable, is_write: bool, op: Callable[[], TransferOutcome]) -> Transfer:
        """Run `op` on a worker after the key's previous operation has finished."""
        result: Future[TransferOutcome] = Future()
        with self._lock:
            previous = self._tails.get(key)
            tail = self._tails[key] = _KeyTail(result, taints=is_write)

        def run() -> None:
            if not result.set_running_or_notify_cancel():
                return
            try:
                if previous is not None:
                    self._follow(key, previous, tail, is_write=is_write)
                result.set_result(op())
            except BaseException as exc:
                result.set_exception(exc)

        def start(_: object = None) -> None:
            try:
                self._executor.submit(run)
            except RuntimeError as exc:  # shut down under us: fail rather than leave it pending forever
                if result.set_running_or_notify_cancel():
                    result.set_exception(exc)

        def forget(done: Future[TransferOutcome]) -> None:
            with self._lock:
                tail = self._tails.get(key)
                if tail is not None and tail.future is done:
                    del self._tails[key]

        result.add_done_callback(forget)
        if previous is None:
            start()
        else:
            previous.future.add_done_callback(start)
        tail.handed = True
        return Transfer(result)

    @staticmethod
    def _follow(key: Hashable, previous: _KeyTail, tail: _KeyTail, *, is_write: bool) -> None:
        """Checks before an operation that follows `previous` on the same key."""
        error = previous.future.exception()
        if error is None:
            event = previous.future.result().event
            if event is not None:
                # A host-to-device copy may still be reading the memory this operation touches.
                event.synchronize()
        elif previous.taints and not is_write:
            # A write replaces the whole region and so restores trust; a read would return torn bytes.
            tail.taints = True
            raise RuntimeError(f"{key}: an earlier write of this key failed, its bytes cannot be trusted") from error

    def _direct(
        self,
        move: Callable[[Region, torch.Tensor], None],
        region: Region,
        tensor: torch.Tensor,
        *,
        reading: bool,
        produced: torch.cuda.Event | None = None,
    ) -> TransferOutcome:
        memory = region.buffer
        if self._copy_stream is None or memory is None or not (memory.is_cuda or tensor.is_cuda):
            move(region, tensor)  # the tier's own blocking read or write
            return TransferOutcome()
        dst, src = (tensor, memory) if reading else (memory, tensor)
        return self._stream_copy(dst, src, produced)

    def _staged_read(
        self, storage: TierStorage, region: Region, dst: torch.Tensor, produced: torch.cuda.Event | None
    ) -> TransferOutcome:
        ranged = _ranged(storage)
        if produced is not None and self._copy_stream is not None:
            # Queued, not waited for on the host: the chunk copies below run after it on the copy stream.
            self._copy_stream.wait_event(produced)
        inflight: deque[tuple[int, int, StagingBuffer, Future[None]]] = deque()

        def finish_oldest() -> None:
            start, length, buffer, future = inflight.popleft()
            try:
                future.result()
                self._copy_chunk(dst[start : start + length], buffer.tensor[:length])
            finally:
                self._pool.release(buffer)

        try:
            # Up to the pool's size of chunks are read ahead while earlier ones are copied to the device.
            for start, length in self._chunks(region.nbytes):
                buffer = self._acquire(inflight, finish_oldest)
                inflight.append((start, length, buffer, ranged.submit_read(region, buffer.tensor[:length], start=start)))
            while inflight:
                finish_oldest()
        finally:
            self._drain(inflight)
        return TransferOutcome()

    def _staged_write(
        self, storage: TierStorage, region: Region, src: torch.Tensor, produced: torch.cuda.Event | None
    ) -> TransferOutcome:
        ranged = _ranged(storage)
        inflight: deque[tuple[int, int, StagingBuffer, Future[None]]] = deque()

        def finish_oldest() -> None:
            _, _, buffer, future = inflight.popleft()
            try:
                future.result()
            finally:
                self._pool.release(buffer)

        if produced is not None:
            produced.synchronize()
        try:
            # Chunk k is copied into a staging buffer while chunk k-1 is still being written.
            for start, length in self._chunks(region.nbytes):
                buffer = self._acquire(inflight, finish_oldest)
                staged = buffer.tensor[:length]
                try:
                    self._copy_chunk(staged, src[start : start + length])
                except BaseException:
                    self._pool.release(buffer)
                    raise
                inflight.append((start, length, buffer, ranged.submit_write(region, staged, start=start)))
            while inflight:
                finish_oldest()
        finally:
            self._drain(inflight)
        return TransferOutcome()

    def _acquire(self, inflight: deque, finish_oldest: Callable[[], None]) -> StagingBuffer:
        """A staging buffer; while this transfer holds some, it finishes its own chunks rather than block."""
        while inflight:
            buffer = self._pool.try_acquire()
            if buffer is not None:
                return buffer
            finish_oldest()
        return self._pool.acquire()

    def _drain(self, inflight: deque[tuple[int, int, StagingBuffer, Future[None]]]) -> None:
        """After an error: let the chunks still in flight finish before their buffers go back."""
        while inflight:
            _, _, buffer, future = inflight.popleft()
            future.exception()
            self._pool.release(buffer)

    def _chunks(self, nbytes: int) -> list[tuple[int, int]]:
        size = self._pool.buffer_size
        return [(start, min(size, nbytes - start)) for start in range(0, nbytes, size)]

    def _copy_chunk(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """A device<->staging copy that is complete when this returns (the staging buffer is reused next)."""
        if self._copy_stream is None or not (dst.is_cuda or src.is_cuda):
            dst.copy_(src)
            return
        with torch.cuda.stream(self._copy_stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._copy_stream)
        done.synchronize()  # the chunk's own copy, not the stream's (nor a sync check's) business

    @staticmethod
    def _record_current_stream() -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return event


def _ranged(storage: TierStorage) -> TierStorage:
    """The tier as the chunked device<->tier pipeline uses it: it needs part-of-region I/O."""
    assert storage.traits.ranged, f"the {storage.tier.value} tier cannot move part of a region"
    return storage
