"""The host-memory tier: 4096-aligned buffers, pinned when a GPU is present.

Buffers are aligned so that the NVMe tier can read and write them with direct
I/O, without a bounce copy. With CUDA and `pin_memory`, each buffer is pinned
with `cudaHostRegister` over its exact bytes, through the process's `PinnedRegistry`
([Note: pinned registrations] in pinned.py). The CUDA caching host allocator
(`torch.empty(..., pin_memory=True)`) is avoided on purpose: it rounds every
block up to a power of two, so a 40 GiB budget could hold only ~20 GiB of slices.

Freed buffers are kept for reuse by exact size, because pinning is slow (it walks
and locks every page) and even unpinned fresh memory is slow to fill: its pages are
faulted in and zeroed during the first read into it, which halves an NVMe read. Kept
buffers still hold memory, so they count against the capacity: when a new allocation
would not fit, kept buffers are dropped first, and only then is the allocation
refused. With no `reuse_limit` the tier never holds more than the high-water mark of
its live bytes: keeping a freed buffer never grows what it holds, and a new
allocation past that mark drops kept buffers first, so reuse costs no peak memory.

[Note: slack for buffers of many sizes]
That bound is tight where a step's buffers come in several sizes and reuse is by exact
size: a unit-sized allocation with no kept buffer of its size drops kept buffers of other
sizes to stay under the mark, and the next allocation of those sizes faults in fresh
memory again. A 2B LoRA step with an NF4 base (codes 45 MB, decoded units 159 MB, the
embedding and head 328 MB) dropped and made anew 1.4-2.1 GB of buffers a step, and the
decode into them spent 0.6-2.5 s of its 1.7-3.7 s in the kernel faulting pages in (the dev
VM hands freed memory back to its host, so a fresh page costs over a millisecond). The
compute device's host tier (`HostDeviceTier`) may therefore hold `reuse_slack` bytes of kept
buffers past the mark: `tiers.cpu.keep_freed`, the free heap the process keeps resident
anyway (host_heap.py), here kept in buffers of the sizes the step asks for.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from tierzero.common.slices import Tier, aligned_empty
from tierzero.config import CpuTierConfig
from tierzero.offload.base import Region, TierStorage
from tierzero.offload.memory import MemoryTier
from tierzero.offload.pinned import PinnedRegistry, pinned_registry


class CpuTier(MemoryTier):
    """Host memory, budgeted; buffers aligned to 4096 and pinned when CUDA is available."""

    def __init__(
        self,
        *,
        capacity: int | None = None,
        pin_memory: bool = True,
        reuse_limit: int | None = None,
        tier: Tier = Tier.CPU,
        registry: PinnedRegistry | None = None,
        reuse_slack: int = 0,
    ) -> None:
        super().__init__(tier=tier, capacity=capacity)
        if reuse_limit is not None and reuse_limit < 0:
            raise ValueError(f"reuse_limit must be >= 0 bytes, got {reuse_limit}")
        self._registry = registry or pinned_registry()
        # Without CUDA (or a runtime standing in for it) there is nothing to pin against.
        self.pinned = pin_memory and self._registry.available
        self.reuse_limit = reuse_limit
        """Most bytes of freed buffers kept; None: bounded by the high-water mark of live bytes."""
        if reuse_slack < 0:
            raise ValueError(f"reuse_slack must be >= 0 bytes, got {reuse_slack}")
        self.reuse_slack = reuse_slack
        """Bytes the tier may hold past that mark in kept buffers ([Note: slack for buffers of many sizes])."""
        self._kept: dict[int, list[torch.Tensor]] = defaultdict(list)
        self._kept_bytes = 0
        self._live_peak = 0
        self.reused = 0
        """Allocations served from kept buffers (for tests and reports)."""

    @classmethod
    def from_config(cls, section: CpuTierConfig) -> CpuTier:
        """From the `tiers.cpu` section."""
        return cls(capacity=section.capacity, pin_memory=section.pin_memory)

    def same_memory(self, other: TierStorage | None) -> bool:
        return isinstance(other, CpuTier) and other.pinned == self.pinned

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
        allocation (or the live bytes now, when they pass it), plus `reuse_slack`.
        """
        bounds = [self._capacity] if self._capacity is not None else []
        if self.reuse_limit is None:
            bounds.append(max(live_peak_before, self._used) + self.reuse_slack)
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
            self._registry.pin(buffer)
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
                self._registry.unpin(buffer)


class HostDeviceTier(CpuTier):
    """The compute device of a run without a GPU: host memory under the device tier's budget.

    `DeviceTier` on the host stands in for a GPU, staging path included, for tests and
    benchmarks of that path. A real CPU-only run has no reason to pay for it: here the
    device's buffers are aligned and reused as the CPU tier's are, so the NVMe tier
    reads and writes them directly (no staging copy) and a fetch does not fault in fresh
    pages (see the module note).
    """

    def __init__(self, *, capacity: int | None = None, reuse_slack: int = 0) -> None:
        super().__init__(capacity=capacity, pin_memory=False, tier=Tier.DEVICE, reuse_slack=reuse_slack)
        self.device = torch.device("cpu")
