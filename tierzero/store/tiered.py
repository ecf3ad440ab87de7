"""TieredStore: every slice's home tier, its fetched copy, and the bytes each tier holds.

The stages register each slice with a home tier, `fetch` it to the tier where it
is used, `write_back` what they changed and `release` the copy. They never learn
where a slice lives: a fetch to the home tier hands back the home tensor itself.

[Note: slice lifecycle]
HOME --fetch--> FETCHING --(read done)--> FETCHED --write_back--> WRITING --(done)--> FETCHED
any of the three fetched states --release--> HOME. States advance lazily: a
record is settled against its transfers whenever it is touched. `release` does
not block: the copy is freed, and its bytes leave the accounting, once the
copy's reads and writes have finished, so a release right after a write_back
never frees memory a transfer still reads.

With `tiers.nvme.cache`, a cached NVMe-homed slice is fetched from and written back
to its host entry instead of the disk (store/nvme_cache.py); the states are the same.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import torch

from tierzero.common.slices import KEPT_KINDS, Kind, SliceKey, Tier, shown_kinds
from tierzero.common.transfer import Transfer, after_all
from tierzero.config import SwapperConfig, TiersConfig
from tierzero.offload.base import Region, TierStorage
from tierzero.offload.cpu import CpuTier, HostDeviceTier
from tierzero.offload.disk.busy import Busy
from tierzero.offload.memory import MemoryTier
from tierzero.offload.tiers import tiers_from_config, traits_of
from tierzero.store.ledger import Ledger, StoreReport, Use
from tierzero.store.nvme_cache import NvmeCache
from tierzero.store.records import FETCHED_STATES, ScratchRecord, SliceRecord, SliceState
from tierzero.swapper import Swapper

__all__ = ["SliceState", "TieredStore"]


class TieredStore:
    """Slices homed in tiers, moved by a swapper, accounted per tier and kind; see the module note."""

    def __init__(self, *, tiers: dict[Tier, TierStorage], swapper: Swapper, cache: int = 0) -> None:
        """`cache`: bytes of host memory that keep NVMe-homed slices (`tiers.nvme.cache`; 0: none)."""
        for tier, storage in tiers.items():
            assert storage.tier is tier, f"the {storage.tier.value} tier was given as {tier.value}"
        self._tiers = dict(tiers)
        self.swapper = swapper
        """What moves bytes between tiers."""
        self._ledger = Ledger({tier: storage.capacity for tier, storage in tiers.items()})
        self._slices: dict[SliceKey, SliceRecord] = {}
        self._scratch: dict[int, ScratchRecord] = {}
        self._lock = threading.RLock()
        self._nvme_read = self._nvme_written = 0
        self._closed = False
        self._cache: NvmeCache | None = None
        cached = next((storage for storage in tiers.values() if storage.traits.cached), None)
        if cache and cached is not None:
            self._cache = NvmeCache(
                budget=cache, cpu=tiers[Tier.CPU], nvme=cached, swapper=swapper, ledger=self._ledger, on_evict=self._evicted
            )
        swapper.observe_staging(self._host_pool_changed)
        for storage in tiers.values():
            storage.observe_bounce(self._host_pool_changed)

    @classmethod
    def from_config(cls, tiers: TiersConfig, swapper: SwapperConfig, **where: Any) -> TieredStore:
        """The tiers `tierzero.offload.tiers.tiers_from_config(tiers, **where)` makes (`nvme`: whether
        some state is offloaded there; `run_id`: the run directory all ranks' swap files share, rank
        0's `new_run_id()` broadcast, or None for a fresh one), and a swapper from `swapper`."""
        storages = tiers_from_config(tiers, **where)
        cpu = storages[Tier.CPU]
        assert isinstance(cpu, CpuTier)
        moves = Swapper.from_config(swapper, host=cpu, host_device=isinstance(storages[Tier.DEVICE], HostDeviceTier))
        return cls(tiers=storages, swapper=moves, cache=tiers.nvme.cache)

    def _host_pool_changed(self, delta: int) -> None:
        # The swapper's staging buffers (made from the CPU tier by `from_config`) and the NVMe
        # tier's bounce blocks are both host memory: the cpu row of the report counts them.
        self._ledger.add(Tier.CPU, Kind.STAGING, Use.STAGING, delta)

    def register(self, key: SliceKey, *, numel: int, dtype: torch.dtype, home: Tier) -> None:
        """Allocate the slice's home in `home`; raises TierCapacityError (nothing spilled) when it is full."""
        if numel <= 0:
            raise ValueError(f"{key}: numel must be positive, got {numel}")
        storage = self._storage(home, what=f"{key}'s home")
        with self._lock:
            if key in self._slices:
                raise ValueError(f"{key} is already registered; unregister it first")
            region = storage.allocate(numel * dtype.itemsize, label=str(key))
            self._slices[key] = SliceRecord(key=key, numel=numel, dtype=dtype, home=region)
            self._ledger.add(home, key.kind, Use.HOME, region.nbytes)
            if self._cached(home):
                self._cache.track(key, region)

    def home_tensor(self, key: SliceKey) -> torch.Tensor:
        """The typed 1-D home of a device- or cpu-homed slice (no copy), once its pending writes have landed."""
        with self._lock:
            record = self._settled(key)
            writes = list(record.writes)
        if record.home.buffer is None:
            raise ValueError(f"{key} lives on {record.home.tier.value}, which has no tensor: fetch it to device or cpu")
        for write in writes:
            write.wait()
        return record.typed(record.home)

    def fetch(self, key: SliceKey, *, to: Tier) -> Transfer[torch.Tensor]:
        """Bring the slice to `to`; `.wait()` gives a typed 1-D tensor there. Idempotent while fetched."""
        if not self._in_memory(to):
            raise ValueError(f"cannot fetch {key} to {to.value}: fetch to device or cpu")
        with self._lock:
            record = self._settled(key)
            if record.state in FETCHED_STATES:
                if record.copy_tier is not to:
                    raise ValueError(
                        f"{key} is already fetched to {record.copy_tier.value}, asked for {to.value}: release it first"
                    )
                assert record.fetch is not None
                return record.fetch
            if record.home.tier is to or self._one_memory(record.home.tier, to):
                # The home tensor is the copy (in `to`, or in the same memory): no bytes move and none
                # are added, but a write-back still in flight (from an earlier fetch elsewhere) must land first.
                home = record.typed(record.home)
                record.fetch = record.writes[-1].then(lambda _: home) if record.writes else Transfer.ready(home)
                record.copy_tier, record.copy, record.state = to, None, SliceState.FETCHED
                return record.fetch
            record.fetch = self._read_copy(record, to)
            record.state = SliceState.FETCHING
            return record.fetch

    def _read_copy(self, record: SliceRecord, to: Tier) -> Transfer[torch.Tensor]:
        """Allocate the copy in `to` (or raise, changing nothing) and start reading the home into it."""
        copy = self._storage(to, what=f"a fetched copy of {record.key}").allocate(record.nbytes, label=f"{record.key} fetched")
        home, cache = record.home, (self._cache if self._cached(record.home.tier) else None)
        try:
            transfer = None if cache is None else cache.read(record.key, copy.buffer)
            if transfer is None:
                storage = self._tiers[home.tier]
                transfer = self.swapper.read(key=record.key, storage=storage, region=home, dst=copy.buffer, dst_tier=to)
                self._nvme_read += 0 if self._in_memory(home.tier) else record.nbytes
        except BaseException:
            self._tiers[to].free(copy)
            raise
        self._ledger.add(to, record.key.kind, Use.FETCHED, copy.nbytes)
        record.copy_tier, record.copy = to, copy
        return transfer.then(lambda _: record.typed(copy))

    def adopt(self, key: SliceKey, *, to: Tier, src: torch.Tensor | None = None) -> Transfer[torch.Tensor]:
        """A fetched copy of `key` on `to`, made from memory instead of read from the home.

        From `src`, the slice's new value just written home (the slice is at home then), or,
        without it, from the copy the caller holds on another tier, which then moves: the old
        copy goes once its transfers are done and the caller holds the new one (release it
        as usual); where both tiers are one memory (`_retier`) and no write-back reads the
        copy, the copy itself changes tier, and no byte moves. The optimizer step hands its new parameters up to the device
        this way, so that they cross the disk once, on their way home.
        """
        with self._lock:
            record = self._settled(key)
            if not self._in_memory(to) or to is record.home.tier:
                raise ValueError(f"cannot adopt a copy of {key} on {to.value}: it lives on {record.home.tier.value}")
            old, old_tier = record.copy, record.copy_tier
            if src is None:
                record.require(*FETCHED_STATES, action="move")
                if old_tier is to:
                    assert record.fetch is not None
                    return record.fetch
                # Not while a write-back still reads the copy: it would hold the new tier's bytes until it lands.
                idle = old is not None and old_tier is not None and not record.writes
                moved_copy = self._retier(old, old_tier, to) if idle else None
                if moved_copy is not None:
                    assert old is not None and old_tier is not None and record.fetch is not None
                    record.copy, record.copy_tier = moved_copy, to
                    self._ledger.add(old_tier, key.kind, Use.FETCHED, -old.nbytes)
                    self._ledger.add(to, key.kind, Use.FETCHED, old.nbytes)
                    return record.fetch  # its tensor is a view of the same buffer
                holder = old if old is not None else record.home
                assert holder.buffer is not None
                source = holder.buffer[: record.numel * record.dtype.itemsize]
                pending = [t for t in (record.fetch, *record.writes) if t is not None]
            else:
                record.require(SliceState.HOME, action="adopt a copy of")
                source, _ = record.source_bytes(src)
                old, pending = None, []
            copy = self._storage(to, what=f"a copy of {key}").allocate(record.nbytes, label=f"{key} fetched")
            try:
                moved = self.swapper.copy(key=(key, "adopt"), src=source, dst=copy.buffer[: source.numel()])
            except BaseException:
                self._tiers[to].free(copy)
                raise
            self._ledger.add(to, key.kind, Use.FETCHED, copy.nbytes)
            if old is not None:
                assert old_tier is not None
                # Before `then`: a future runs its callbacks in order, so whoever has seen the new
                # copy arrive (the step pipeline counting its group gone) finds the old one freed.
                self._free_when_done(old, old_tier, key.kind, [*pending, moved])
            record.copy_tier, record.copy, record.state = to, copy, SliceState.FETCHING
            record.fetch = moved.then(lambda _: record.typed(copy))
            record.inherited = tuple(record.writes)
            return record.fetch

    def adopt_scratch(self, key: SliceKey, *, to: Tier, scratch: torch.Tensor) -> Transfer[torch.Tensor]:
        """`adopt` from `scratch`, a tensor `allocate` made holding the slice's whole value: the
        store takes it over (the caller never frees it). In `to`'s memory, it becomes the copy
        itself; elsewhere it is copied to `to`, and freed once read."""
        with self._lock:
            record = self._settled(key)
            held = self._scratch.get(scratch.data_ptr())
            if held is None:
                raise ValueError(f"adopt_scratch of {key} was given a tensor that allocate() did not return")
            fits = record.state is SliceState.HOME and held.region.nbytes == record.nbytes and to is not record.home.tier
            copy = self._retier(held.region, held.region.tier, to) if fits else None
            if copy is not None:
                del self._scratch[scratch.data_ptr()]
                self._ledger.add(held.region.tier, held.kind, Use.SCRATCH, -copy.nbytes)
                self._ledger.add(to, key.kind, Use.FETCHED, copy.nbytes)
                record.copy_tier, record.copy, record.state = to, copy, SliceState.FETCHED
                record.fetch = Transfer.ready(record.typed(copy))
                record.inherited = tuple(record.writes)
                return record.fetch
        try:
            moved = self.adopt(key, to=to, src=scratch)
        except BaseException:
            self.free(scratch)
            raise
        moved.future.add_done_callback(lambda _: self.free(scratch))
        return moved.then(lambda value: value)  # told after the free: a waiter finds the scratch gone

    def write_back(self, key: SliceKey, src: torch.Tensor | None = None) -> Transfer[None]:
        """Copy the fetched copy, or `src` (same numel and dtype), to the home. Ordered after the key's fetch."""
        with self._lock:
            record = self._settled(key)
            if src is None:
                record.require(*FETCHED_STATES, action="write back")
                if record.copy is None:
                    return Transfer.ready()
                source, source_tier = record.copy.buffer, record.copy_tier
            else:
                source, source_tier = record.source_bytes(src)
            assert source is not None and source_tier is not None
            cache = self._cache if self._cached(record.home.tier) else None
            transfer = None if cache is None else cache.write(key, source)
            if transfer is None:
                transfer = self.swapper.write(
                    key=key, storage=self._tiers[record.home.tier], region=record.home, src=source, src_tier=source_tier
                )
                self._nvme_written += 0 if self._in_memory(record.home.tier) else record.nbytes
            record.writes.append(transfer)
            if record.state is not SliceState.HOME:
                record.state = SliceState.WRITING
            return transfer

    def release(self, key: SliceKey) -> None:
        """Drop the fetched copy; its memory goes once its transfers are done (module note)."""
        with self._lock:
            record = self._settled(key)
            record.require(*FETCHED_STATES, action="release")
            own = [w for w in record.writes if not any(w is old for old in record.inherited)]
            copy, tier, pending = record.copy, record.copy_tier, [record.fetch, *own]
            record.state, record.copy, record.copy_tier, record.fetch = SliceState.HOME, None, None, None
            record.inherited = ()
        if copy is not None:
            assert tier is not None
            self._free_when_done(copy, tier, key.kind, [t for t in pending if t is not None])

    def unregister(self, key: SliceKey) -> None:
        """Forget a slice that is not fetched, after its pending writes, and free its home."""
        with self._lock:
            record = self._settled(key)
            record.require(SliceState.HOME, action="unregister")
            del self._slices[key]
            if self._cached(record.home.tier):
                self._cache.forget(key)
        for write in record.writes:
            write.future.exception()
        self._tiers[record.home.tier].free(record.home)
        self._ledger.add(record.home.tier, key.kind, Use.HOME, -record.nbytes)

    def rehome(self, key: SliceKey, *, to: Tier) -> None:
        """Move an unfetched slice's home to the memory tier `to`, bit for bit, after its pending writes (one
        memory: the region changes tier, no byte moves); TierCapacityError, changing nothing, when `to` is full."""
        record = self._record(key)
        for write in list(record.writes):
            write.wait()
        with self._lock:
            record.settle()
            record.require(SliceState.HOME, action="move the home of")  # a fetched copy would read the old home
            old = record.home
            assert self._in_memory(old.tier) and self._in_memory(to), f"{key}: homes move between memory tiers only"
            new = old if old.tier is to else self._retier(old, old.tier, to)
            if new is None:
                new = self._storage(to, what=f"the home of {key}").allocate(old.nbytes, label=str(key))
                new.buffer.copy_(old.buffer)  # type: ignore[union-attr]  # memory tiers' regions are tensors
                self._tiers[old.tier].free(old)
            record.home = new
            self._ledger.add(old.tier, key.kind, Use.HOME, -old.nbytes)
            self._ledger.add(to, key.kind, Use.HOME, new.nbytes)

    def state(self, key: SliceKey) -> SliceState:
        with self._lock:
            return self._settled(key).state

    def at_home(self, key: SliceKey) -> bool:
        """Whether only the home copy of `key` exists (nobody holds a fetched copy)."""
        return self.state(key) is SliceState.HOME

    def fetched_in_place(self, key: SliceKey) -> bool:
        with self._lock:
            return self._record(key).fetched_in_place

    def allocate(self, *, kind: Kind, numel: int, dtype: torch.dtype, tier: Tier, label: str = "") -> torch.Tensor:
        """Scratch memory (e.g. a gathered unit) in a memory tier, accounted under `kind` until `free`."""
        if not self._in_memory(tier):
            raise ValueError(f"scratch {label or kind.value} must be in device or cpu memory, got {tier.value}")
        if numel <= 0:
            raise ValueError(f"scratch {label or kind.value}: numel must be positive, got {numel}")
        region = self._storage(tier, what=f"scratch {label}").allocate(
            numel * dtype.itemsize, label=label or f"scratch {kind.value}"
        )
        assert region.buffer is not None
        tensor = region.buffer.view(dtype)[:numel]
        with self._lock:
            self._scratch[tensor.data_ptr()] = ScratchRecord(kind=kind, region=region)
        self._ledger.add(tier, kind, Use.SCRATCH, region.nbytes)
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        with self._lock:
            record = self._scratch.pop(tensor.data_ptr(), None)
        if record is None:
            raise ValueError("free() was given a tensor that allocate() did not return (or that was freed already)")
        self._tiers[record.region.tier].free(record.region)
        self._ledger.add(record.region.tier, record.kind, Use.SCRATCH, -record.region.nbytes)

    def book(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        self._ledger.add(tier, kind, Use.SCRATCH, nbytes)

    def report(self) -> StoreReport:
        bounce = next((stats for storage in self._tiers.values() if (stats := storage.bounce_stats()) is not None), None)
        report = self._ledger.report(staging=self.swapper.stats(), bounce=bounce)
        for tier, storage in self._tiers.items():
            kept = storage.kept_bytes
            if kept and tier in report.tiers:
                report.tiers[tier] = dataclasses.replace(report.tiers[tier], kept=kept)
        return report

    def nvme_traffic(self) -> tuple[int, int]:
        """Bytes of NVMe-homed slices read from and written to the disk so far, counted as each move is
        asked for: a cached slice's fetch and write-back are not, its eviction is."""
        with self._lock:
            return self._nvme_read, self._nvme_written

    def nvme_busy(self) -> Busy:
        """The NVMe tier's moves so far and the time they were in flight (offload/busy.py); none without one."""
        return next((storage.busy_now() for storage in self._tiers.values() if not storage.traits.in_memory), Busy())

    def reset_peaks(self) -> None:
        self._ledger.reset_peaks()

    def kind_bytes(self) -> dict[Kind, int]:
        """Bytes of each model-state kind in their homes, all tiers together (fetched copies excluded)."""
        nbytes = self._ledger.home_bytes(KEPT_KINDS)
        return {kind: nbytes[kind] for kind in shown_kinds(nbytes)}  # SECONDARY only with hpZ

    def close(self) -> None:
        """Finish every transfer, free every region, close swapper and tiers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.swapper.close()
        with self._lock:
            records, scratch = list(self._slices.values()), list(self._scratch.values())
            self._slices.clear()
            self._scratch.clear()
        if self._cache is not None:
            self._cache.close()
        for record in records:
            if record.copy is not None:
                self._tiers[record.copy.tier].free(record.copy)
            self._tiers[record.home.tier].free(record.home)
        for item in scratch:
            self._tiers[item.region.tier].free(item.region)
        for storage in self._tiers.values():
            storage.close()

    def __enter__(self) -> TieredStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _evicted(self, key: SliceKey, write: Transfer[None]) -> None:
        """A cached slice left the cache: its entry is on its way to the disk (called under the lock)."""
        record = self._slices[key]
        record.writes.append(write)
        self._nvme_written += record.nbytes

    def _record(self, key: SliceKey) -> SliceRecord:
        record = self._slices.get(key)
        if record is None:
            raise ValueError(f"{key} is not registered in the store")
        return record

    def _settled(self, key: SliceKey) -> SliceRecord:
        """The slice's record with its finished transfers taken in (under the lock)."""
        record = self._record(key)
        record.settle()
        return record

    def _storage(self, tier: Tier, *, what: str) -> TierStorage:
        storage = self._tiers.get(tier)
        if storage is None:
            present = ", ".join(t.value for t in self._tiers)
            raise ValueError(f"{what} needs the {tier.value} tier, but this store has only {present}: configure tiers.{tier.value}")
        return storage

    def _in_memory(self, tier: Tier) -> bool:
        """Whether `tier`'s regions are tensors (its `TierTraits`), asked of the tier itself where the
        store has it."""
        storage = self._tiers.get(tier)
        return (storage.traits if storage is not None else traits_of(tier)).in_memory

    def _cached(self, tier: Tier) -> bool:
        """Whether slices homed on `tier` go through the host cache in front of it."""
        return self._cache is not None and not self._in_memory(tier) and self._tiers[tier].traits.cached

    def _one_memory(self, a: Tier, b: Tier) -> bool:
        """Whether tiers `a` and `b` are one memory (without a GPU the device tier is host memory)."""
        first = self._tiers.get(a)
        return isinstance(first, MemoryTier) and first.same_memory(self._tiers.get(b))

    def _retier(self, region: Region, tier: Tier, to: Tier) -> Region | None:
        """`region` as a region of `to` without a copy where both are one memory, else None; the caller books it."""
        if not self._one_memory(tier, to):
            return None
        source, target = self._tiers[tier], self._tiers[to]
        assert isinstance(source, MemoryTier) and isinstance(target, MemoryTier)
        return source.hand_over(region, target)

    def _free_when_done(self, copy: Region, tier: Tier, kind: Kind, pending: list[Transfer]) -> None:
        """Free the copy once every transfer in `pending` has finished (in whichever thread ends last)."""

        def free_copy() -> None:
            self._tiers[tier].free(copy)
            self._ledger.add(tier, kind, Use.FETCHED, -copy.nbytes)

        after_all(pending, free_copy)
