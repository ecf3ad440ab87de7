"""What `bench swap` counts: transfers per path with their latencies, failures, staging and memory peaks."""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tierzero.common.sizes import format_size


class CheckFailed(RuntimeError):
    """A check of the stress test failed (bytes differ, bytes leaked, files left); the message says which."""


@dataclass(frozen=True, slots=True)
class Failure:
    """Something that makes the run fail: what it concerns (a slice, a tier) and the error."""

    what: str
    error: BaseException

    def __str__(self) -> str:
        # A failed check says what went wrong; an unexpected error also names its type.
        kind = "" if isinstance(self.error, CheckFailed) else f"{type(self.error).__name__}: "
        return f"{self.what}: {kind}{self.error}"


@dataclass(slots=True)
class PathStats:
    """Transfers along one path (e.g. nvme->cpu): bytes and each one's latency, submit to done."""

    nbytes: int = 0
    latencies_s: list[float] = field(default_factory=list)

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies_s)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass(slots=True, kw_only=True)
class SwapStats:
    """Filled by the workers (thread-safe `record` and `fail`) and by the run's end checks."""

    staging_capacity: int
    paths: dict[str, PathStats] = field(default_factory=dict)
    failures: list[Failure] = field(default_factory=list)
    elapsed_s: float = 0.0
    staging: Any = None
    """The swapper's `StagingStats` at the end of the run."""
    peak_rss: int = 0
    leaked: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    TABLE_HEADERS: ClassVar[list[str]] = ["path", "transfers", "moved", "GB/s", "p50 ms", "p99 ms"]

    def record(self, path: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            stats = self.paths.setdefault(path, PathStats())
            stats.nbytes += nbytes
            stats.latencies_s.append(seconds)

    def fail(self, failure: Failure) -> None:
        with self._lock:
            self.failures.append(failure)

    @property
    def passed(self) -> bool:
        return not self.failures and self.transfers > 0

    @property
    def transfers(self) -> int:
        return sum(len(p.latencies_s) for p in self.paths.values())

    @property
    def staging_over_pool(self) -> bool:
        """Staging beyond the pool: whole-region buffers for a tier without ranged I/O (see swapper.py)."""
        return self.staging is not None and self.staging.peak_held > self.staging_capacity

    def table_rows(self) -> list[list[str]]:
        rows = []
        for name, p in sorted(self.paths.items()):
            rate = p.nbytes / self.elapsed_s / 1e9 if self.elapsed_s else 0.0
            rows.append([
                name, str(len(p.latencies_s)), format_size(p.nbytes), f"{rate:.2f}",
                f"{p.percentile(0.5) * 1e3:.1f}", f"{p.percentile(0.99) * 1e3:.1f}",
            ])
        return rows

    def summary_lines(self) -> list[str]:
        moved = sum(p.nbytes for p in self.paths.values())
        rate = moved / self.elapsed_s / 1e9 if self.elapsed_s else 0.0
        lines = [f"{self.transfers} transfers, {format_size(moved)} in {self.elapsed_s:.1f} s: {rate:.2f} GB/s in all"]
        if self.staging is not None:
            note = " (over the pool: whole-region staging)" if self.staging_over_pool else ""
            lines.append(
                f"staging high-water mark {format_size(self.staging.peak_held)} of a "
                f"{format_size(self.staging_capacity)} pool{note}"
            )
        lines.append(f"peak RSS {format_size(self.peak_rss)}")
        if self.leaked:
            lines.append("accounted after all releases: " + ", ".join(f"{t} {n} B" for t, n in self.leaked.items()))
        lines.extend(f"FAILED: {f}" for f in self.failures)
        if not self.failures and not self.transfers:
            lines.append("FAILED: no transfer finished: raise --duration")
        lines.append("bench swap: PASSED" if self.passed else "bench swap: FAILED")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "elapsed_s": self.elapsed_s,
            "transfers": self.transfers,
            "paths": {
                name: {
                    "transfers": len(p.latencies_s),
                    "bytes": p.nbytes,
                    "GBps": p.nbytes / self.elapsed_s / 1e9 if self.elapsed_s else None,
                    "p50_ms": p.percentile(0.5) * 1e3,
                    "p99_ms": p.percentile(0.99) * 1e3,
                    "mean_ms": statistics.fmean(p.latencies_s) * 1e3,
                }
                for name, p in sorted(self.paths.items())
            },
            "staging": None if self.staging is None else {
                "capacity": self.staging_capacity,
                "peak_held": self.staging.peak_held,
                "peak_in_use": self.staging.peak_in_use,
                "over_pool": self.staging_over_pool,
            },
            "peak_rss": self.peak_rss,
            "leaked": self.leaked,
            "failures": [str(f) for f in self.failures],
        }
