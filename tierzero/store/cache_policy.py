"""Which NVMe-homed slices the host cache keeps (`tiers.nvme.cache`): the policy, no bytes.

Both stores ask the same `CachePolicy`: `TieredStore` moves the bytes it decides on
(store/nvme_cache.py), the estimator's `CountingStore` only counts them, so the
estimate's NVMe traffic follows the real cache exactly.

[Note: cache policy]
Every NVMe-homed slice is read and written in the same cyclic order each step. Recency
policies fail on that pattern: LRU or FIFO evicts each slice just before its next use,
so a cache smaller than the slices hits nothing. This one keeps a stable set:

- A slice enters only when it is written: the new value goes to memory instead of the
  disk. An entry is therefore always newer than its home, and leaving costs a disk write.
- While the budget has room, the slice written enters; the slices first written (at
  set-up, in the engine's unit order) fill it.
- Once it is full, a slice enters only in place of residents read fewer times per
  write: the disk reads keeping it saves per step beyond its write. A *cycle* is the
  reads between two writes of a slice. The slice written must have been read more in
  each of its last two cycles (in its only one, early in a run) than a resident in its
  last cycle or in the one under way: a newcomer proves itself twice, a resident once,
  so a one-off read (a checkpoint reads every slice once) moves nothing in a settled
  cache. Residents go fewest reads first, oldest first among equals, and only when
  they free enough bytes; otherwise nothing moves and the slice goes to disk. A
  resident not written since it entered (a frozen slice, or one whose first cycle is
  not over) has no count yet and stays.
- So slices read equally often (the usual case: once a step) never displace each other
  and the set stays the one set-up filled; slices read more often, e.g. stage-3
  parameters gathered twice a step from the disk, take the place of slices read less,
  e.g. parameters a step hands up without a read, and then stay.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tierzero.slices import SliceKey

__all__ = ["Admission", "CachePolicy"]


@dataclass(slots=True, kw_only=True)
class _Slot:
    nbytes: int
    reads: int = 0
    """Reads since the last write."""
    last: int | None = None
    """Reads in the last cycle (between the last two writes); None before the second write."""
    written: bool = False
    since: int | None = None
    """When the slice entered the cache (a running count); None while it is not cached."""

    def score(self) -> int | None:
        """A resident's reads per cycle: the more of its last cycle's and the current one's."""
        return None if self.last is None else max(self.last, self.reads)


@dataclass(frozen=True, slots=True)
class Admission:
    """What a write of one slice does to the cache."""

    cached: bool
    """The write goes to the slice's cache entry, not to the disk."""
    entered: bool
    """The slice entered the cache with this write: its entry is new."""
    evicted: tuple[SliceKey, ...] = ()
    """Residents that left to make room, each to be written home from its entry."""


class CachePolicy:
    """Entries of at most `budget` bytes of NVMe-homed slices; see [Note: cache policy]."""

    def __init__(self, budget: int) -> None:
        if budget <= 0:
            raise ValueError(f"a cache budget must be positive, got {budget} bytes")
        self.budget = budget
        self.used = 0
        """Bytes of the slices cached now."""
        self._slots: dict[SliceKey, _Slot] = {}
        self._scored: Counter[int] = Counter()
        """Bytes of the residents with each score (residents without one are never displaced), so
        that a write which cannot displace enough is refused without looking at every slice."""
        self._entered = 0

    def track(self, key: SliceKey, nbytes: int) -> None:
        assert key not in self._slots, f"{key} is tracked already"
        self._slots[key] = _Slot(nbytes=nbytes)

    def forget(self, key: SliceKey) -> bool:
        """Stop tracking `key`; whether it was cached (its entry is dropped, not written)."""
        slot = self._slots[key]
        cached = slot.since is not None
        if cached:
            self._leave(slot)
        del self._slots[key]
        return cached

    def cached(self, key: SliceKey) -> bool:
        return self._slots[key].since is not None

    def read(self, key: SliceKey) -> bool:
        """Count a read of `key`; whether it is a hit (served from the cache)."""
        slot = self._slots[key]
        self._rescore(slot, reads=slot.reads + 1, last=slot.last)
        return slot.since is not None

    def write(self, key: SliceKey) -> Admission:
        """Count a write of `key` and decide where it goes."""
        slot = self._slots[key]
        completed = slot.reads if slot.written else None
        # A newcomer's reads per cycle: the fewer of its last two cycles' (of the one, early on).
        proven = completed if completed is None or slot.last is None else min(completed, slot.last)
        slot.written = True
        self._rescore(slot, reads=0, last=completed)
        if slot.since is not None:
            return Admission(cached=True, entered=False)
        victims = self._victims(slot.nbytes, proven)
        if victims is None:
            return Admission(cached=False, entered=False)
        for victim in victims:
            self._leave(self._slots[victim])
        self._entered += 1
        slot.since = self._entered
        self.used += slot.nbytes
        if (score := slot.score()) is not None:
            self._scored[score] += slot.nbytes
        return Admission(cached=True, entered=True, evicted=tuple(victims))

    def _victims(self, nbytes: int, score: int | None) -> list[SliceKey] | None:
        """Residents to evict so that `nbytes` fit (oldest of the lowest scores first), or None."""
        if nbytes > self.budget:
            return None
        need = self.used + nbytes - self.budget
        if need <= 0:
            return []
        if score is None or sum(n for s, n in self._scored.items() if s < score) < need:
            return None
        lower = sorted(
            (s, slot.since, key)
            for key, slot in self._slots.items()
            if slot.since is not None and (s := slot.score()) is not None and s < score
        )
        victims, freed = [], 0
        for _, _, key in lower:
            victims.append(key)
            freed += self._slots[key].nbytes
            if freed >= need:
                break
        assert freed >= need, "the residents' bytes by score are out of step with the residents"
        return victims

    def _leave(self, slot: _Slot) -> None:
        if (score := slot.score()) is not None:
            self._scored[score] -= slot.nbytes
        slot.since = None
        self.used -= slot.nbytes

    def _rescore(self, slot: _Slot, *, reads: int, last: int | None) -> None:
        before = slot.score()
        slot.reads, slot.last = reads, last
        after = slot.score()
        if slot.since is None or before == after:
            return
        if before is not None:
            self._scored[before] -= slot.nbytes
        if after is not None:
            self._scored[after] += slot.nbytes
