"""The host cache of NVMe-homed slices (`tiers.nvme.cache`): its entries and their moves.

`CachePolicy` (cache_policy.py) decides which slices stay; this file holds their bytes.
An entry is a cpu-tier region (4096-aligned, pinned with CUDA) booked in the ledger as
`Use.CACHE` under its slice's kind, so the cpu row of every report counts it.

[Note: cache ordering]
Every move of an entry is submitted to the swapper under its slice's own key, so it runs
in order with the slice's other moves, as a home's would: a fetch copies the entry after
the write that filled it, an eviction writes the entry home after the fetches that read
it, and a later disk read of the slice waits for that eviction. An entry is freed once
its last move has landed. The write that evicts waits for the evictions' disk writes
and frees their entries before it makes its own, so the cache never holds more than its
budget, even for a moment; evictions are rare, the cached set being stable.

A fetch hands out a copy even to the cpu tier, where the entry itself could serve: a
fetched copy is the caller's, changed in place before it decides to write it back, and
an entry may be evicted while a copy of it is held. The copy is a memory copy, several
times the disk's speed.

Nothing is written at close: the swap file is scratch and leaves with the run. A
checkpoint fetches its slices like any reader and so reads cached ones from the cache;
the swap file need not be current for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierzero.common.slices import SliceKey, Tier
from tierzero.common.transfer import Transfer
from tierzero.offload.base import Region, TierCapacityError, TierStorage
from tierzero.store.cache_policy import CachePolicy
from tierzero.store.ledger import Ledger, Use
from tierzero.swapper import Swapper

__all__ = ["NvmeCache"]


@dataclass(slots=True, kw_only=True)
class _Entry:
    region: Region
    last: Transfer | None = None
    """The entry's latest move; the swapper runs the key's moves in order, so it lands last."""


class NvmeCache:
    """Cached copies of NVMe homes in host memory, newer than the homes; see the module notes."""

    def __init__(
        self,
        *,
        budget: int,
        cpu: TierStorage,
        nvme: TierStorage,
        swapper: Swapper,
        ledger: Ledger,
        on_evict: Callable[[SliceKey, Transfer], None],
    ) -> None:
        """`on_evict(key, write)` is told of each eviction's disk write as it is submitted."""
        self.policy = CachePolicy(budget)
        self._cpu, self._nvme, self._swapper, self._ledger = cpu, nvme, swapper, ledger
        self._on_evict = on_evict
        self._homes: dict[SliceKey, Region] = {}
        self._entries: dict[SliceKey, _Entry] = {}

    def track(self, key: SliceKey, home: Region) -> None:
        self.policy.track(key, home.nbytes)
        self._homes[key] = home

    def forget(self, key: SliceKey) -> None:
        """The slice is unregistered: its entry, if any, goes once its moves land, unwritten."""
        if self.policy.forget(key):
            self._free_after(key, self._entries.pop(key))
        del self._homes[key]

    def read(self, key: SliceKey, dst: torch.Tensor) -> Transfer | None:
        """Copy the cached slice into `dst` (uint8, in memory); None on a miss (read the home)."""
        if not self.policy.read(key):
            return None
        entry = self._entries[key]
        nbytes = entry.region.nbytes
        entry.last = self._swapper.copy(key=key, src=self._bytes(entry), dst=dst[:nbytes])
        return entry.last

    def write(self, key: SliceKey, src: torch.Tensor) -> Transfer | None:
        """Copy `src` (uint8, in memory) into the slice's entry; None when it goes to disk instead."""
        admission = self.policy.write(key)
        evicted = [self._evict(victim) for victim in admission.evicted]
        for victim, entry in zip(admission.evicted, evicted):
            assert entry.last is not None
            entry.last.future.result()  # a failed eviction raises here: its slice's newest bytes are lost
            self._free(victim, entry)
        if not admission.cached:
            return None
        if admission.entered:
            self._entries[key] = _Entry(region=self._allocate(key))
        entry = self._entries[key]
        entry.last = self._swapper.copy(key=key, src=src[: entry.region.nbytes], dst=self._bytes(entry))
        return entry.last

    def close(self) -> None:
        """Free every entry, unwritten (see the module note); the swapper has finished its moves."""
        for entry in self._entries.values():
            self._cpu.free(entry.region)
        self._entries.clear()

    def _evict(self, key: SliceKey) -> _Entry:
        """Start writing the entry home; the caller waits for it and frees the entry."""
        entry = self._entries.pop(key)
        home = self._homes[key]
        write = self._swapper.write(key=key, storage=self._nvme, region=home, src=self._bytes(entry), src_tier=Tier.CPU)
        entry.last = write
        self._on_evict(key, write)
        return entry

    def _allocate(self, key: SliceKey) -> Region:
        nbytes = self._homes[key].nbytes
        try:
            region = self._cpu.allocate(nbytes, label=f"{key} cached")
        except TierCapacityError as exc:
            # The policy counted the slice in: forget that, so that the books stay true.
            self.policy.forget(key)
            self.policy.track(key, nbytes)
            raise TierCapacityError(
                Tier.CPU,
                need=exc.need,
                used=exc.used,
                capacity=exc.capacity,
                what=f"{key} in the NVMe cache (tiers.nvme.cache)",
                fix="lower tiers.nvme.cache or raise tiers.cpu.capacity",
            ) from None
        self._ledger.add(Tier.CPU, key.kind, Use.CACHE, nbytes)
        return region

    def _free_after(self, key: SliceKey, entry: _Entry) -> None:
        if entry.last is None:
            self._free(key, entry)
        else:
            entry.last.future.add_done_callback(lambda _: self._free(key, entry))

    def _free(self, key: SliceKey, entry: _Entry) -> None:
        self._cpu.free(entry.region)
        self._ledger.add(Tier.CPU, key.kind, Use.CACHE, -entry.region.nbytes)

    @staticmethod
    def _bytes(entry: _Entry) -> torch.Tensor:
        assert entry.region.buffer is not None, f"{entry.region.label}: used after free"
        return entry.region.buffer[: entry.region.nbytes]
