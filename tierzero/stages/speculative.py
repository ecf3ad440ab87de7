"""Stage 3's optimizer step during backward with clipping on: speculative, redone when the norm clips.

[Note: the speculative step]
With clipping, no unit's step may start before the global norm is known, so the exact
schedule steps after backward or in the next forward (`stages/step_in_time.py`). With
`zero.step_schedule: speculative` each unit steps during backward as soon as its
gradient is complete (`BackwardStep`), with the coefficient 1, as if the norm did not
clip. Just before a unit's step overwrites its slices, they are copied to host memory
(the keep): the gradient, the fp32 master (or fp32 PARAM) and the optimizer states,
all the step reads. Once backward has ended and the norm is known, a coefficient of
exactly 1.0 is the bits the serial step gives (torch clamps it to 1: the gradients are
not multiplied), so the keep is dropped. Otherwise every kept slice is written back
home, the units are marked as having gradients again, and the ordinary step after
backward (`run_step`) steps them with the coefficient: the serial arithmetic on the
serial inputs, hence the serial bits. The step counter is the engine's, passed in
`StepScalars`: the redo steps with the same one, so bias correction never advances
twice. The compute-dtype PARAM the first step published is rewritten by the redo, and
nothing reads it in between (the next forward comes after the step), which is why the
speculative step hands nothing up to the device ahead of the next forward.

The keep holds one step's worth: for each unit, its GRAD, master and state slices (16
bytes a parameter with AdamW in mixed precision, 12 in fp32 where PARAM is the master,
divided among the ranks), booked in the store's ledger as host scratch until dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from tierzero.common.slices import Kind, Tier
from tierzero.stages.grads.landing import add_into
from tierzero.stages.grads.pieces import GradPieces
from tierzero.stages.step import BackwardStep, StepScalars
from tierzero.stages.step_pipeline import Prepared
from tierzero.units.unit import Unit

__all__ = ["SpeculativeStep", "Speculating"]


class SpeculativeStep(BackwardStep):
    """A `BackwardStep` with clipping on: steps with the coefficient 1 and keeps what it overwrote,
    so that `settle` can redo it exactly ([Note: the speculative step])."""

    def __init__(self, stage: Any, scalars: StepScalars) -> None:
        self._kept: dict[str, tuple[Unit, dict[Kind, torch.Tensor]]] = {}
        """Each stepped unit's slices as they were before its step, in host memory."""
        self._pinned = stage.device.type == "cuda"
        # No `written`/`hand_off`: the new parameters are not final until `settle`, so none goes up early.
        super().__init__(stage, scalars, keep=self._keep)

    def ready(self, unit: Unit, *, grad: Any = None, pieces: GradPieces | None = None) -> None:
        """As `BackwardStep.ready`; autograd's pieces are landed in the unit's GRAD slice first, the
        exact schedule's way, so that the norm counts them with the same bits (the landing then calls
        `ready` again, without pieces)."""
        if pieces is None:
            super().ready(unit, grad=grad)
            return
        landing = self._stage._landing  # GradLanding's: the path every gradient takes without pieces
        with landing(unit, final=True) as (shard, fresh, squares):
            add_into(shard, pieces.placed(unit), fresh=fresh, squares=squares)

    @property
    def kept_units(self) -> int:
        return len(self._kept)

    def settle(self, clip_coef: float) -> bool:
        """The norm is known: whether the units stepped must step again (their slices are then home as
        before their step, marked as having gradients, for the step after backward to take)."""
        try:
            if clip_coef == 1.0:
                return False
            self._stage._land_last_step()  # the speculative write-backs land before the old bytes go home
            for unit, kept in self._kept.values():
                self._restore(unit, kept)
            return bool(self._kept)
        finally:
            self.drop()

    def drop(self) -> None:
        """Give the keep back (settled, or abandoned: a closing engine, a skipped step)."""
        for _, kept in self._kept.values():
            for kind, tensor in kept.items():
                self._stage.store.book(Tier.CPU, kind, -_nbytes(tensor))
        self._kept.clear()

    def abort(self) -> None:
        try:
            super().abort()
        finally:
            self.drop()

    def _keep(self, unit: Unit, fetched: dict[Kind, torch.Tensor]) -> None:
        assert unit.name not in self._kept, f"{unit.name} stepped twice in one backward"
        kept = {}
        for kind, tensor in fetched.items():
            assert isinstance(tensor, torch.Tensor), f"{unit.name}: {kind} kept as {type(tensor).__name__}"
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self._pinned)
            copy.copy_(tensor)
            self._stage.store.book(Tier.CPU, kind, _nbytes(copy))
            kept[kind] = copy
        self._kept[unit.name] = (unit, kept)

    def _restore(self, unit: Unit, kept: dict[Kind, torch.Tensor]) -> None:
        stage = self._stage
        for kind, tensor in kept.items():
            with stage.slice(unit, kind, write=True, unread=True) as home:
                home.copy_(tensor)
        # The home holds this step's gradient sum now, whatever the step left there.
        unit.grads_stale = unit.grads_zero = False
        unit.has_grads = True


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Speculating:
    """The speculative half of `Stage3`'s step (a mixin, below `StepInTime`): a backward step with
    clipping on is a `SpeculativeStep`, settled when the engine steps with the norm's coefficient."""

    grad_norm: Any
    _backward_step: BackwardStep | None
    _land_last_step: Any
    _speculation: SpeculativeStep | None = None
    redone_steps: int = 0
    """Steps whose speculative step was redone because the norm clipped."""

    def begin_backward_step(self, scalars: StepScalars) -> None:
        if not self.grad_norm.enabled:  # no clipping: nothing to redo
            super().begin_backward_step(scalars)
            return
        self.drop_speculation()
        self._land_last_step()
        self._speculation = SpeculativeStep(self, scalars)
        self._backward_step = self._speculation

    def settle_speculation(self, clip_coef: float) -> None:
        """Keep the speculative step, or put its units back to step with `clip_coef` (the engine's step)."""
        job, self._speculation = self._speculation, None
        if job is not None and job.settle(clip_coef):
            self.redone_steps += 1

    def drop_speculation(self) -> None:
        job, self._speculation = self._speculation, None
        if job is not None:
            job.drop()

    def step(self, scalars: StepScalars, *, clip_coef: float, prepared: Sequence[Prepared] = ()) -> None:
        self.settle_speculation(clip_coef)
        super().step(scalars, clip_coef=clip_coef, prepared=prepared)

    def zero_grads(self) -> None:
        self.drop_speculation()
        super().zero_grads()

