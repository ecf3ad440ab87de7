"""Stage 3's parameter slices, fetched up the tiers ahead of their all-gathers.

The policy (which units, how many bytes) is `tierzero.prefetch.Prefetcher`'s; this
file moves the bytes: each planned unit's PARAM slice is fetched to the device tier
through the store (NVMe homes come up through the swapper's host staging buffers),
and the stage takes it from here when it starts the unit's all-gather. One step of
the policy is one forward and its backward.

A unit is recorded when its shard is needed (the stage's `start_gather`), which is
the order the bytes are consumed in, also when the stage starts a gather early.
Fetches only run while a step is open and following the learned order; outside one
every fetch is on demand and counts nowhere.

[Note: reading ahead without grad]
A forward without gradients (a decoding step of `generate`, an evaluation) is a step of
its own, of a second policy, `reading`, with the same budgets: its order is a forward's
units only, and taking it from the training policy would make every such forward diverge
at its end (no backward follows) and teach the training order a forward alone. So the
first no-grad forward runs on demand and records its order, and each later one reads
ahead along it, as a training forward does along its own: the decoding steps of one
`generate` call run the same units in the same order. `begin_reading` ends the training
step first (as any forward that is not its own backward's would) and `end_reading` gives
the training policy back; what `warm` started for the next training step stays started.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.common.transfer import Transfer
from tierzero.prefetch import FetchState, Phase, Prefetcher, StepReport

__all__ = ["ParamPrefetch"]


class ParamPrefetch:
    """Fetches stage 3's PARAM slices to the device ahead of use, as the prefetch policy plans."""

    def __init__(self, *, store: Any, policy: Prefetcher) -> None:
        self.store, self.policy = store, policy
        """The policy of the step open now: `training`'s, or `reading`'s in a no-grad forward."""
        self.training = policy
        self.reading = Prefetcher(unit_bytes=policy.unit_bytes, prefetch_bytes=policy.prefetch_bytes, max_live_bytes=policy.max_live_bytes)
        """The no-grad forwards' own order and budgets ([Note: reading ahead without grad])."""
        self._ahead: dict[str, Transfer[torch.Tensor]] = {}
        """Prefetches issued and not yet consumed, by unit."""
        self._kept: set[str] = set()
        """Units whose slice stays fetched for their next occurrence (`Prefetcher.keep_resident`)."""
        self._early: dict[str, Transfer[torch.Tensor]] = {}
        """Fetches started between steps (`warm`), which the next step's plan adopts."""
        self._in_step = False
        self.last_report: StepReport | None = None
        self.last_read_report: StepReport | None = None
        """The last no-grad forward's report (`last_report` stays the last training step's)."""
        self.blocked: Callable[[str], bool] = lambda unit: False
        """Units whose slice must not be fetched yet: their deferred optimizer step has not
        written it (stage 3's `ForwardStep`); `resume` once one is written."""

    @property
    def in_step(self) -> bool:
        return self._in_step

    def begin_step(self) -> None:
        """Open a step and start its first fetches; a no-op in a step opened early that nothing used yet."""
        if self._in_step and not self.policy.recorded:
            return
        if self._in_step:
            self.end_step()  # a second forward before any backward: the first step is over
        self.policy.begin_step()
        self._in_step = True
        self._issue()
        self._drop_early()  # a warm fetch the plan did not want (the order's first unit changed)

    def can_warm(self, unit: str) -> bool:
        """Whether `unit`, one of the next step's first, may start up now: between steps, or once
        every unit of this step has run (the backward's last optimizer steps), and not yet started."""
        return not ((self._in_step and not self.policy.exhausted) or unit in self._early or self.blocked(unit))

    def warm(self, unit: str) -> None:
        """Start fetching `unit` ahead of the next step, if `can_warm`."""
        key = SliceKey(unit, Kind.PARAM)
        if self.can_warm(unit) and self.store.at_home(key):
            self._early[unit] = self.store.fetch(key, to=Tier.DEVICE)

    def wants(self, unit: str) -> bool:
        """Whether the open step's plan would fetch `unit` now, within its budgets."""
        return self._in_step and any(request.unit == unit for request in self.policy.plan())

    def adopt(self, unit: str, transfer: Transfer[torch.Tensor]) -> None:
        """`unit`'s new PARAM slice, coming up to the device from the optimizer step's memory
        (`SliceStore.adopt`) rather than from its home: taken as a fetch started early."""
        self._early[unit] = transfer

    def acquire(self, unit: str, phase: Phase) -> torch.Tensor:
        """The unit's PARAM slice on the device: prefetched (a hit if it already landed) or fetched now."""
        key = SliceKey(unit, Kind.PARAM)
        if not self._in_step:
            return self.store.fetch(key, to=Tier.DEVICE).wait()
        self.policy.record(unit, phase)
        self._settle()
        transfer = self._ahead.pop(unit, None)
        if transfer is None and unit in self._kept:
            self._kept.discard(unit)
            transfer = self.store.fetch(key, to=Tier.DEVICE)  # still fetched: hands back the same copy
        if transfer is None:
            transfer = self._early.pop(unit, None)  # started early, and the plan has not come to it
        ready = transfer is not None and transfer.done()
        if transfer is None:
            transfer = self.store.fetch(key, to=Tier.DEVICE)
        started = time.perf_counter()
        shard = transfer.wait()
        waited = 0.0 if ready else time.perf_counter() - started
        self.policy.consumed(unit, ready=ready, waited_s=waited)
        self._issue()
        return shard

    def resume(self) -> None:
        """A blocked unit's slice was written: fetch ahead again, in order."""
        if self._in_step:
            self._issue()

    def done_with(self, unit: str, *, take: Callable[[SliceKey], bool] | None = None) -> None:
        """The unit's gather has read the slice: drop it, unless it runs again next, or `take(key)`
        takes the fetched copy over (True: taken, e.g. moved down to the optimizer step)."""
        if not self.keeps(unit):
            self.give_back(unit, take=take)

    def keeps(self, unit: str) -> bool:
        """Asked right after the unit's gather, while the policy follows the order: whether the
        slice stays fetched for the unit's next occurrence. If not, the caller gives it back
        (`give_back`) then or once it stops reading it (a gather that lent it)."""
        if self._in_step and self.policy.keep_resident(unit):
            self._kept.add(unit)
            return True
        return False

    def give_back(self, unit: str, *, take: Callable[[SliceKey], bool] | None = None) -> None:
        key = SliceKey(unit, Kind.PARAM)
        if take is None or not take(key):
            self.store.release(key)
        if self._in_step:
            self._issue()  # the slice is home again: its next occurrence can be fetched ahead

    def end_step(self, *, keep_warm: bool = False, cut_short: bool = False) -> StepReport | None:
        """Close the step, drop what was fetched ahead and not used; None for a step nothing used.

        `keep_warm` keeps the slices `warm` started for the next step's first units; `cut_short`:
        the engine closes, perhaps mid-step, so the order seen is no lesson (`Prefetcher.end_step`).
        """
        if not self._in_step:
            return None
        self._in_step = False
        self._settle()
        # The policy's own count: an interrupt may land between its record and anything kept here.
        recorded = self.policy.recorded
        if not recorded:
            self.policy.cancel_step()
        elif self.policy is self.reading:
            self.last_read_report = self.policy.end_step(cut_short=cut_short)
        else:
            self.last_report = self.policy.end_step(cut_short=cut_short)
        if not keep_warm:
            self._drop_early()
        for unit in [*self._ahead, *self._kept]:
            self.store.release(SliceKey(unit, Kind.PARAM))
        self._ahead.clear()
        self._kept.clear()
        if not recorded:
            return None
        return self.last_read_report if self.policy is self.reading else self.last_report

    def begin_reading(self) -> None:
        """A forward without gradients begins: end the training step, open one of `reading`'s
        ([Note: reading ahead without grad])."""
        self.end_step()
        self.policy = self.reading
        self.begin_step()

    def end_reading(self, *, cut_short: bool = False) -> None:
        """The no-grad forward ended (`cut_short`: by an exception, so its order is no lesson): close its
        step, keep what `warm` started for the next training step, and give the training policy back."""
        if self.policy is not self.reading:
            return
        try:
            self.end_step(keep_warm=True, cut_short=cut_short)
        finally:
            self.policy = self.training

    def drop(self) -> None:
        """End any step and give back every slice fetched ahead, `warm`'s too: nothing of this
        stage's stays fetched (the engine's `offload_states`)."""
        self.end_reading(cut_short=True)
        self.end_step(cut_short=True)
        self._drop_early()

    def _settle(self) -> None:
        """Tell the policy which prefetches have landed (their bytes left the in-flight budget)."""
        for unit, transfer in self._ahead.items():
            if transfer.done() and self.policy.fetch_state(unit) is FetchState.IN_FLIGHT:
                self.policy.completed(unit)

    def _issue(self) -> None:
        self._settle()
        for request in self.policy.plan():
            key = SliceKey(request.unit, Kind.PARAM)
            early = self._early.pop(request.unit, None)
            if early is not None:
                self._ahead[request.unit] = early
                self.policy.issued(request.unit)
                continue
            if not self.store.at_home(key) or self.blocked(request.unit):
                break  # held by its previous use, or not stepped yet: try again later, in order
            self._ahead[request.unit] = self.store.fetch(key, to=Tier.DEVICE)
            self.policy.issued(request.unit)

    def _drop_early(self) -> None:
        for unit in self._early:
            self.store.release(SliceKey(unit, Kind.PARAM))
        self._early.clear()
