"""Stage 3's optimizer step placed in time: read ahead as backward ends, run in the next forward,
and its new parameters handed up to the device instead of read back.

With clipping or fp16 overflow checks, no unit can step before backward has ended. The
units the step takes first have their states read while their backward runs
(`StepAhead`); with `zero.step_in_forward` each unit then steps in the next forward,
just before its gather (`ForwardStep`). Either way, the new parameters of the units the
next forward wants soon go up to the device from the step's memory (`hand_off`,
`SliceStore.adopt`): they cross the disk once, on their way home. Stage 3 mixes this in;
the arithmetic is `stages/step.py`'s, so none of it changes a bit.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.common.transfer import Transfer
from tierzero.stages.host_step import home_kinds, step_in_place, steps_in_place
from tierzero.stages.param_prefetch import ParamPrefetch
from tierzero.stages.speculative import Speculating
from tierzero.stages.step import ForwardStep, Steppable, StepScalars, group_sizes, slice_group, unit_step_tier
from tierzero.stages.step_pipeline import MAX_RESIDENT_GROUPS, PendingWrite, PipelineReport, Prepared, SliceGroup, StepPipeline
from tierzero.units.unit import Unit, is_root

__all__ = ["StepAhead", "StepInTime"]


class StepAhead:
    """The first reads of a step that waits for every gradient, started while backward ends.

    With clipping or fp16 overflow checks no unit can step before backward has ended,
    but the units that step first (the next forward's first) end their backward last:
    their states are read as their backward starts, while it and the units after it
    compute, so the step begins with them in memory. Reads only, the same bytes the
    step would read: `hand_over` gives them to the step's pipeline, which adds the
    gradients (`StepPipeline.prepare`).
    """

    def __init__(self, stage: Steppable, head: list[Unit], *, max_resident: int = MAX_RESIDENT_GROUPS) -> None:
        """`head`: the units the step pushes first, within the step pipeline's `max_resident` groups. Those
        whose slices are all read in place (their homes: a group of no bytes) have nothing to read ahead."""
        assert len(head) <= max_resident, head
        self._stage = stage
        sizes = group_sizes(stage)
        self._head = [unit for unit in head if sizes.get(unit.name, 1) > 0]

        def compute(group: SliceGroup, fetched: dict[Kind, torch.Tensor]) -> list[PendingWrite]:
            raise AssertionError(f"{group.unit}: a StepAhead only reads; its step's pipeline computes")

        self._pipeline = StepPipeline(stage.store, compute, max_resident=max_resident, sizes=sizes)

    def expect(self, unit: Unit) -> None:
        """`unit`'s backward has started and is its last this step: read its states if it steps first."""
        if unit in self._head:
            self._pipeline.prepare(slice_group(self._stage, unit))

    def hand_over(self) -> list[Prepared]:
        return self._pipeline.hand_over()

    def let_go(self, units: Collection[str]) -> None:
        """Release the reads started for `units`, which step without the pipeline ([Note: one host step])."""
        self._pipeline.drop_prepared(units)

    def abort(self) -> None:
        self._pipeline.abort()


class StepInTime(Speculating):
    """The step-timing half of `Stage3` (a mixin: it uses the stage's units, order, store and prefetcher;
    with `zero.step_schedule: speculative`, `Speculating`'s step during backward)."""

    units: list[Unit]
    trained: list[Unit]
    store: Any
    homes: Any
    plan: Any
    param_prefetch: ParamPrefetch | None
    last_step_report: Any
    _order: list[Unit]
    _order_now: list[Unit]
    _forward_step: ForwardStep | None
    _stepping_in_forward: bool
    _step_ahead: StepAhead | None

    def begin_step_ahead(self, *, in_forward: bool) -> None:
        """The coming backward's step waits for every gradient: read the states of the units it
        steps first while their backward runs (`StepAhead`); `in_forward`: it is a `defer_step`."""
        self.drop_step_ahead()
        if in_forward:
            order, bound = [u for u in self._order if u.trainable], ForwardStep.MAX_RESIDENT
        else:
            first = self._step_hooks().get("first", [])
            order = [u for name in first for u in self.units if u.name == name] + self.trained
            bound = MAX_RESIDENT_GROUPS
        # The groups the step holds first; not the root's, whose backward starts first and ends
        # last (it would be held all along): the step reads it when it comes to it.
        head = [unit for unit in list(dict.fromkeys(order))[:bound] if not is_root(unit)]
        self._step_ahead = StepAhead(self, head, max_resident=bound)

    def _read_ahead(self, job: Any, unit: Unit) -> None:
        """Read the states of the units whose backward follows `unit`'s, in that order, while the
        step's bound has room: a unit whose states live in memory computes while the disk reads
        the next ones', rather than idling. It stops at a unit whose gathered PARAM copy would be
        handed down (`_moves_down`: read early, it would be read twice), used again, or the root."""
        order = self._order_now[::-1]  # the backward takes the forward's units last to first
        for later in order[order.index(unit) + 1 :] if unit in order else ():
            if not later.trainable:
                continue
            if is_root(later) or later.pending_uses != 1 or self._moves_down(later) or not job.read_ahead(later):
                return

    def _moves_down(self, unit: Unit) -> bool:
        """fp32, PARAM on NVMe, a host step: the unit's step in backward may take its gathered copy."""
        host_step = unit_step_tier(self.homes, unit.name) is Tier.CPU
        return not self.mixed(unit) and host_step and self.plan.staged(unit.name, Kind.PARAM)

    def _hand_down(self, key: SliceKey, job: Any, unit: Unit, given: dict[Kind, Any]) -> bool:
        """Move the gather's PARAM copy down to the step tier for the unit's step (`_moves_down`)."""
        if not self._moves_down(unit) or not job.has_room(unit):
            return False
        given[Kind.PARAM] = self.store.adopt(key, to=Tier.CPU)
        return True

    def drop_step_ahead(self) -> None:
        """Forget the reads started ahead (a step skipped for overflow, or the engine closes)."""
        ahead, self._step_ahead = self._step_ahead, None
        if ahead is not None:
            ahead.abort()

    def _prepared_reads(self) -> list[Prepared]:
        ahead, self._step_ahead = self._step_ahead, None
        return [] if ahead is None else ahead.hand_over()

    def zero_grads(self) -> None:
        self.drop_step_ahead()
        super().zero_grads()

    def _step_in_place(self, scalars: StepScalars, *, clip_coef: float) -> None:
        """Step the units whose slices all live in host memory in one pass, before the pipeline takes
        the rest ([Note: one host step] in stages/host_step.py)."""
        units = [unit for unit in self.units if unit.has_grads and steps_in_place(self, unit)]
        if self._step_ahead is not None:
            self._step_ahead.let_go({unit.name for unit in units})
        units = [u for u in units if all(self.store.at_home(SliceKey(u.name, kind)) for kind in home_kinds(self, u))]
        if not units:
            return
        step_in_place(self, units, scalars, clip_coef=clip_coef)
        self.last_step_report = PipelineReport(groups=len(units))
        self._stepped(units[-1].name)

    def step(self, scalars: StepScalars, *, clip_coef: float, prepared: Sequence[Prepared] = ()) -> None:
        self._step_in_place(scalars, clip_coef=clip_coef)
        super().step(scalars, clip_coef=clip_coef, prepared=[*prepared, *self._prepared_reads()])
        if self.param_prefetch is not None and self.param_prefetch.policy.order:
            # Fetch the next forward's first units while the caller gets the next batch.
            self.param_prefetch.begin_step()

    def defer_step(self, scalars: StepScalars, *, clip_coef: float) -> None:
        """Step each unit in the next forward, just before its gather (stages/step.py `ForwardStep`)."""
        self.settle_speculation(clip_coef)
        self._land_last_step()
        self._step_in_place(scalars, clip_coef=clip_coef)
        if not any(unit.has_grads for unit in self.units):
            self.step(scalars, clip_coef=clip_coef)  # nothing to step (it ran in backward): start the next fetches
            return
        self._stepping_in_forward = True
        if self.param_prefetch is not None and self.param_prefetch.policy.order:
            # Open the next forward's prefetch step now: the first units step right away, and their new
            # slices go up (within its budgets) while the caller gets the next batch.
            self.param_prefetch.begin_step()
        self._forward_step = ForwardStep(
            self, scalars, clip_coef=clip_coef, order=self._order, written=self._stepped,
            prepared=self._prepared_reads(), hand_off=self.hand_off,
        )  # fmt: skip

    def settle_step(self) -> None:
        """Finish a deferred step: before backward, a checkpoint, or any read of the parameters."""
        job = self._forward_step
        # What the forward did not reach steps now, for the backward: its slices only go home,
        # and stay blocked from the prefetcher until stepped (the job stays attached meanwhile).
        self._stepping_in_forward = False
        if job is not None:
            try:
                self.last_step_report = job.finish()
            finally:
                self._forward_step = None

    def drop_step(self) -> None:
        """Forget a deferred step (the engine closes: its slices are about to go)."""
        job, self._forward_step = self._forward_step, None
        self._stepping_in_forward = False
        self.drop_speculation()
        if job is not None:
            job.abort()

    def _awaits_step(self, name: str) -> bool:
        job = self._forward_step
        if job is None:
            return self._stepping_in_forward  # being set up: what it steps is handed over (`hand_off`)
        return any(job.pending(u) for u in self.units if u.name == name)

    def _stepped(self, name: str) -> None:
        if self.param_prefetch is not None:
            self.param_prefetch.resume()

    def _step_hooks(self) -> dict[str, Any]:
        prefetch = self.param_prefetch
        if prefetch is None or not prefetch.policy.order:
            return {}
        # The next forward's first units step first, and their new slices start coming up
        # while the other units step: otherwise nothing could hide their reads.
        first = prefetch.policy.first_units()
        return {"first": first, "written": lambda unit: prefetch.warm(unit) if unit in first else None,
                "hand_off": self.hand_off}  # fmt: skip

    def hand_off(self, key: SliceKey) -> Transfer[torch.Tensor] | None:
        """Take the stepped unit's PARAM slice (fp32: the master the step fetched) up to the device
        from the step's memory, if the next forward wants it soon: it crosses the disk once. The
        move, which the step's pipeline waits for before it counts the host copy gone; None: not taken."""
        if key.kind is not Kind.PARAM or not self._wants_new_param(key.unit):
            return None
        assert self.param_prefetch is not None
        moved = self.store.adopt(key, to=Tier.DEVICE)
        self.param_prefetch.adopt(key.unit, moved)
        return moved

    def _wants_new_param(self, unit: str) -> bool:
        """Whether the next forward takes `unit`'s new parameters soon, within the prefetcher's
        budgets: a unit the forward's plan fetches now, or one of its first units between steps."""
        prefetch = self.param_prefetch
        if prefetch is None or not self.plan.staged(unit, Kind.PARAM) or self._speculation is not None:
            return False  # none, or a speculative step's, which may be redone (stages/speculative.py)
        if self._stepping_in_forward:
            return prefetch.wants(unit)
        return unit in prefetch.policy.first_units() and prefetch.can_warm(unit)
