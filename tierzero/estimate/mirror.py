"""Mirrors of two engine mechanisms for `tierzero estimate`'s replay: the parameter prefetch and the step pipeline.

Each walks the same decisions as its original over the replay's byte counts instead of
tensors: `ParamFetches` mirrors `stages.param_prefetch.ParamPrefetch` and drives the
engine's own `tierzero.prefetch.Prefetcher`; `StepPipeline` mirrors
`offload.optimizer_step.StepPipeline`. See [Note: the replay] in estimate_replay.py.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tierzero.prefetch import FetchState, Phase, Prefetcher
from tierzero.slices import Kind, Tier, align_up

if TYPE_CHECKING:
    from tierzero.estimate.replay import Replay, UnitSlices

__all__ = ["ParamFetches", "StepPipeline"]


class ParamFetches:
    """`stages.param_prefetch.ParamPrefetch` over the replay, driving the engine's own prefetch policy.

    Every prefetch is taken to land at once, so the policy issues as much as its budgets
    allow: the most device memory prefetched shards can take.
    """

    def __init__(self, replay: Replay, units: list[UnitSlices]) -> None:
        self.replay = replay
        self.specs = {u.name: u.spec(Kind.PARAM) for u in units}
        # The same unit sizes Engine._attach_prefetch gives the policy.
        self.policy = Prefetcher.from_config(replay.cfg, unit_bytes={n: align_up(s.nbytes) for n, s in self.specs.items()})
        self.ahead: set[str] = set()
        self.kept: set[str] = set()
        self.fetched: set[str] = set()

    def begin_step(self) -> None:
        self.policy.begin_step()
        self._issue()

    def acquire(self, unit: str, phase: Phase) -> None:
        self.policy.record(unit, phase)
        self._settle()
        ready = unit in self.ahead or unit in self.kept
        self.ahead.discard(unit)
        self.kept.discard(unit)
        if not ready:
            self._fetch(unit)
        self.policy.consumed(unit, ready=ready)
        self._issue()

    def done_with(self, unit: str) -> None:
        if self.policy.keep_resident(unit):
            self.kept.add(unit)
        else:
            self._release(unit)

    def end_step(self) -> None:
        self._settle()
        self.policy.end_step()
        for unit in self.ahead | self.kept:
            self._release(unit)
        self.ahead.clear()
        self.kept.clear()

    def _settle(self) -> None:
        for unit in self.ahead:
            if self.policy.fetch_state(unit) is FetchState.IN_FLIGHT:
                self.policy.completed(unit)

    def _issue(self) -> None:
        self._settle()
        with self.replay.together():
            for request in self.policy.plan():
                if request.unit in self.fetched:
                    break  # still held by its previous use
                self._fetch(request.unit)
                self.ahead.add(request.unit)
                self.policy.issued(request.unit)

    def _fetch(self, unit: str) -> None:
        self.fetched.add(unit)
        self.replay.fetch(self.specs[unit])

    def _release(self, unit: str) -> None:
        self.fetched.discard(unit)
        self.replay.release(self.specs[unit])


class StepPipeline:
    """`offload.optimizer_step.StepPipeline` over the replay: a pushed unit's group is read at once and
    computes when the next is pushed; at most one older group is still being written.

    A group's copies are taken as resident until the pipeline drains its writes, so three
    groups at most: an upper bound. In a step run during backward, a group's write-back
    often lands while the next unit's backward runs, and a run then peaks one group lower.
    """

    def __init__(self, replay: Replay) -> None:
        self.replay = replay
        self.writing: list[list[tuple[Any, Tier]]] = []
        self.waiting: tuple[UnitSlices, list[tuple[Any, Tier]]] | None = None

    def push(self, unit: UnitSlices) -> None:
        while len(self.writing) > 1:
            self.replay.drop_group(self.writing.pop(0))
        group = self.replay.read_group(self.replay.group(unit))
        previous, self.waiting = self.waiting, (unit, group)
        if previous is not None:
            self._step(*previous)

    def flush(self) -> None:
        previous, self.waiting = self.waiting, None
        if previous is not None:
            self._step(*previous)
        for group in self.writing:
            self.replay.drop_group(group)
        self.writing.clear()

    def _step(self, unit: UnitSlices, group: list[tuple[Any, Tier]]) -> None:
        self.replay.compute(unit)
        self.writing.append(group)
