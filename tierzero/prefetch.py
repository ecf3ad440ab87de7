"""The prefetch policy: which units' parameter slices should be moving up the tiers now.

Policy only: the engine asks `plan()` what to fetch, moves the bytes itself (swapper,
tiers, streams), and reports back. Nothing here touches a tensor or a clock, so every
decision is deterministic and unit-tested.

One step, as the engine drives it:

    prefetcher.begin_step()
    issue(prefetcher.plan())                         # the first units, before forward
    for each unit about to run (pre-forward / pre-backward hook):
        prefetcher.record(unit, phase)               # advances the position, spots divergence
        ... wait for the unit's bytes, or fetch them on demand ...
        prefetcher.consumed(unit, ready=..., waited_s=...)
        issue(prefetcher.plan())                     # its bytes left the budget: room for more
        compute, then release the unit's bytes unless prefetcher.keep_resident(unit)
    report = prefetcher.end_step()                   # release report.unused

where `issue` starts each fetch and calls `issued(unit)`, and the fetch's completion
calls `completed(unit)` (then `plan()` again, since bytes in flight dropped).

[Note: following and diverging]
The first step runs on demand while the order of (unit, phase) events is recorded
(LEARNING). Later steps follow it (FOLLOWING): `plan()` walks the events after the
current position and proposes, in order, every unit not yet fetched while both
budgets hold: `prefetch_bytes` bounds the bytes in flight (issued, not completed) and
`max_live_bytes` the bytes fetched ahead of compute (issued, not yet consumed). The walk
stops at the first unit that does not fit, so fetches stay in order; a unit bigger
than a budget is fetched alone when nothing else is ahead, so it still makes
progress. A unit has at most one fetch outstanding, for its next occurrence; its later
occurrences wait until that one is consumed. A unit that runs again soon is kept
resident rather than released and fetched again (`keep_resident`: always when it runs
twice in a row, otherwise while it and everything before its next run fit in
`max_live_bytes`), and the walk passes over the occurrence its kept bytes serve.
The first event that differs from the learned order (or a step that ends early)
switches the step to DIVERGED: no more prefetching in that step, one warning for the
life of the prefetcher, and the order observed in that step becomes the learned order
for the next.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping
from dataclasses import dataclass

from tierzero.config import PrefetchConfig
from tierzero.units.unit import module_of

log = logging.getLogger(__name__)


class Phase(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class Mode(enum.Enum):
    """What the prefetcher does in the current step ([Note: following and diverging])."""

    LEARNING = "learning"
    """No order known: fetch on demand, record the order."""
    FOLLOWING = "following"
    """Prefetch along the learned order."""
    DIVERGED = "diverged"
    """The order changed in this step: on demand until the step ends, then relearn."""


class FetchState(enum.Enum):
    IN_FLIGHT = "in_flight"
    READY = "ready"


@dataclass(frozen=True, slots=True)
class UnitEvent:
    """One unit running in one phase: an entry of the learned order."""

    unit: str
    phase: Phase


@dataclass(frozen=True, slots=True)
class FetchRequest:
    """A unit whose parameter slices the engine should start moving up now."""

    unit: str
    nbytes: int


@dataclass(slots=True)
class _Fetch:
    nbytes: int
    state: FetchState


@dataclass(frozen=True, slots=True)
class StepReport:
    """What the prefetcher saw in one step."""

    step: int
    mode: Mode
    """LEARNING, FOLLOWING (the order held to the end) or DIVERGED."""
    hits: int
    """Units whose bytes were ready when compute needed them."""
    misses: int
    """Units compute had to wait for, or fetch on demand."""
    waited_s: float
    """Seconds compute waited on I/O, as the engine measured them."""
    events: int
    """(unit, phase) events recorded."""
    diverged_at: int | None
    """Index of the first event that left the learned order, if any."""
    issued_bytes: int
    peak_in_flight_bytes: int
    peak_ahead_bytes: int
    unused: tuple[str, ...]
    """Units fetched ahead but never consumed; the engine releases them."""

    @property
    def hit_rate(self) -> float:
        consumed = self.hits + self.misses
        return self.hits / consumed if consumed else 0.0


class Prefetcher:
    """Learns the unit order and proposes fetches within the byte budgets."""

    __slots__ = (
        "unit_bytes", "prefetch_bytes", "max_live_bytes",
        "_order", "_mode", "_in_step", "_step", "_pos", "_observed", "_fetches", "_awaiting",
        "_diverged_at", "_warned", "_hits", "_misses", "_waited_s", "_issued_bytes",
        "_peak_in_flight", "_peak_ahead", "_kept", "_held",
    )  # fmt: skip

    def __init__(self, *, unit_bytes: Mapping[str, int], prefetch_bytes: int, max_live_bytes: int) -> None:
        for name, value in (("prefetch.bytes", prefetch_bytes), ("prefetch.max_live_bytes", max_live_bytes)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a byte count >= 0 (0 turns prefetching off), got {value!r}")
        if bad := {u: n for u, n in unit_bytes.items() if not isinstance(n, int) or n < 0}:
            raise ValueError(f"unit sizes must be byte counts >= 0, got {bad}")
        self.unit_bytes = dict(unit_bytes)
        self.prefetch_bytes, self.max_live_bytes = prefetch_bytes, max_live_bytes
        self._order: tuple[UnitEvent, ...] = ()
        self._mode = Mode.LEARNING
        self._in_step = False
        self._step = 0
        self._warned = False
        self._reset_step()

    @classmethod
    def from_config(cls, section: PrefetchConfig, *, unit_bytes: Mapping[str, int]) -> Prefetcher:
        """Budgets from the `prefetch` section: `bytes` and `max_live_bytes`."""
        return cls(unit_bytes=unit_bytes, prefetch_bytes=section.bytes, max_live_bytes=section.max_live_bytes)

    @property
    def mode(self) -> Mode:
        return self._mode

    @property
    def order(self) -> tuple[UnitEvent, ...]:
        """The learned order; empty until a step has ended."""
        return self._order

    def first_units(self) -> list[str]:
        """The learned order's first units that fit in `prefetch_bytes` together (at least one; none
        before an order is learned): the optimizer steps these first, so that their new slices can
        start up for the next forward while the other units step."""
        first: list[str] = []
        budget = self.prefetch_bytes
        for event in self._order:
            size = self.unit_bytes[event.unit]
            if event.unit in first or (first and size > budget):
                break
            first.append(event.unit)
            budget -= size
        return first

    @property
    def recorded(self) -> int:
        """Events `record`ed in the open step (0 between steps)."""
        return len(self._observed) if self._in_step else 0

    @property
    def exhausted(self) -> bool:
        """Following, and every event of the learned order has run: no unit runs again in this step."""
        return self._in_step and self._mode is Mode.FOLLOWING and self._pos == len(self._order)

    @property
    def in_flight_bytes(self) -> int:
        return sum(f.nbytes for f in self._fetches.values() if f.state is FetchState.IN_FLIGHT)

    @property
    def ahead_bytes(self) -> int:
        """Bytes fetched (or being fetched) for units compute has not consumed yet."""
        return sum(f.nbytes for f in self._fetches.values())

    def fetch_state(self, unit: str) -> FetchState | None:
        """The outstanding prefetch of `unit`, if any."""
        fetch = self._fetches.get(unit)
        return fetch.state if fetch else None

    def begin_step(self) -> None:
        self._require_step(False, "begin_step")
        self._in_step = True
        self._step += 1
        self._mode = Mode.FOLLOWING if self._order else Mode.LEARNING
        self._reset_step()

    def record(self, unit: str, phase: Phase) -> None:
        """`unit` is about to run in `phase`."""
        self._require_step(True, "record")
        self._size_of(unit)
        event = UnitEvent(unit, phase)
        index = len(self._observed)
        self._observed.append(event)
        self._awaiting = unit
        if self._mode is not Mode.FOLLOWING:
            return
        if self._pos < len(self._order) and self._order[self._pos] == event:
            self._pos += 1
        else:
            expected = self._order[self._pos] if self._pos < len(self._order) else None
            self._diverge(index, expected=expected, got=event)

    def plan(self) -> list[FetchRequest]:
        """Units to start fetching now, in the order they will run. Repeats until `issued`."""
        self._require_step(True, "plan")
        if self._mode is not Mode.FOLLOWING or self.prefetch_bytes == 0 or self.max_live_bytes == 0:
            return []
        in_flight, ahead = self.in_flight_bytes, self.ahead_bytes
        requests: list[FetchRequest] = []
        # The unit now running may still hold its fetch (consumed() not yet called):
        # that fetch is this occurrence's, not the next one's.
        seen: set[str] = {self._awaiting} if self._awaiting in self._fetches else set()
        for index in range(self._pos, len(self._order)):
            event = self._order[index]
            if index > 0 and self._order[index - 1].unit == event.unit:
                continue  # kept resident since its previous occurrence (keep_resident)
            if event.unit in self._kept and event.unit not in seen:
                seen.add(event.unit)
                continue  # this occurrence is served by the bytes kept since the last one
            if event.unit == self._held:
                break  # the engine still holds its last occurrence's bytes: fetch in order later
            if event.unit in seen:
                break  # its next occurrence needs this one consumed first
            seen.add(event.unit)
            if event.unit in self._fetches:
                continue
            nbytes = self.unit_bytes[event.unit]
            if not self._fits(nbytes, in_flight=in_flight, ahead=ahead):
                break
            requests.append(FetchRequest(event.unit, nbytes))
            in_flight += nbytes
            ahead += nbytes
        return requests

    def keep_resident(self, unit: str) -> bool:
        """Whether the engine should keep `unit`'s bytes after this occurrence, for its next one:
        only while following the learned order (on demand, everything is released). A unit that
        runs again at once is always kept. One that runs again later in the step (the forward's
        blocks, run again in backward) is kept when its bytes, and those of every unit that runs
        before its next occurrence, fit in `max_live_bytes` beside what is ahead and kept already:
        keeping it then never stands in the way of a fetch it waits for, and the disk reads it
        once a step instead of twice."""
        self._require_step(True, "keep_resident")
        if unit == self._held:
            self._held = None
        if not (self._mode is Mode.FOLLOWING and self._just_ran(unit)):
            return False
        upcoming = [event.unit for event in self._order[self._pos :]]
        if unit not in upcoming:
            return False
        between = upcoming[: upcoming.index(unit)]
        if between:
            if self.prefetch_bytes == 0:
                return False  # prefetch off: on demand, but for a unit that runs again at once
            need = self.unit_bytes[unit] + sum(self.unit_bytes[w] for w in set(between) - set(self._kept))
            if self.ahead_bytes + self.kept_bytes + need > self.max_live_bytes:
                return False
        self._kept[unit] = self.unit_bytes[unit]
        return True

    def _just_ran(self, unit: str) -> bool:
        """Whether `unit` ran last, or only its module's other units since (stage 3 gathers them together)."""
        units = [event.unit for event in self._observed]
        last = len(units) - 1 - units[::-1].index(unit) if unit in units else None
        return last is not None and all(module_of(u) == module_of(unit) for u in units[last:])

    @property
    def kept_bytes(self) -> int:
        """Bytes the engine keeps, on this policy's word, for units' next occurrences."""
        return sum(self._kept.values())

    def issued(self, unit: str) -> None:
        """The engine started prefetching `unit` (one of `plan()`'s requests)."""
        self._require_step(True, "issued")
        nbytes = self._size_of(unit)
        if unit in self._fetches:
            raise RuntimeError(f"prefetch of unit {unit!r} issued twice; consume it before fetching it again")
        if not self._fits(nbytes, in_flight=self.in_flight_bytes, ahead=self.ahead_bytes):
            raise RuntimeError(
                f"prefetch of unit {unit!r} ({nbytes} B) would exceed the budgets: in flight "
                f"{self.in_flight_bytes}/{self.prefetch_bytes} B, ahead {self.ahead_bytes}/{self.max_live_bytes} B; "
                "issue only what plan() returns"
            )
        self._fetches[unit] = _Fetch(nbytes, FetchState.IN_FLIGHT)
        self._issued_bytes += nbytes
        self._peak_in_flight = max(self._peak_in_flight, self.in_flight_bytes)
        self._peak_ahead = max(self._peak_ahead, self.ahead_bytes)

    def completed(self, unit: str) -> None:
        """The prefetch of `unit` finished: its bytes are resident, no longer in flight."""
        fetch = self._fetches.get(unit)
        if fetch is None or fetch.state is not FetchState.IN_FLIGHT:
            raise RuntimeError(f"completed() for unit {unit!r}, which has no prefetch in flight")
        fetch.state = FetchState.READY

    def consumed(self, unit: str, *, ready: bool, waited_s: float = 0.0) -> None:
        """Compute took `unit`'s bytes: `ready` if they were there (a hit), after `waited_s` seconds of waiting."""
        self._require_step(True, "consumed")
        self._size_of(unit)
        if waited_s < 0:
            raise ValueError(f"waited_s must be >= 0, got {waited_s}")
        self._fetches.pop(unit, None)
        self._kept.pop(unit, None)
        self._held = unit
        if unit == self._awaiting:
            self._awaiting = None
        if ready:
            self._hits += 1
        else:
            self._misses += 1
        self._waited_s += waited_s

    def cancel_step(self) -> None:
        """Close a step in which no unit ran (the engine opened it early, to fetch ahead of a forward that
        never came): no report, the learned order unchanged."""
        self._require_step(True, "cancel_step")
        if self._observed:
            raise RuntimeError(f"cancel_step() after {len(self._observed)} recorded events: call end_step() instead")
        self._in_step = False
        self._step -= 1
        self._mode = Mode.FOLLOWING if self._order else Mode.LEARNING
        self._reset_step()

    def end_step(self, *, cut_short: bool = False) -> StepReport:
        """Close the step, adopt its order when it was learning or diverged, and report. `cut_short`: the
        engine closes mid-step (a peer failed): the events it did not reach change nothing, and say nothing."""
        self._require_step(True, "end_step")
        if self._mode is Mode.FOLLOWING and self._pos != len(self._order) and not cut_short:
            self._diverge(len(self._observed), expected=self._order[self._pos], got=None)
        if self._mode is not Mode.FOLLOWING and self._observed and not cut_short:
            self._order = tuple(self._observed)
        report = StepReport(
            step=self._step,
            mode=self._mode,
            hits=self._hits,
            misses=self._misses,
            waited_s=self._waited_s,
            events=len(self._observed),
            diverged_at=self._diverged_at,
            issued_bytes=self._issued_bytes,
            peak_in_flight_bytes=self._peak_in_flight,
            peak_ahead_bytes=self._peak_ahead,
            unused=tuple(self._fetches),
        )
        self._in_step = False
        self._mode = Mode.FOLLOWING if self._order else Mode.LEARNING
        self._reset_step()
        return report

    def _fits(self, nbytes: int, *, in_flight: int, ahead: int) -> bool:
        # Alone, any unit fits: one bigger than a budget must still make progress.
        if ahead == 0:
            return True
        return in_flight + nbytes <= self.prefetch_bytes and ahead + self.kept_bytes + nbytes <= self.max_live_bytes

    def _diverge(self, index: int, *, expected: UnitEvent | None, got: UnitEvent | None) -> None:
        self._mode = Mode.DIVERGED
        self._diverged_at = index
        what = (
            f"unit order changed at event {index} of step {self._step}: expected {_describe(expected)}, "
            f"got {_describe(got)}; fetching on demand for the rest of this step and relearning the order from it"
        )
        if self._warned:
            log.debug("prefetch: %s", what)
        else:
            self._warned = True
            log.warning("prefetch: %s (said once; later changes are logged at debug level)", what)

    def _reset_step(self) -> None:
        self._pos = 0
        self._awaiting: str | None = None
        self._observed: list[UnitEvent] = []
        self._fetches: dict[str, _Fetch] = {}
        self._kept: dict[str, int] = {}
        self._held: str | None = None
        """Consumed, and not yet released or kept (`keep_resident` decides): not fetchable now."""
        self._diverged_at: int | None = None
        self._hits = self._misses = self._issued_bytes = self._peak_in_flight = self._peak_ahead = 0
        self._waited_s = 0.0

    def _require_step(self, inside: bool, call: str) -> None:
        if self._in_step != inside:
            where = "outside a step: call begin_step() first" if inside else "inside a step: call end_step() first"
            raise RuntimeError(f"prefetcher.{call}() called {where}")

    def _size_of(self, unit: str) -> int:
        try:
            return self.unit_bytes[unit]
        except KeyError:
            raise ValueError(
                f"unit {unit!r} is not one the prefetcher was given ({len(self.unit_bytes)} units, "
                f"e.g. {sorted(self.unit_bytes)[:3]}): pass every unit's byte size to Prefetcher(unit_bytes=...)"
            ) from None


def _describe(event: UnitEvent | None) -> str:
    return f"{event.unit} ({event.phase.value})" if event else "the end of the step"
