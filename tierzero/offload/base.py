"""The small interface every tier speaks, and the names shared by the store and the tiers.

A tier holds *regions*: byte ranges it allocated for one slice (or for scratch
space). Memory tiers (device, cpu) back a region with a tensor; the NVMe tier
backs it with an extent of its swap file. The store and the swapper move bytes
with `read`/`write` and never ask which kind of tier they talk to: what a tier can
do beyond that, it declares in its `traits` (`TierTraits`), and the calls that only
some tiers answer (part-of-region moves, bounce memory, a busy clock, kept buffers)
have defaults here, so that no caller probes a tier for a method.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import ClassVar

import torch

from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier
from tierzero.offload.disk.busy import Busy


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


@dataclass(frozen=True, slots=True)
class BounceStats:
    """Bounce memory of a direct-I/O tier: host bytes held now and at peak, and the bound on them."""

    block_size: int
    limit: int
    """Blocks the pool may hold: the queue depth."""
    held: int
    peak_held: int

    @property
    def capacity(self) -> int:
        return self.block_size * self.limit


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


@dataclass(frozen=True, slots=True)
class TierTraits:
    """What a kind of tier can do, declared once by its class and read by the store, the swapper,
    the stages' plan and the estimate, so none of them branches on which tier it is."""

    in_memory: bool
    """Regions are tensors compute can use in place. False: a slice there reaches compute only as a
    copy in a memory tier, which the stages fetch first and write back after."""
    direct_io: bool = False
    """Moves need I/O-aligned host buffers (O_DIRECT): device memory reaches the tier through the
    swapper's pinned staging buffers, never directly."""
    ranged: bool = False
    """Moves part of a region (`submit_read`/`submit_write` with `start`): the swapper's chunked
    device<->tier pipeline needs it."""
    cached: bool = False
    """The store may keep a host-memory cache in front of the tier (`tiers.nvme.cache`)."""


class TierStorage(ABC):
    """A tier: allocates regions within its capacity and moves bytes in and out of them.

    `read` and `write` block until the bytes have moved; the swapper calls them from
    its worker threads, so implementations release the GIL for long copies (torch
    copies and `os.preadv`/`os.pwritev` do).
    """

    tier: Tier
    traits: ClassVar[TierTraits]

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

    def submit_read(self, region: Region, dst: torch.Tensor, *, start: int = 0) -> Future[None]:
        """Starts reading `dst.numel()` bytes at `start` in the region into `dst` (tiers with `traits.ranged`)."""
        raise NotImplementedError(f"the {self.tier.value} tier cannot move part of a region")

    def submit_write(self, region: Region, src: torch.Tensor, *, start: int = 0) -> Future[None]:
        """Starts writing `src` at `start` in the region (tiers with `traits.ranged`)."""
        raise NotImplementedError(f"the {self.tier.value} tier cannot move part of a region")

    @property
    def kept_bytes(self) -> int:
        """Bytes of freed buffers the tier keeps for reuse: memory it still holds, outside `used`."""
        return 0

    def bounce_stats(self) -> BounceStats | None:
        """Host memory the tier's own I/O holds beside the swapper's staging (direct-I/O bounce
        blocks), now and at peak; None where it holds none."""
        return None

    def observe_bounce(self, on_change: Callable[[int], None]) -> None:
        """Have `on_change(delta)` told of every byte of bounce memory made or dropped; a tier that
        holds none never calls it."""

    def busy_now(self) -> Busy:
        """The moves so far and the time they were in flight (a disk's clock); zero where the tier
        keeps no clock."""
        return Busy()

    def close(self) -> None:
        """Release everything the tier holds (files included). Idempotent."""
