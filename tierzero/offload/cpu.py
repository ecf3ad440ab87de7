"""The host-memory tier: 4096-aligned buffers, pinned when a GPU is present.

Buffers are aligned so that the NVMe tier can read and write them with direct
I/O, without a bounce copy. With CUDA and `pin_memory`, each buffer is pinned
with `cudaHostRegister` over its exact bytes. The CUDA caching host allocator
(`torch.empty(..., pin_memory=True)`) is avoided on purpose: it rounds every
block up to a power of two, so a 40 GiB budget could hold only ~20 GiB of slices.

The module also holds the swapper's staging pool: aligned host buffers made from
this tier, lent to one transfer at a time.

Freed buffers are kept for reuse by exact size, because pinning is slow (it walks
and locks every page) and even unpinned fresh memory is slow to fill: its pages are
faulted in and zeroed during the first read into it, which halves an NVMe read. Kept
buffers still hold memory, so they count against the capacity: when a new allocation
would not fit, kept buffers are dropped first, and only then is the allocation
refused. With no `reuse_limit` the tier never holds more than the high-water mark of
its live bytes: keeping a freed buffer never grows what it holds, and a new
allocation past that mark drops kept buffers first, so reuse costs no peak memory.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierzero.offload.base import IO_ALIGNMENT, Region, Tier, align_up, aligned_empty
from tierzero.offload.device import MemoryTier

_CUDA_HOST_REGISTER_PORTABLE = 1
"""Pinned for every CUDA context, not only the current device's."""


def _pin(buffer: torch.Tensor) -> None:
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), _CUDA_HOST_REGISTER_PORTABLE))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {buffer.numel()} bytes failed with cudaError {error}")


def _unpin(buffer: torch.Tensor) -> None:
    error = int(torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr()))
    assert error == 0, f"cudaHostUnregister failed with cudaError {error}"


class CpuTier(MemoryTier):
    """Host memory, budgeted; buffers aligned to 4096 and pinned when CUDA is available."""

    def __init__(
        self,
        *,
        capacity: int | None = None,
        pin_memory: bool = True,
        reuse_limit: int | None = None,
        tier: Tier = Tier.CPU,
    ) -> None:
        super().__init__(tier=tier, capacity=capacity)
        if reuse_limit is not None and reuse_limit < 0:
            raise ValueError(f"reuse_limit must be >= 0 bytes, got {reuse_limit}")
        # Without CUDA there is nothing to pin against (pinning would raise).
        self.pinned = pin_memory and torch.cuda.is_available()
        self.reuse_limit = reuse_limit
        """Most bytes of freed buffers kept; None: bounded by the high-water mark of live bytes."""
        self._kept: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._kept_bytes = 0
        self._live_peak = 0
        self.reused = 0
        """Allocations served from kept buffers (for tests and reports)."""

    @classmethod
    def from_config(cls, cfg: object) -> CpuTier:
        tiers = cfg.tiers  # type: ignore[attr-defined]
        return cls(capacity=tiers.cpu.capacity, pin_memory=tiers.cpu.pin_memory)

    @property
    def kept_bytes(self) -> int:
        """Bytes of freed buffers held for reuse; they are memory this tier still holds."""
        return self._kept_bytes

    @property
    def held(self) -> int:
        """All memory the tier holds: live regions plus kept buffers."""
        return self._used + self._kept_bytes

    def allocate(self, nbytes: int, *, label: str) -> Region:
        if nbytes <= 0:
            raise ValueError(f"a {self.tier.value} region needs a positive size, got {nbytes} bytes for {label}")
        with self._lock:
            self._reserve(nbytes, label=label)
            live_peak_before = self._live_peak
            self._live_peak = max(self._live_peak, self._used)
            kept = self._kept.get(nbytes)
            buffer = kept.pop() if kept else None
            if buffer is not None:
                self._kept_bytes -= nbytes
                self.reused += 1
            else:
                dropped = self._make_room(live_peak_before)
        if buffer is None:
            self._unpin_all(dropped)
            buffer = self._new_reserved(nbytes)
        return Region(tier=self.tier, nbytes=nbytes, label=label, buffer=buffer)

    def close(self) -> None:
        with self._lock:
            dropped = [buffer for buffers in self._kept.values() for buffer in buffers]
            self._kept.clear()
            self._kept_bytes = 0
        self._unpin_all(dropped)

    def _make_room(self, live_peak_before: int) -> list[torch.Tensor]:
        """Drop kept buffers until what the tier holds fits its bound; lock held.

        `_reserve` already counted the new bytes in `_used`. The bound is the capacity,
        and without a `reuse_limit` also the high-water mark of live bytes before this
        allocation (or the live bytes now, when they pass it).
        """
        bounds = [self._capacity] if self._capacity is not None else []
        if self.reuse_limit is None:
            bounds.append(max(live_peak_before, self._used))
        if not bounds:
            return []
        bound = min(bounds)
        dropped: list[torch.Tensor] = []
        for size in sorted(self._kept, reverse=True):
            buffers = self._kept[size]
            while buffers and self._used + self._kept_bytes > bound:
                dropped.append(buffers.pop())
                self._kept_bytes -= size
        assert self._used + self._kept_bytes <= bound or not self._kept_bytes, "kept buffers not dropped"
        return dropped

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        buffer = aligned_empty(nbytes)
        if self.pinned:
            _pin(buffer)
        return buffer

    def _drop_buffer(self, buffer: torch.Tensor) -> None:
        nbytes = buffer.numel()
        with self._lock:
            # Keeping moves bytes from used to kept, so what the tier holds never grows here.
            keep = self.reuse_limit is None or self._kept_bytes + nbytes <= self.reuse_limit
            if keep:
                self._kept[nbytes].append(buffer)
                self._kept_bytes += nbytes
        if not keep:
            self._unpin_all([buffer])

    def _unpin_all(self, buffers: list[torch.Tensor]) -> None:
        if self.pinned:
            for buffer in buffers:
                _unpin(buffer)


