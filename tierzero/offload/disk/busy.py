"""How long a disk had reads or writes in flight, and the bytes they moved.

A step's swaps read and write at once, and a disk shares its bandwidth between the two: the
2B auto step on the 2-core VM read 10.9 GB in 5.9 s of reads in flight and wrote 10.9 GB in
4.6 s of writes in flight, with the disk busy either way 6.8 s, not 10.5 (docs/benchmarks-journal.md,
session 17). So `BusyClock` keeps three clocks, one a way and one for either, each running
while at least one move of its kind is in flight, and `Busy.rates` turns them into rates that
count the overlap. The NvmeTier's clock, read over a training run's steps, gives the planner
the disk's rates as a step finds them (placement/disk.py `learn`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

__all__ = ["Busy", "BusyClock"]


@dataclass(frozen=True, slots=True)
class Busy:
    """Bytes read and written and the seconds with a read, a write, or either in flight."""

    read_bytes: int = 0
    read_s: float = 0.0
    write_bytes: int = 0
    write_s: float = 0.0
    any_s: float = 0.0

    def __sub__(self, other: Busy) -> Busy:
        return Busy(
            self.read_bytes - other.read_bytes, self.read_s - other.read_s, self.write_bytes - other.write_bytes,
            self.write_s - other.write_s, self.any_s - other.any_s,
        )  # fmt: skip

    def rates(self) -> tuple[float, float] | None:
        """(read, write) bytes per second such that the bytes each way over its rate add up to the
        time the disk was busy: each way's bytes over its own busy time, both scaled by
        (read_s + write_s) / any_s, which is 1 when reads and writes never overlapped. None
        unless both ways moved bytes."""
        if not (self.read_bytes > 0 and self.write_bytes > 0 and self.read_s > 0 and self.write_s > 0):
            return None
        overlap = (self.read_s + self.write_s) / self.any_s
        return overlap * self.read_bytes / self.read_s, overlap * self.write_bytes / self.write_s


class BusyClock:
    """`started` and `ended` bracket each move; `now` is the totals so far, moves in flight counted
    up to now. Thread-safe: moves end on the I/O threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inflight = {"read": 0, "write": 0, "any": 0}
        self._since = {"read": 0.0, "write": 0.0, "any": 0.0}
        self._seconds = {"read": 0.0, "write": 0.0, "any": 0.0}
        self._bytes = {"read": 0, "write": 0}

    def started(self, way: str, nbytes: int) -> None:
        """A move of `nbytes` one `way` ("read" or "write") is in flight from now."""
        now = time.perf_counter()
        with self._lock:
            self._bytes[way] += nbytes
            for clock in (way, "any"):
                if self._inflight[clock] == 0:
                    self._since[clock] = now
                self._inflight[clock] += 1

    def ended(self, way: str) -> None:
        """A move `started` that way has landed (or failed)."""
        now = time.perf_counter()
        with self._lock:
            for clock in (way, "any"):
                self._inflight[clock] -= 1
                if self._inflight[clock] == 0:
                    self._seconds[clock] += now - self._since[clock]

    def now(self) -> Busy:
        now = time.perf_counter()
        with self._lock:
            seconds = {
                clock: total + (now - self._since[clock] if self._inflight[clock] else 0.0)
                for clock, total in self._seconds.items()
            }
            return Busy(self._bytes["read"], seconds["read"], self._bytes["write"], seconds["write"], seconds["any"])
