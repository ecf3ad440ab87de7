"""The small interface every tier speaks, and the names shared by the store and the tiers.

A tier holds *regions*: byte ranges it allocated for one slice (or for scratch
space). Memory tiers (device, cpu) back a region with a tensor; the NVMe tier
backs it with an extent of its swap file. The store and the swapper move bytes
with `read`/`write` and never ask which kind of tier they talk to.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier


class TierCapacityError(MemoryError):
    """A tier was asked for more bytes than its capacity allows; nothing was spilled."""

    def __init__(self, tier: Tier, *, need: int, used: int, capacity: int, what: str = "", fix: str = "") -> None:
        self.tier, self.need, self.used, self.capacity = tier, need, used, capacity
        target = f" for {what}" if what else ""
        super().__init__(
            f"{tier.value} tier is full: needs {format_size(need)}{target}, "
            f"{format_size(used)} of its {format_size(capacity)} capacity already in use; "
            + (fix or f"raise tiers.{tier.value}.capacity or move state to a lower tier")
        )


class ChecksumError(IOError):
    """Bytes read back do not match the checksum recorded when they were written."""


@dataclass(slots=True)
class Region:
    """Bytes a tier allocated. Exactly one of `buffer` (memory tiers) and `offset` (NVMe) is set."""

    tier: Tier
    nbytes: int
    label: str
    buffer: torch.Tensor | None = None
    offset: int | None = None
    maker: TierStorage | None = None
    """The memory tier that made `buffer`, when another one holds it now (`MemoryTier.hand_over`):
    freed, the buffer goes back to its maker, which reuses it."""


class TierStorage(ABC):
    """A tier: allocates regions within its capacity and moves bytes in and out of them.

    `read` and `write` block until the bytes have moved; the swapper calls them from
    its worker threads, so implementations release the GIL for long copies (torch
    copies and `os.preadv`/`os.pwritev` do).
    """

    tier: Tier

    @property
    @abstractmethod
    def capacity(self) -> int | None:
        """Bytes this tier may hold; None when only the hardware limits it."""

    @property
    @abstractmethod
    def used(self) -> int:
        """Bytes currently allocated."""

    @abstractmethod
    def allocate(self, nbytes: int, *, label: str) -> Region:
        """Reserve `nbytes`; raises TierCapacityError naming `label` when they do not fit."""

    @abstractmethod
    def free(self, region: Region) -> None:
        """Give the region's bytes back. Freeing twice is an internal error."""

    @abstractmethod
    def read(self, region: Region, dst: torch.Tensor) -> None:
        """Copy the region's bytes into `dst`, a 1-D uint8 tensor of `region.nbytes`."""

    @abstractmethod
    def write(self, region: Region, src: torch.Tensor) -> None:
        """Copy `src`, a 1-D uint8 tensor of `region.nbytes`, into the region."""

    def close(self) -> None:
        """Release everything the tier holds (files included). Idempotent."""
