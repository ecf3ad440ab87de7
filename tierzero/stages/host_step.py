"""A step of units whose every slice lives in the host memory they compute in: one pass for all of them.

[Note: one host step]
Without a GPU, a unit whose gradient pieces are held for the step ([Note: held gradient pieces]
in grads/held.py) and whose parameters, master and optimizer states live in host memory gives
the step pipeline nothing to move: each read is the home itself and each write lands in place.
What a unit then costs beside its optimizer pass is the pipeline's bookkeeping (reads, write-backs,
releases, the callbacks) and a native call of its own, 0.5-0.6 ms a unit at 100M parameters in 8
units (bench step-host, session 39): the interpreter's caches are cold after each unit's pass
through memory. Such units step together instead, before the pipeline takes the others: their
homes handed to one `FlatOptimizer.step_converting_many`, one native call for all of them. Each
element is stepped as alone, so the bits are those of a unit at a time (a slot at a time, as
torch.optim steps a tensor).

Only real host tensors take this path: the estimate's dry run (meta tensors) keeps the pipeline,
which moves no bytes for such slices either.
"""

from __future__ import annotations

from collections.abc import Sequence

from tierzero.common.slices import Kind, SliceKey
from tierzero.optim.base import ConvertingSlots
from tierzero.stages.step import Steppable, StepScalars, converts_on_host, slice_group, unit_step_tier
from tierzero.units.unit import Unit

__all__ = ["home_kinds", "steps_in_place", "step_in_place"]


def steps_in_place(stage: Steppable, unit: Unit) -> bool:
    """Whether `unit` can step in place, in host memory, from its held gradient pieces (the module note):
    it has them, the optimizer converts them on the host, and its PARAM slice and every slice its step
    reads live in memory (the slices' `at_home` is for the caller to check, once no read is left ahead)."""
    if stage.device.type != "cpu" or stage.held_grads.get(unit.name) is None:
        return False
    if not converts_on_host(stage, unit_step_tier(stage.homes, unit.name)):
        return False
    return not any(stage.plan.staged(unit.name, kind) for kind in (Kind.PARAM, *home_kinds(stage, unit)))


def home_kinds(stage: Steppable, unit: Unit) -> tuple[Kind, ...]:
    """The kinds of the slices a unit's step reads besides its gradient: its master (the PARAM slice
    of an fp32 unit at stage 3) and its optimizer states."""
    return tuple(kind for kind, _ in slice_group(stage, unit).fetches if kind is not Kind.GRAD)


def step_in_place(stage: Steppable, units: Sequence[Unit], scalars: StepScalars, *, clip_coef: float) -> None:
    """Step `units` (each `steps_in_place`, its slices at home) in one `step_converting_many`: each unit's
    master and states are its homes, its new parameters cast into its PARAM home (`cast_slice`), its held
    pieces its gradient; the pieces are then let go, as the pipeline's step lets them go."""
    store, optimizer = stage.store, stage.optimizer
    many = []
    for unit in units:
        pieces = stage.held_grads.get(unit.name)
        assert pieces is not None, unit.name
        master = store.home_tensor(SliceKey(unit.name, Kind.MASTER if stage.mixed(unit) else Kind.PARAM))
        states = {kind: store.home_tensor(SliceKey(unit.name, kind)) for kind in optimizer.state_kinds}
        slots = [(slot.offset, piece, slot.group) for slot, piece in zip(unit.slots, pieces.tensors, strict=True)]
        many.append(ConvertingSlots(master, slots, states, stage.cast_slice(unit, master)))
    lrs = optimizer.group_lrs(scalars.lr_factor)
    optimizer.step_converting_many(many, scale=scalars.grad_scale * clip_coef, step=scalars.step, lr=lrs)
    for unit, one in zip(units, many, strict=True):
        if one.cast is not None:
            one.cast[unit.numel :].zero_()  # the padding after the slots, as `step_pieces` casts it
        for write in stage.publish(unit, one.param, cast=one.cast):
            write.transfer.wait()  # none where the cast is the PARAM home (Stage3.cast_slice), as here
        stage.held_grads.take(unit.name)
        unit.has_grads = False
