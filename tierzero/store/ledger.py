"""What the store reports: bytes per tier, per kind and per use, now and at peak.

The ledger is the store's book-keeping, updated from caller and swapper threads;
the report is a frozen snapshot of it for the engine, the benches and the tests.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

from tierzero.common.sizes import format_size
from tierzero.common.slices import Kind, Tier, shown_kinds
from tierzero.offload.base import BounceStats
from tierzero.offload.staging import StagingStats

__all__ = ["Ledger", "StoreReport", "TierLedger", "TierUsage", "Use"]


class Use(enum.Enum):
    """Why a tier holds bytes."""

    HOME = "home"
    FETCHED = "fetched"
    SCRATCH = "scratch"
    STAGING = "staging"
    CACHE = "cache"
    """Host copies of NVMe-homed slices, newer than their homes (tiers.nvme.cache)."""


@dataclass(frozen=True, slots=True)
class TierUsage:
    """Bytes one tier holds, now and at peak (since the last `reset_peaks`)."""

    capacity: int | None
    current: int
    peak: int
    current_by_kind: dict[Kind, int]
    peak_by_kind: dict[Kind, int]
    current_by_use: dict[Use, int]
    kept: int = 0
    """Freed host buffers the tier keeps for reuse: memory held beyond `current` (cpu tier)."""


@dataclass(frozen=True, slots=True)
class StoreReport:
    """Bytes per tier, and the two host-memory pools that move them.

    The cpu row counts all host memory the store holds: the cpu tier's regions, the
    swapper's staging pool and the NVMe tier's bounce blocks (the last two as
    `Kind.STAGING`, `Use.STAGING`). Both pools are bounded by config, shown here
    beside their bounds.
    """

    tiers: dict[Tier, TierUsage]
    staging: StagingStats
    bounce: BounceStats | None = None
    """The NVMe tier's bounce blocks; None without an NVMe tier."""

    def summary(self, kinds: dict[Kind, int]) -> dict[str, Any]:
        """`engine.memory_report()`'s view of the store: `kinds` (bytes of model state per kind), what
        autograd saved at its peak per tier (tierzero/stages/activations.py), each tier's bytes, and the host
        copies of NVMe-homed slices (tiers.nvme.cache), counted in the cpu tier's bytes too."""
        return {
            "kinds": {kind.value: int(kinds.get(kind, 0)) for kind in shown_kinds(kinds)},
            "activations": {tier.value: usage.peak_by_kind.get(Kind.ACTIVATION, 0) for tier, usage in self.tiers.items()},
            "tiers": {
                tier.value: {"current": usage.current, "peak": usage.peak, "capacity": usage.capacity}
                for tier, usage in self.tiers.items()
            },
            "nvme_cache": self.tiers[Tier.CPU].current_by_use[Use.CACHE],
        }

    def format(self) -> str:
        """A small text table: one row per tier, one column per kind that was ever held."""
        kinds = [k for k in Kind if any(u.peak_by_kind[k] for u in self.tiers.values())]
        header = ["tier", "current", "peak", "capacity", "kept", *(f"{k.value} now/peak" for k in kinds)]
        rows = [header]
        for tier, usage in self.tiers.items():
            capacity = "-" if usage.capacity is None else format_size(usage.capacity)
            per_kind = [f"{format_size(usage.current_by_kind[k])}/{format_size(usage.peak_by_kind[k])}" for k in kinds]
            sizes = [format_size(n) for n in (usage.current, usage.peak)]
            rows.append([tier.value, *sizes, capacity, format_size(usage.kept), *per_kind])
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        s = self.staging
        lines.append(
            f"staging: {s.buffer_count} x {format_size(s.buffer_size)}, held {format_size(s.held)} "
            f"(peak {format_size(s.peak_held)}), in use {format_size(s.in_use)} (peak {format_size(s.peak_in_use)})"
        )
        if (b := self.bounce) is not None:
            lines.append(
                f"bounce: at most {b.limit} x {format_size(b.block_size)}, held {format_size(b.held)} "
                f"(peak {format_size(b.peak_held)})"
            )
        return "\n".join(lines)


@dataclass(slots=True)
class TierLedger:
    capacity: int | None
    current: int = 0
    peak: int = 0
    by_kind: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))
    peak_by_kind: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))
    by_use: dict[Use, int] = field(default_factory=lambda: dict.fromkeys(Use, 0))
    home_by_kind: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(Kind, 0))

    def add(self, kind: Kind, use: Use, delta: int) -> None:
        self.current += delta
        self.by_kind[kind] += delta
        self.by_use[use] += delta
        if use is Use.HOME:
            self.home_by_kind[kind] += delta
        assert self.current >= 0 and self.by_kind[kind] >= 0 and self.by_use[use] >= 0, "accounting went negative"
        self.peak = max(self.peak, self.current)
        self.peak_by_kind[kind] = max(self.peak_by_kind[kind], self.by_kind[kind])

    def usage(self) -> TierUsage:
        return TierUsage(
            capacity=self.capacity,
            current=self.current,
            peak=self.peak,
            current_by_kind=dict(self.by_kind),
            peak_by_kind=dict(self.peak_by_kind),
            current_by_use=dict(self.by_use),
        )


class Ledger:
    """Per-tier byte counts; updated from caller and swapper threads alike."""

    def __init__(self, capacities: dict[Tier, int | None]) -> None:
        self._tiers = {tier: TierLedger(capacity) for tier, capacity in capacities.items()}
        self._lock = threading.Lock()

    def add(self, tier: Tier, kind: Kind, use: Use, delta: int) -> None:
        with self._lock:
            ledger = self._tiers.get(tier)
            if ledger is None:
                ledger = self._tiers[tier] = TierLedger(None)
            ledger.add(kind, use, delta)

    def report(self, *, staging: StagingStats, bounce: BounceStats | None = None) -> StoreReport:
        with self._lock:
            tiers = {t: ledger.usage() for t, ledger in self._tiers.items()}
        return StoreReport(tiers=tiers, staging=staging, bounce=bounce)

    def reset_peaks(self) -> None:
        with self._lock:
            for ledger in self._tiers.values():
                ledger.peak = ledger.current
                ledger.peak_by_kind = dict(ledger.by_kind)

    def home_bytes(self, kinds: tuple[Kind, ...]) -> dict[Kind, int]:
        with self._lock:
            return {k: sum(ledger.home_by_kind[k] for ledger in self._tiers.values()) for k in kinds}