class HostDeviceTier(CpuTier):
    """The compute device of a run without a GPU: host memory under the device tier's budget.

    `DeviceTier` on the host stands in for a GPU, staging path included, for tests and
    benchmarks of that path. A real CPU-only run has no reason to pay for it: here the
    device's buffers are aligned and reused as the CPU tier's are, so the NVMe tier
    reads and writes them directly (no staging copy) and a fetch does not fault in fresh
    pages (see the module note).
    """

    def __init__(self, *, capacity: int | None = None) -> None:
        super().__init__(capacity=capacity, pin_memory=False, tier=Tier.DEVICE)
        self.device = torch.device("cpu")


@dataclass(slots=True)
class StagingBuffer:
    """One staging buffer of the pool; `in_use` guards against handing it out twice."""

    index: int
    tensor: torch.Tensor
    region: Region | None
    in_use: bool = False


@dataclass(frozen=True, slots=True)
class StagingStats:
    """Staging memory: held (allocated) and in use (lent to a transfer), now and at peak."""

    buffer_size: int
    buffer_count: int
    held: int
    peak_held: int
    in_use: int
    peak_in_use: int

    @property
    def capacity(self) -> int:
        return self.buffer_size * self.buffer_count


class StagingPool:
    """At most `buffer_count` aligned host buffers of `buffer_size` bytes, made on first need.

    Buffers come from `host` (the CPU tier) when given, so they are pinned with the
    tier's rule and count against its capacity; an observer (`observe`) hears of
    bytes made or given back, for the store's accounting.
    """

    def __init__(
        self,
        *,
        buffer_size: int,
        buffer_count: int,
        host: MemoryTier | None = None,
    ) -> None:
        if buffer_size <= 0 or buffer_size % IO_ALIGNMENT:
            raise ValueError(
                f"swapper.buffer_size must be a positive multiple of {IO_ALIGNMENT} bytes, got {buffer_size}: "
                f"use {align_up(max(buffer_size, 1))}"
            )
        if buffer_count < 1:
            raise ValueError(f"swapper.buffer_count must be >= 1, got {buffer_count}")
        self.buffer_size, self.buffer_count = buffer_size, buffer_count
        self._host = host
        self._on_change: Callable[[int], None] | None = None
        self._buffers: list[StagingBuffer] = []
        self._free: list[StagingBuffer] = []
        self._in_use = self._peak_in_use = self._peak_held = 0
        self._cond = threading.Condition()

    def acquire(self) -> StagingBuffer:
        """A buffer for this caller alone; blocks until one is given back when all are lent."""
        with self._cond:
            while (buffer := self._take()) is None:
                self._cond.wait()
            return buffer

    def try_acquire(self) -> StagingBuffer | None:
        with self._cond:
            return self._take()

    def release(self, buffer: StagingBuffer) -> None:
        with self._cond:
            assert buffer.in_use, f"staging buffer {buffer.index} given back twice"
            buffer.in_use = False
            self._in_use -= self.buffer_size
            self._free.append(buffer)
            self._cond.notify()

    def _held(self) -> int:
        return len(self._buffers) * self.buffer_size

    def observe(self, on_change: Callable[[int], None]) -> None:
        """Report bytes made or given back to `on_change(delta)`, starting with those held now."""
        with self._cond:
            assert self._on_change is None, "the staging pool already has an observer"
            self._on_change = on_change
            if self._held():
                on_change(self._held())

    def stats(self) -> StagingStats:
        with self._cond:
            held = self._held()
            return StagingStats(
                buffer_size=self.buffer_size,
                buffer_count=self.buffer_count,
                held=held,
                peak_held=self._peak_held,
                in_use=self._in_use,
                peak_in_use=self._peak_in_use,
            )

    def close(self) -> None:
        with self._cond:
            assert not any(b.in_use for b in self._buffers), "staging pool closed while a transfer holds a buffer"
            buffers, self._buffers, self._free = self._buffers, [], []
        for buffer in buffers:
            if buffer.region is not None and self._host is not None:
                self._host.free(buffer.region)
        if buffers and self._on_change is not None:
            self._on_change(-len(buffers) * self.buffer_size)

    def _take(self) -> StagingBuffer | None:
        """A free buffer, or a new one while fewer than `buffer_count` exist; lock held."""
        if not self._free and len(self._buffers) < self.buffer_count:
            self._free.append(self._make(len(self._buffers)))
        if not self._free:
            return None
        buffer = self._free.pop()
        assert not buffer.in_use, f"staging buffer {buffer.index} lent while in use"
        buffer.in_use = True
        self._in_use += self.buffer_size
        self._peak_in_use = max(self._peak_in_use, self._in_use)
        return buffer

    def _make(self, index: int) -> StagingBuffer:
        if self._host is not None:
            region = self._host.allocate(self.buffer_size, label=f"staging buffer {index}")
            assert region.buffer is not None
            buffer = StagingBuffer(index=index, tensor=region.buffer, region=region)
        else:
            buffer = StagingBuffer(index=index, tensor=aligned_empty(self.buffer_size), region=None)
        self._buffers.append(buffer)
        self._peak_held = max(self._peak_held, self._held())
        if self._on_change is not None:
            self._on_change(self.buffer_size)
        return buffer
