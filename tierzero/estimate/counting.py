"""A store that only counts bytes: the `SliceStore` the estimator runs the engine against.

Its tensors live on the meta device (shapes, no memory), and it books every home,
fetched copy and scratch buffer in the same `Ledger` the real store keeps, so the
engine's own stage, prefetcher and step pipeline decide what is held when, and this
store only says how much. What it models of the mechanism below the store:

- A read lands at once, so the prefetcher is as far ahead as its budgets allow: the
  most device memory prefetched slices can take.
- A write lands only when someone waits for it (the step pipeline making room, the
  next step landing the last one, a slice's own `wait()`): a write-back holds its
  copy, and its bounce blocks, as long as the engine lets it, which bounds a run's
  memory from above. With `lands_when_asked` it lands as soon as anyone asks whether
  it has landed: the engine's choices that depend on it (whether the step pipeline has
  room for a handed-down copy) then go as on a disk that keeps up, which gives the
  traffic of a run whose disk does (estimate/dry_run.py replays both ways).
- Device<->NVMe moves on a GPU pass through the swapper's staging pool, which keeps
  the buffers it made; NVMe writes from host memory the store did not allocate (the
  first value of a slice, a published compute-dtype shard) pass through the NVMe
  tier's bounce blocks, which it keeps too and which count against no capacity.
- With `tiers.nvme.cache`, the real store's own `CachePolicy` decides which NVMe-homed
  slices are cached, so the NVMe bytes follow the real cache's exactly. A cached slice's
  fetch and write-back are memory copies: no disk bytes, staging or bounce blocks. An
  entry counts in the cpu tier from its first write until its eviction, whose disk write
  the real store waits for before it makes the entry that takes its place.
"""

from __future__ import annotations

import math
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from tierzero.common.slices import KEPT_KINDS, Kind, SliceKey, Tier, shown_kinds, storage_id
from tierzero.common.transfer import Transfer, TransferOutcome
from tierzero.config import SwapperConfig, TiersConfig
from tierzero.offload.staging import StagingStats
from tierzero.store import StoreReport, Use
from tierzero.store.cache_policy import CachePolicy
from tierzero.store.ledger import Ledger

__all__ = ["CountingStore", "Traffic"]


@dataclass(slots=True)
class Traffic:
    """What one part of a step moved: NVMe bytes read and written, host memory bytes copied, and
    the elements the optimizer stepped (counted by the dry run)."""

    read: int = 0
    written: int = 0
    copied: int = 0
    stepped: int = 0
    by_unit: dict[str, list[int]] = field(default_factory=dict)
    """NVMe bytes [read, written] by the unit whose slice moved."""

    def merged(self, other: Traffic) -> Traffic:
        """Both parts' traffic as one's."""
        by_unit = {unit: list(counts) for unit, counts in self.by_unit.items()}
        for unit, (read, written) in other.by_unit.items():
            counts = by_unit.setdefault(unit, [0, 0])
            counts[0], counts[1] = counts[0] + read, counts[1] + written
        return Traffic(
            read=self.read + other.read, written=self.written + other.written, copied=self.copied + other.copied,
            stepped=self.stepped + other.stepped, by_unit=by_unit,
        )  # fmt: skip


