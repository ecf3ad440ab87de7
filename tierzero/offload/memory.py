"""Memory tiers: regions backed by tensors, and the compute-device tier.

`MemoryTier` holds what the device and CPU tiers share: a byte budget enforced
under a lock (the swapper's threads allocate and free too) and reads/writes that
are plain tensor copies. `DeviceTier` is the compute device. With CUDA its
regions are CUDA tensors; without a GPU it is host memory with its own capacity,
so budgets and the device<->NVMe staging path can be exercised on a laptop.

[Note: device memory never meets the NVMe tier]
On a GPU, direct I/O cannot target HBM, so every device<->NVMe move goes through
the swapper's pinned staging buffers. `DeviceTier` on the host keeps that rule: its
tensors are deliberately *not* 4096-aligned and the swapper never hands them to
the NVMe tier, so tests and `bench swap` exercise the GPU's path on the host. A
training run without a GPU uses `offload.cpu.HostDeviceTier` instead (the store
picks it), where the host memory *is* the compute device and moves are direct.
"""

from __future__ import annotations

import threading
from abc import abstractmethod

import torch

from tierzero.common.slices import Tier
from tierzero.offload.base import Region, TierCapacityError, TierStorage, TierTraits


class MemoryTier(TierStorage):
    """A tier whose regions are 1-D uint8 tensors in one memory."""

    traits = TierTraits(in_memory=True)

    def __init__(self, *, tier: Tier, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"tiers.{tier.value}.capacity must be >= 0 bytes, got {capacity}")
        self.tier = tier
        self._capacity = capacity
        self._used = 0
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int | None:
        return self._capacity

    @property
    def used(self) -> int:
        return self._used

    def allocate(self, nbytes: int, *, label: str) -> Region:
        if nbytes <= 0:
            raise ValueError(f"a {self.tier.value} region needs a positive size, got {nbytes} bytes for {label}")
        with self._lock:
            self._reserve(nbytes, label=label)
        return Region(tier=self.tier, nbytes=nbytes, label=label, buffer=self._new_reserved(nbytes))

    def free(self, region: Region) -> None:
        assert region.tier is self.tier, f"{region.label}: a {region.tier.value} region freed by the {self.tier.value} tier"
        assert region.buffer is not None, f"{region.label}: freed twice"
        buffer, region.buffer = region.buffer, None
        maker = region.maker if isinstance(region.maker, MemoryTier) else self
        maker._drop_buffer(buffer)
        with self._lock:
            self._used -= region.nbytes
            assert self._used >= 0, f"{self.tier.value} tier accounting went negative"

    def same_memory(self, other: TierStorage | None) -> bool:
        """Whether `other` holds its regions in this tier's memory, so that a region can change
        tier (`hand_over`) instead of being copied."""
        return False

    def hand_over(self, region: Region, to: MemoryTier) -> Region:
        """`region` as a region of `to`, one memory (`same_memory`), without a copy; raises
        TierCapacityError, changing nothing, when `to` is full."""
        assert self.same_memory(to) and region.tier is self.tier and region.buffer is not None, region.label
        with to._lock:
            to._reserve(region.nbytes, label=region.label)
        buffer, region.buffer = region.buffer, None
        with self._lock:
            self._used -= region.nbytes  # given away: neither freed nor kept for reuse
        maker = region.maker or self
        return Region(
            tier=to.tier, nbytes=region.nbytes, label=region.label, buffer=buffer, maker=None if maker is to else maker
        )

    def read(self, region: Region, dst: torch.Tensor) -> None:
        assert region.buffer is not None, f"{region.label}: read after free"
        dst.copy_(region.buffer)

    def write(self, region: Region, src: torch.Tensor) -> None:
        assert region.buffer is not None, f"{region.label}: write after free"
        region.buffer.copy_(src)

    def _reserve(self, nbytes: int, *, label: str) -> None:
        """Count `nbytes` as used, or raise; called with the lock held."""
        if self._capacity is not None and self._used + nbytes > self._capacity:
            raise TierCapacityError(self.tier, need=nbytes, used=self._used, capacity=self._capacity, what=label)
        self._used += nbytes

    def _new_reserved(self, nbytes: int) -> torch.Tensor:
        """A new buffer for `nbytes` already reserved; the reservation is undone if it cannot be made."""
        try:
            return self._new_buffer(nbytes)
        except BaseException:
            with self._lock:
                self._used -= nbytes
            raise

    @abstractmethod
    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        """A fresh 1-D uint8 tensor of exactly `nbytes` in this tier's memory."""

    def _drop_buffer(self, buffer: torch.Tensor) -> None:
        """Hook for tiers that must undo something (unpin, recycle) before the memory goes."""
