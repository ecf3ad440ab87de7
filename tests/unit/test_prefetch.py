"""The prefetch policy, driven by a small simulated engine with fetches that take time."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from tierzero.prefetch import FetchRequest, FetchState, Mode, Phase, Prefetcher, StepReport, UnitEvent

F, B = Phase.FORWARD, Phase.BACKWARD
LAYERS = ["embed", "block0", "block1", "block2", "head"]


def step_events(layers: list[str]) -> list[tuple[str, Phase]]:
    return [(u, F) for u in layers] + [(u, B) for u in reversed(layers)]


def skipping(step: int) -> list[str]:
    """A model with data-dependent control flow: block1 is skipped on even steps."""
    return [u for u in LAYERS if not (u == "block1" and step % 2 == 0)]


@dataclass
class SimEngine:
    """Drives a Prefetcher as the engine would; a fetch completes `latency` unit computes after issue.

    After every call it checks the budgets: bytes in flight and bytes ahead stay within
    their bounds, unless a single fetch is outstanding (a unit larger than a budget).
    """

    pf: Prefetcher
    latency: int = 1
    tick: int = 0
    pending: dict[str, int] = field(default_factory=dict)  # unit -> tick it completes at
    resident: set[str] = field(default_factory=set)  # kept after compute (keep_resident)
    max_in_flight: int = 0
    max_ahead: int = 0

    def issue_planned(self) -> None:
        for req in self.pf.plan():
            assert req.nbytes == self.pf.unit_bytes[req.unit]
            self.pf.issued(req.unit)
            self.pending[req.unit] = self.tick + self.latency
            self.check_budgets()

    def check_budgets(self) -> None:
        outstanding = sum(self.pf.fetch_state(u) is not None for u in self.pf.unit_bytes)
        in_flight, ahead = self.pf.in_flight_bytes, self.pf.ahead_bytes
        self.max_in_flight, self.max_ahead = max(self.max_in_flight, in_flight), max(self.max_ahead, ahead)
        if outstanding > 1:
            assert in_flight <= self.pf.prefetch_bytes
            assert ahead <= self.pf.max_live_bytes

    def advance(self) -> None:
        """One unit of compute time passes: fetches due by now complete."""
        self.tick += 1
        for unit, due in sorted(self.pending.items()):
            if due <= self.tick:
                del self.pending[unit]
                self.pf.completed(unit)
        self.issue_planned()

    def run_step(self, events: list[tuple[str, Phase]]) -> StepReport:
        self.pf.begin_step()
        self.issue_planned()
        self.advance()  # the data loader's time: the first fetches land
        for unit, phase in events:
            self.pf.record(unit, phase)
            self.issue_planned()
            ready = self.pf.fetch_state(unit) is FetchState.READY or unit in self.resident
            waited = 0.0
            if not ready:
                # Wait for its prefetch, or fetch on demand: 0.25 s per tick in this simulation.
                waited = 0.25 * max(1, self.pending.pop(unit, self.tick + 1) - self.tick)
            self.pf.consumed(unit, ready=ready, waited_s=waited)
            self.resident.discard(unit)
            self.check_budgets()
            self.issue_planned()
            if self.pf.keep_resident(unit):
                self.resident.add(unit)
            self.advance()
        report = self.pf.end_step()
        self.resident.clear()
        for unit in report.unused:
            self.pending.pop(unit, None)
        return report


def make(prefetch_bytes: int = 10_000, max_live_bytes: int = 10_000, sizes: dict[str, int] | None = None) -> Prefetcher:
    return Prefetcher(
        unit_bytes=sizes or {u: 100 for u in LAYERS}, prefetch_bytes=prefetch_bytes, max_live_bytes=max_live_bytes
    )


def test_first_step_learns_the_order_on_demand() -> None:
    pf = make()
    sim = SimEngine(pf)
    assert pf.mode is Mode.LEARNING
    report = sim.run_step(step_events(LAYERS))
    assert (report.mode, report.hits, report.misses, report.issued_bytes) == (Mode.LEARNING, 0, 10, 0)
    assert report.waited_s == pytest.approx(10 * 0.25)
    assert pf.order == tuple(UnitEvent(u, p) for u, p in step_events(LAYERS))
    assert pf.mode is Mode.FOLLOWING


def test_following_steps_hit_every_unit() -> None:
    pf = make()
    sim = SimEngine(pf)
    sim.run_step(step_events(LAYERS))
    for step in (2, 3, 4):
        report = sim.run_step(step_events(LAYERS))
        assert report == StepReport(
            step=step, mode=Mode.FOLLOWING, hits=10, misses=0, waited_s=0.0, events=10, diverged_at=None,
            issued_bytes=500, peak_in_flight_bytes=report.peak_in_flight_bytes,
            peak_ahead_bytes=report.peak_ahead_bytes, unused=(),
        )  # fmt: skip
        # Each unit is read once a step: the budget keeps every forward's bytes for its backward.
        assert report.hit_rate == 1.0


def test_plan_proposes_in_order_within_both_budgets() -> None:
    sizes = {"a": 100, "b": 200, "c": 300, "d": 100}
    pf = Prefetcher(unit_bytes=sizes, prefetch_bytes=300, max_live_bytes=400)
    pf.begin_step()
    for u in sizes:
        pf.record(u, F)
    pf.end_step()

    pf.begin_step()
    assert pf.plan() == [FetchRequest("a", 100), FetchRequest("b", 200)]  # c would put 600 B in flight
    pf.issued("a")
    pf.issued("b")
    assert pf.plan() == []
    pf.completed("a")
    assert pf.plan() == []  # in flight 200 + 300 > 300
    pf.completed("b")
    assert (pf.in_flight_bytes, pf.ahead_bytes) == (0, 300)
    assert pf.plan() == []  # ahead 300 + 300 > 400
    pf.record("a", F)
    pf.consumed("a", ready=True)
    assert pf.plan() == []  # ahead 200 + 300 > 400: c waits, and d waits behind it
    pf.record("b", F)
    pf.consumed("b", ready=True)
    assert pf.plan() == [FetchRequest("c", 300)]  # d would put 400 B in flight
    pf.issued("c")
    pf.completed("c")
    assert pf.plan() == [FetchRequest("d", 100)]
    with pytest.raises(
        RuntimeError,
        match=r"prefetch of unit 'b' \(200 B\) would exceed the budgets: in flight 0/300 B, ahead 300/400 B",
    ):
        pf.issued("b")


@pytest.mark.parametrize(
    ("prefetch_bytes", "max_live_bytes", "latency"), [(250, 10_000, 3), (10_000, 250, 3), (100, 100, 2), (300, 200, 4)]
)
def test_bytes_in_flight_and_ahead_never_exceed_the_bounds(prefetch_bytes, max_live_bytes, latency) -> None:
    sizes = {"embed": 90, "block0": 100, "block1": 100, "block2": 100, "head": 60}
    pf = make(prefetch_bytes, max_live_bytes, sizes)
    sim = SimEngine(pf, latency=latency)
    reports = [sim.run_step(step_events(LAYERS)) for _ in range(4)]
    assert sim.max_in_flight <= prefetch_bytes and sim.max_ahead <= max_live_bytes
    assert all(r.peak_in_flight_bytes <= prefetch_bytes and r.peak_ahead_bytes <= max_live_bytes for r in reports)
    assert all(r.hits + r.misses == 10 for r in reports)
    assert all(r.issued_bytes > 0 for r in reports[1:])


def test_slow_io_shows_as_misses_and_wait() -> None:
    # Fetches take 3 unit computes; one unit of lookahead cannot hide that.
    sim = SimEngine(make(prefetch_bytes=100, max_live_bytes=100), latency=3)
    sim.run_step(step_events(LAYERS))
    report = sim.run_step(step_events(LAYERS))
    assert report.misses > 0 and report.waited_s > 0
    deep = SimEngine(make(prefetch_bytes=300, max_live_bytes=400), latency=3)
    deep.run_step(step_events(LAYERS))
    assert deep.run_step(step_events(LAYERS)).hits > report.hits


def test_units_larger_than_the_budget_move_one_at_a_time() -> None:
    sizes = {"embed": 500, "block0": 1000, "block1": 50, "block2": 1000, "head": 500}
    pf = make(prefetch_bytes=200, max_live_bytes=300, sizes=sizes)
    sim = SimEngine(pf)
    sim.run_step(step_events(LAYERS))
    report = sim.run_step(step_events(LAYERS))
    assert report.hits + report.misses == 10
    assert report.hits >= 8  # each big unit is fetched alone while the previous one computes
    assert report.issued_bytes == 2 * sum(sizes.values()) - sizes["head"]  # head kept for its backward
    assert report.peak_ahead_bytes == 1000 and report.peak_in_flight_bytes == 1000


def test_order_change_is_detected_survived_and_relearned(caplog) -> None:
    pf = make()
    sim = SimEngine(pf)
    with caplog.at_level(logging.DEBUG, logger="tierzero.prefetch"):
        reports = [sim.run_step(step_events(skipping(step))) for step in range(1, 5)]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert warnings[0].getMessage() == (
        "prefetch: unit order changed at event 2 of step 2: expected block1 (forward), got block2 (forward); "
        "fetching on demand for the rest of this step and relearning the order from it "
        "(said once; later changes are logged at debug level)"
    )
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 2  # steps 3 and 4 diverged again
    assert [r.mode for r in reports] == [Mode.LEARNING, Mode.DIVERGED, Mode.DIVERGED, Mode.DIVERGED]
    assert [r.diverged_at for r in reports] == [None, 2, 2, 2]
    step2 = reports[1]
    # The forward units were all prefetched at the start: those that still ran hit;
    # after the change nothing more is prefetched, so the backward is on demand.
    # embed and block0 ran before the divergence and were kept: their backward still hits
    assert (step2.hits, step2.misses, step2.events) == (6, 2, 8)
    assert step2.unused == ("block1",)  # fetched for the old order, never used: the engine releases it
    assert pf.order == tuple(UnitEvent(u, p) for u, p in step_events(skipping(4)))

    # When the order settles, following resumes at full hit rate.
    settled = sim.run_step(step_events(skipping(4)))
    assert (settled.mode, settled.hits, settled.misses, settled.diverged_at) == (Mode.FOLLOWING, 8, 0, None)


def test_plan_is_empty_for_the_rest_of_a_diverged_step() -> None:
    pf = make()
    SimEngine(pf).run_step(step_events(LAYERS))
    pf.begin_step()
    pf.record("embed", F)
    pf.consumed("embed", ready=False)
    pf.record("head", F)
    assert pf.mode is Mode.DIVERGED
    assert pf.plan() == []


def test_a_step_that_ends_early_is_a_divergence() -> None:
    pf = make()
    sim = SimEngine(pf)
    sim.run_step(step_events(LAYERS))
    report = sim.run_step([(u, F) for u in LAYERS])  # forward only: evaluation
    assert (report.mode, report.diverged_at, report.hits) == (Mode.DIVERGED, 5, 5)
    assert pf.order == tuple(UnitEvent(u, F) for u in LAYERS)


def test_next_occurrence_waits_for_the_current_one() -> None:
    # A unit's later occurrence is fetched only once the earlier fetch is consumed,
    # and the walk does not skip past it.
    order = [("a", F), ("b", F), ("a", B), ("c", B)]
    pf = make(sizes={"a": 100, "b": 100, "c": 100})
    SimEngine(pf).run_step(order)
    pf.begin_step()
    assert pf.plan() == [FetchRequest("a", 100), FetchRequest("b", 100)]
    pf.issued("a")
    pf.issued("b")
    pf.record("a", F)
    assert pf.plan() == []  # a's fetch serves this occurrence; the next a waits, and c behind it
    pf.consumed("a", ready=True)
    assert pf.plan() == []  # compute still holds a's bytes: nothing behind it is fetched out of order
    assert pf.keep_resident("a")  # a runs again after b only: both fit, so its bytes stay
    assert pf.plan() == [FetchRequest("c", 100)]
    pf.issued("c")
    assert pf.fetch_state("c") is FetchState.IN_FLIGHT and pf.fetch_state("a") is None


def test_a_unit_released_is_fetched_again_for_its_next_occurrence() -> None:
    order = [("a", F), ("b", F), ("a", B), ("c", B)]
    pf = make(sizes={"a": 100, "b": 100, "c": 100}, max_live_bytes=150)
    SimEngine(pf).run_step(order)
    pf.begin_step()
    pf.record("a", F)
    pf.consumed("a", ready=False)
    assert not pf.keep_resident("a")  # a and b, 200 B, do not fit in 150
    assert pf.plan()[0] == FetchRequest("b", 100)


def test_a_unit_is_kept_when_only_its_modules_other_units_ran_since() -> None:
    # Stage 3 gathers a module's units together: "b" and its fp32 companion "b:fp32" are both
    # recorded before either's gather ends and asks to keep it; "c" between them is another module.
    order = [("a", F), ("b", F), ("b:fp32", F), ("c", F), ("b", B), ("b:fp32", B), ("a", B)]
    pf = make(sizes={"a": 100, "b": 100, "b:fp32": 10, "c": 100})
    SimEngine(pf).run_step(order)
    pf.begin_step()
    pf.record("a", F)
    pf.record("b", F)
    pf.consumed("a", ready=False)
    assert not pf.keep_resident("a")  # b, another module's, ran since: not asked right after a's gather
    pf.record("b:fp32", F)
    pf.consumed("b", ready=False)
    assert pf.keep_resident("b")  # only its companion ran since
    pf.consumed("b:fp32", ready=False)
    assert pf.keep_resident("b:fp32")


def test_a_unit_that_runs_twice_in_a_row_is_kept() -> None:
    # Too tight a budget to keep the forward's units for their backward: only head, which
    # runs again at once, is kept.
    pf = make(max_live_bytes=150)
    SimEngine(pf).run_step(step_events(LAYERS))
    pf.begin_step()
    for unit in LAYERS[:-1]:
        pf.record(unit, F)
        pf.consumed(unit, ready=False)
        assert not pf.keep_resident(unit)
    pf.record("head", F)
    pf.consumed("head", ready=False)
    assert pf.keep_resident("head")
    # head's backward is served by the kept bytes: the plan goes on to the next units.
    assert pf.plan() == [FetchRequest(u, 100) for u in reversed(LAYERS[:-1])][:1]
    pf.record("head", B)
    assert not pf.keep_resident("head")


def test_units_kept_for_their_next_run_only_while_everything_before_it_fits() -> None:
    pf = make(max_live_bytes=350)
    SimEngine(pf).run_step(step_events(LAYERS))
    pf.begin_step()
    kept = []
    for unit in LAYERS:
        pf.record(unit, F)
        pf.consumed(unit, ready=True)
        if pf.keep_resident(unit):
            kept.append(unit)
        assert pf.kept_bytes + pf.ahead_bytes <= pf.max_live_bytes
    # block1 runs again after block2 and head: 300 bytes with block2 kept... the earlier ones do
    # not fit beside them; head runs again at once.
    assert kept == ["block1", "block2", "head"]
    assert pf.kept_bytes == 300
    pf.record("head", B)
    pf.consumed("head", ready=True)
    assert pf.kept_bytes == 200  # head's kept bytes served its backward
    # block2 and block1 are kept: the walk proposes block0 next, within what is left
    assert pf.plan() == [FetchRequest("block0", 100)]


def test_zero_budget_turns_prefetch_off() -> None:
    sim = SimEngine(make(prefetch_bytes=0))
    sim.run_step(step_events(LAYERS))
    report = sim.run_step(step_events(LAYERS))
    # Nothing is prefetched; only head, kept from forward to backward, is there in time.
    assert (report.hits, report.misses, report.issued_bytes, report.mode) == (1, 9, 0, Mode.FOLLOWING)


def test_reports_are_deterministic() -> None:
    def run() -> list[StepReport]:
        sim = SimEngine(make(prefetch_bytes=200, max_live_bytes=300), latency=2)
        return [sim.run_step(step_events(skipping(s))) for s in range(1, 6)]

    assert run() == run()


def test_from_config() -> None:
    cfg = SimpleNamespace(prefetch=SimpleNamespace(bytes=1 << 20, max_live_bytes=4 << 20))
    pf = Prefetcher.from_config(cfg.prefetch, unit_bytes={"a": 10})
    assert (pf.prefetch_bytes, pf.max_live_bytes, pf.unit_bytes) == (1 << 20, 4 << 20, {"a": 10})


def test_misuse_is_refused() -> None:
    expected = r"prefetch.bytes must be a byte count >= 0 \(0 turns prefetching off\), got -1"
    with pytest.raises(ValueError, match=expected):
        make(prefetch_bytes=-1)
    pf = make()
    with pytest.raises(RuntimeError, match=r"prefetcher.record\(\) called outside a step: call begin_step\(\) first"):
        pf.record("embed", F)
    pf.begin_step()
    with pytest.raises(RuntimeError, match=r"prefetcher.begin_step\(\) called inside a step: call end_step\(\) first"):
        pf.begin_step()
    with pytest.raises(ValueError, match=r"unit 'nope' is not one the prefetcher was given \(5 units"):
        pf.record("nope", F)
    pf.issued("embed")
    with pytest.raises(RuntimeError, match=r"prefetch of unit 'embed' issued twice"):
        pf.issued("embed")
    with pytest.raises(RuntimeError, match=r"completed\(\) for unit 'head', which has no prefetch in flight"):
        pf.completed("head")