class _LandsWhenWaited(Future):
    """A write that lands when it is waited for (see the module note)."""

    def result(self, timeout: float | None = None) -> TransferOutcome:
        self._land()
        return super().result(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._land()
        return super().exception(timeout)

    def _land(self) -> None:
        if not super().done():
            self.set_result(TransferOutcome())


class _LandsWhenAsked(_LandsWhenWaited):
    """A write that lands when it is waited for or asked about (see the module note)."""

    def done(self) -> bool:
        self._land()
        return True


@dataclass(slots=True, kw_only=True)
class _Slice:
    key: SliceKey
    numel: int
    dtype: torch.dtype
    home: Tier
    copy_tier: Tier | None = None
    """Where the slice is fetched to; None while only the home exists."""
    fetched: Transfer[torch.Tensor] | None = None
    home_tensor: torch.Tensor | None = None
    writes: list[Future] = field(default_factory=list)
    inherited: tuple[Future, ...] = ()
    """Writes from a copy `adopt` moved away, which the copy now held does not wait for."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def tensor(self) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.dtype, device="meta")


class CountingStore:
    """Books what a `TieredStore` built from the same sections would hold; moves nothing."""

    def __init__(
        self, tiers: TiersConfig, swapper: SwapperConfig, *, cuda: bool, lands_when_asked: bool = False
    ) -> None:
        self._ledger = Ledger({Tier.DEVICE: tiers.device.capacity, Tier.CPU: tiers.cpu.capacity, Tier.NVME: None})
        self._nvme, self._swapper, self._cuda = tiers.nvme, swapper, cuda
        self._lands_when_asked = lands_when_asked
        self._slices: dict[SliceKey, _Slice] = {}
        self._scratch: dict[int, tuple[Tier, Kind, int]] = {}
        self._use_now: Counter[tuple[Tier, str]] = Counter()
        self.working: dict[Tier, Counter[str]] = {tier: Counter() for tier in Tier}
        """Peak bytes per tier by use: home, fetched, gathered, scratch, staging, bounce."""
        self._staging = 0
        self._bounce_chunks = 0
        self.bounce = 0
        """Bytes of bounce blocks the NVMe tier keeps (host memory outside any capacity)."""
        self.nvme_read = self.nvme_written = 0
        self.memory_copied = 0
        """Bytes copied between the device and cpu tiers (fetches, write-backs, adopted copies), and
        without a GPU into gathered buffers: host memory traffic besides the compute's."""
        self.phase = "set-up"
        """The part of the step under way, as `micro_step` marks it: its traffic is counted in `by_phase` too."""
        self.by_phase: dict[str, Traffic] = {}
        self.by_slice: dict[SliceKey, list[int]] = {}
        """NVMe bytes [read, written], by slice."""
        self.evictions = 0
        """Slices the NVMe cache evicted since the last `reset_traffic`."""
        self.grads_in_place = 0
        """Bytes of gradients a step took as autograd left them (booked as GRAD scratch,
        [Note: gradient pieces]) since the last `reset_traffic`: they skip the landing pass."""
        self._cache = CachePolicy(tiers.nvme.cache) if tiers.nvme.cache else None

    # ---- the SliceStore protocol ----------------------------------------------------

    def register(self, key: SliceKey, *, numel: int, dtype: torch.dtype, home: Tier) -> None:
        if key in self._slices:
            raise ValueError(f"{key} is already registered; unregister it first")
        record = self._slices[key] = _Slice(key=key, numel=numel, dtype=dtype, home=home)
        if home is not Tier.NVME:
            record.home_tensor = record.tensor()
        elif self._cache is not None:
            self._cache.track(key, record.nbytes)
        self._add(home, key.kind, Use.HOME, record.nbytes, "home")

    def home_tensor(self, key: SliceKey) -> torch.Tensor:
        record = self._slices[key]
        if record.home_tensor is None:
            raise ValueError(f"{key} lives on nvme, which has no tensor: fetch it to device or cpu")
        for write in list(record.writes):
            write.result()
        return record.home_tensor

    def fetch(self, key: SliceKey, *, to: Tier) -> Transfer[torch.Tensor]:
        record = self._slices[key]
        if record.fetched is not None:
            if record.copy_tier is not to:
                raise ValueError(f"{key} is already fetched to {record.copy_tier}, asked for {to.value}: release it first")
            return record.fetched
        record.copy_tier = to
        if self._home_is_copy(record):
            assert record.home_tensor is not None
            record.fetched = Transfer.ready(record.home_tensor)
        else:
            self._add(to, key.kind, Use.FETCHED, record.nbytes, "fetched")
            hit = record.home is Tier.NVME and self._cache is not None and self._cache.read(key)
            if hit:  # a cached slice comes up from host memory: no disk bytes, no staging
                self._move(Tier.CPU, to, record.nbytes)
            else:
                if record.home is Tier.NVME:
                    self._count(read=record.nbytes, key=key)
                self._move(record.home, to, record.nbytes)
            record.fetched = Transfer.ready(record.tensor())
        for write in list(record.writes):
            write.result()  # a read is ordered after the key's pending writes
        return record.fetched

    def adopt(self, key: SliceKey, *, to: Tier, src: torch.Tensor | None = None) -> Transfer[torch.Tensor]:
        record = self._slices[key]
        if to is record.home:
            raise ValueError(f"{key} lives on {to.value}: fetch it there instead")
        source = record.copy_tier if src is None else (Tier.DEVICE if self._cuda else Tier.CPU)
        if src is None:
            if record.fetched is None:
                raise ValueError(f"cannot move {key}: it is not fetched")
            if record.copy_tier is to:
                return record.fetched
            if not self._cuda and not self._home_is_copy(record) and not record.writes:
                # One memory without a GPU: the copy changes tier, no byte moves (`TieredStore._retier`).
                assert record.copy_tier is not None
                self._add(record.copy_tier, key.kind, Use.FETCHED, -record.nbytes, "fetched")
                self._add(to, key.kind, Use.FETCHED, record.nbytes, "fetched")
                record.copy_tier = to
                return record.fetched
            self.release(key)  # the old copy goes once its writes land, as a release's
        elif record.fetched is not None:
            raise ValueError(f"cannot adopt a copy of {key}: it is fetched to {record.copy_tier}")
        record.copy_tier, record.inherited = to, tuple(record.writes)
        if source is not None:
            self._move(source, to, record.nbytes)
        self._add(to, key.kind, Use.FETCHED, record.nbytes, "fetched")
        record.fetched = Transfer.ready(record.tensor())
        return record.fetched

    def adopt_scratch(self, key: SliceKey, *, to: Tier, scratch: torch.Tensor) -> Transfer[torch.Tensor]:
        tier, kind, nbytes = self._scratch[storage_id(scratch)]
        record = self._slices[key]
        if self._cuda or nbytes != record.nbytes or record.fetched is not None or to is record.home:
            moved = self.adopt(key, to=to, src=scratch)
            self.free(scratch)  # read once the copy is done, which a counted copy is at once
            return moved
        del self._scratch[storage_id(scratch)]
        self._add(tier, kind, Use.SCRATCH, -nbytes, "gathered" if kind is Kind.GATHERED else "scratch")
        self._add(to, key.kind, Use.FETCHED, nbytes, "fetched")
        record.copy_tier, record.inherited = to, tuple(record.writes)
        record.fetched = Transfer.ready(record.tensor())
        return record.fetched

    def write_back(self, key: SliceKey, src: torch.Tensor | None = None) -> Transfer[None]:
        record = self._slices[key]
        if src is None and (record.fetched is None or self._home_is_copy(record)):
            return Transfer.ready()
        # A source the caller made (a slice's first value, a published shard) is taken to be
        # on the GPU where there is one: it is staged there, and bounced without one.
        source = record.copy_tier if src is None else (Tier.DEVICE if self._cuda else record.copy_tier or Tier.CPU)
        assert source is not None
        if record.home is not Tier.NVME and source is not record.home:
            self._move(source, record.home, record.nbytes)
        write = _LandsWhenAsked() if self._lands_when_asked else _LandsWhenWaited()
        if record.home is Tier.NVME and not self._cached_write(record):
            self._count(written=record.nbytes, key=key)
            self._move(source, Tier.NVME, record.nbytes)
            if src is not None and not self._cuda:
                self._bounce(write, record.nbytes)
        record.writes.append(write)
        write.add_done_callback(lambda done: record.writes.remove(done))
        return Transfer(write)

    def release(self, key: SliceKey) -> None:
        record = self._slices[key]
        if record.fetched is None:
            raise ValueError(f"cannot release {key}: it is not fetched")
        home_copy = self._home_is_copy(record)
        tier, record.copy_tier, record.fetched = record.copy_tier, None, None
        if home_copy:
            return
        assert tier is not None
        pending = [w for w in record.writes if not any(w is old for old in record.inherited)]
        record.inherited = ()
        left = [len(pending)]

        def free(_: object = None) -> None:
            left[0] -= 1
            if left[0] <= 0:
                self._add(tier, key.kind, Use.FETCHED, -record.nbytes, "fetched")

        if not pending:
            free()
        for write in pending:
            write.add_done_callback(free)

    def at_home(self, key: SliceKey) -> bool:
        return self._slices[key].fetched is None

    def fetched_in_place(self, key: SliceKey) -> bool:
        record = self._slices[key]
        return record.fetched is not None and self._home_is_copy(record)

    def allocate(self, *, kind: Kind, numel: int, dtype: torch.dtype, tier: Tier, label: str = "") -> torch.Tensor:
        if tier is Tier.NVME:
            raise ValueError(f"scratch {label or kind.value} must be in device or cpu memory, got nvme")
        tensor = torch.empty(numel, dtype=dtype, device="meta")
        self._scratch[storage_id(tensor)] = (tier, kind, tensor.nbytes)
        self._add(tier, kind, Use.SCRATCH, tensor.nbytes, "gathered" if kind is Kind.GATHERED else "scratch")
        if kind is Kind.GATHERED and not self._cuda:
            self._count(copied=tensor.nbytes)  # the gather's copy into it is host memory traffic too
        return tensor

    def free(self, tensor: torch.Tensor) -> None:
        tier, kind, nbytes = self._scratch.pop(storage_id(tensor))
        self._add(tier, kind, Use.SCRATCH, -nbytes, "gathered" if kind is Kind.GATHERED else "scratch")

    def book(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        if kind is Kind.GRAD:
            self.grads_in_place += max(nbytes, 0)
        self._add(tier, kind, Use.SCRATCH, nbytes, "scratch" if kind is Kind.GRAD else "activations")

    def kind_bytes(self) -> dict[Kind, int]:
        nbytes = self._ledger.home_bytes(KEPT_KINDS)
        return {kind: nbytes[kind] for kind in shown_kinds(nbytes)}  # SECONDARY only with hpZ

    def report(self) -> StoreReport:
        size, count = self._swapper.buffer_size, self._swapper.buffer_count
        staging = StagingStats(
            buffer_size=size, buffer_count=count, held=self._staging, peak_held=self._staging, in_use=0, peak_in_use=0
        )
        return self._ledger.report(staging=staging)

    def close(self) -> None:
        for record in self._slices.values():
            for write in list(record.writes):
                write.result()

    # ---- counting -------------------------------------------------------------------

    def _home_is_copy(self, record: _Slice) -> bool:
        """Whether the slice's fetched copy is its home tensor: fetched to the home tier, or without
        a GPU to the other memory tier (`TieredStore.fetch`)."""
        tiers = {record.home, record.copy_tier}
        return record.copy_tier is record.home or (not self._cuda and tiers == {Tier.DEVICE, Tier.CPU})

    def _cached_write(self, record: _Slice) -> bool:
        """Ask the cache where a write of `record` goes; book its entry and count its evictions."""
        if self._cache is None:
            return False
        admission = self._cache.write(record.key)
        for victim in admission.evicted:
            self._count(written=self._slices[victim].nbytes, key=victim)
            self.evictions += 1
            self._add(Tier.CPU, victim.kind, Use.CACHE, -self._slices[victim].nbytes, "cache")
        if admission.entered:
            self._add(Tier.CPU, record.key.kind, Use.CACHE, record.nbytes, "cache")
        return admission.cached

    def reset_traffic(self) -> None:
        self.nvme_read = self.nvme_written = self.memory_copied = self.evictions = self.grads_in_place = 0
        self.by_slice, self.by_phase = {}, {}

    def mark(self, phase: str) -> None:
        """Count what follows in `phase` (`micro_step`'s marks)."""
        self.phase = phase

    def copied(self, nbytes: int) -> None:
        """Count host memory traffic the store does not see (the gradients' landing, without a GPU)."""
        self._count(copied=nbytes)

    def stepped(self, numel: int) -> None:
        """Count elements the optimizer stepped in the phase under way."""
        self.by_phase.setdefault(self.phase, Traffic()).stepped += numel

    def _count(self, *, read: int = 0, written: int = 0, copied: int = 0, key: SliceKey | None = None) -> None:
        """Add traffic to the totals, to the phase under way and, for NVMe bytes, to the slice's."""
        self.nvme_read += read
        self.nvme_written += written
        self.memory_copied += copied
        phase = self.by_phase.setdefault(self.phase, Traffic())
        phase.read, phase.written, phase.copied = phase.read + read, phase.written + written, phase.copied + copied
        if key is not None:
            for counts in (self.by_slice.setdefault(key, [0, 0]), phase.by_unit.setdefault(key.unit, [0, 0])):
                counts[0], counts[1] = counts[0] + read, counts[1] + written

    def _add(self, tier: Tier, kind: Kind, use: Use, delta: int, label: str) -> None:
        self._ledger.add(tier, kind, use, delta)
        self._use_now[tier, label] += delta
        self.working[tier][label] = max(self.working[tier][label], self._use_now[tier, label])

    def _move(self, a: Tier, b: Tier, nbytes: int) -> None:
        """Counts device<->cpu copies. A device<->NVMe move on a GPU passes through the staging
        pool, which keeps what it made."""
        if {a, b} == {Tier.DEVICE, Tier.CPU}:
            self._count(copied=nbytes)
        if not self._cuda or {a, b} != {Tier.DEVICE, Tier.NVME}:
            return
        size, count = self._swapper.buffer_size, self._swapper.buffer_count
        need = min(count, math.ceil(nbytes / size)) * size
        if need > self._staging:
            self._add(Tier.CPU, Kind.STAGING, Use.STAGING, need - self._staging, "staging")
            self._staging = need

    def _bounce(self, write: Future, nbytes: int) -> None:
        """The NVMe tier copies an unaligned source through its bounce blocks, up to `queue_depth`
        of them at once, and keeps the blocks it made."""
        chunks = math.ceil(nbytes / self._nvme.block_size)
        self._bounce_chunks += chunks
        need = min(self._nvme.queue_depth, self._bounce_chunks) * self._nvme.block_size
        if need > self.bounce:
            self._add(Tier.CPU, Kind.STAGING, Use.STAGING, need - self.bounce, "bounce")
            self.bounce = need

        def landed(_: object) -> None:
            self._bounce_chunks -= chunks

        write.add_done_callback(landed)
