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
  cache. Residents go fewest reads first, among equals the one longest at its count
  first, and only when they free enough bytes; otherwise nothing moves and the slice
  goes to disk. A resident not written since it entered (a frozen slice, or one whose
  first cycle is not over) has no count yet and stays. The residents' bytes are kept
  per count, and the residents of each count in the order they reached it, so a write
  is decided without looking at every resident.
- So slices read equally often (the usual case: once a step) never displace each other
  and the set stays the one set-up filled; slices read more often, e.g. stage-3
  parameters gathered twice a step from the disk, take the place of slices read less,
  e.g. parameters a step hands up without a read, and then stay.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from tierzero.common.slices import SliceKey

__all__ = ["Admission", "CachePolicy"]


@dataclass(slots=True, kw_only=True)
class _Slot:
    key: SliceKey
    nbytes: int
    reads: int = 0
    """Reads since the last write."""
    last: int | None = None
    """Reads in the last cycle (between the last two writes); None before the second write."""
    written: bool = False
    cached: bool = False

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
        self._by_score: defaultdict[int, dict[SliceKey, _Slot]] = defaultdict(dict)
        """The residents with each score, in the order they reached it (those without one stay)."""
        self._scored_bytes: defaultdict[int, int] = defaultdict(int)

    def track(self, key: SliceKey, nbytes: int) -> None:
        assert key not in self._slots, f"{key} is tracked already"
        self._slots[key] = _Slot(key=key, nbytes=nbytes)

    def forget(self, key: SliceKey) -> bool:
        """Stop tracking `key`; whether it was cached (its entry is dropped, not written)."""
        slot = self._slots.pop(key)
        cached = slot.cached
        if cached:
            self._leave(slot)
        return cached

    def cached(self, key: SliceKey) -> bool:
        return self._slots[key].cached

    def read(self, key: SliceKey) -> bool:
        """Count a read of `key`; whether it is a hit (served from the cache)."""
        slot = self._slots[key]
        self._rescore(slot, reads=slot.reads + 1, last=slot.last)
        return slot.cached

    def write(self, key: SliceKey) -> Admission:
        """Count a write of `key` and decide where it goes."""
        slot = self._slots[key]
        completed = slot.reads if slot.written else None
        # A newcomer's reads per cycle: the fewer of its last two cycles' (of the one, early on).
        proven = completed if completed is None or slot.last is None else min(completed, slot.last)
        slot.written = True
        self._rescore(slot, reads=0, last=completed)
        if slot.cached:
            return Admission(cached=True, entered=False)
        victims = self._victims(slot.nbytes, proven)
        if victims is None:
            return Admission(cached=False, entered=False)
        for victim in victims:
            self._leave(self._slots[victim])
        slot.cached = True
        self.used += slot.nbytes
        self._file(slot, slot.score())
        return Admission(cached=True, entered=True, evicted=tuple(victims))

    def _victims(self, nbytes: int, score: int | None) -> list[SliceKey] | None:
        """Residents to evict so that `nbytes` fit (lowest scores first), or None."""
        if nbytes > self.budget:
            return None
        need = self.used + nbytes - self.budget
        if need <= 0:
            return []
        lower = sorted(s for s, n in self._scored_bytes.items() if n and score is not None and s < score)
        if sum(self._scored_bytes[s] for s in lower) < need:
            return None
        victims, freed = [], 0
        for s in lower:
            for key, slot in self._by_score[s].items():
                victims.append(key)
                freed += slot.nbytes
                if freed >= need:
                    return victims
        raise AssertionError("the residents' bytes by score are out of step with the residents")

    def _leave(self, slot: _Slot) -> None:
        self._unfile(slot, slot.score())
        slot.cached = False
        self.used -= slot.nbytes

    def _rescore(self, slot: _Slot, *, reads: int, last: int | None) -> None:
        before = slot.score()
        slot.reads, slot.last = reads, last
        after = slot.score()
        if slot.cached and before != after:
            self._unfile(slot, before)
            self._file(slot, after)

    def _file(self, slot: _Slot, score: int | None) -> None:
        if score is not None:
            self._by_score[score][slot.key] = slot
            self._scored_bytes[score] += slot.nbytes

    def _unfile(self, slot: _Slot, score: int | None) -> None:
        if score is not None:
            del self._by_score[score][slot.key]
            self._scored_bytes[score] -= slot.nbytes
