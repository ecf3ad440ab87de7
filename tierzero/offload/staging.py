"""The swapper's staging pool: aligned host buffers, made from the host tier, lent to one transfer at a time.

Device<->NVMe moves pass through it chunk by chunk (see [Note: ordering and the
staging pool] in tierzero/swapper.py); its bounds are `swapper.buffer_size` and
`swapper.buffer_count`, and the store's cpu row counts what it holds.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierzero.common.slices import IO_ALIGNMENT, align_up, aligned_empty
from tierzero.offload.base import Region
from tierzero.offload.memory import MemoryTier


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
