"""One optimizer step of a stage, run where its optimizer states live.

Which slices a unit's step needs, and the arithmetic on them; the movement of bytes is
`tierzero.stages.step_pipeline.StepPipeline`'s ([Note: the step pipeline] there). The bits are
the same whatever the placement, and whatever form the gradient comes in: a slice, copied or
read in place, or autograd's own tensors ([Note: gradient pieces]), converted as they are read.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tierzero.comm.collectives import CommGroup
from tierzero.common.slices import Kind, SliceKey, Tier, align_up
from tierzero.common.transfer import Transfer
from tierzero.optim.flat import FlatOptimizer, SliceLayout
from tierzero.stages.grads.held import HeldGrads
from tierzero.stages.grads.pieces import GradPieces, book, step_pieces
from tierzero.stages.plan import Homes, SlicePlan
from tierzero.stages.step_pipeline import (
    MAX_RESIDENT_GROUPS,
    PendingWrite,
    PipelineReport,
    Prepared,
    SliceGroup,
    StepPipeline,
    step_tier,
)
from tierzero.store.protocol import SliceStore
from tierzero.units.unit import Unit

__all__ = [
    "BackwardStep", "ForwardStep", "HandOff", "Keep", "StepScalars", "Steppable", "converts_on_host", "run_step",
    "slice_group", "unit_step_tier",
]


#: Offered each stepped slice: the move of the fetched copy it took over, or None (`StepPipeline`'s `hand_off`).
HandOff = Callable[[SliceKey], Transfer[torch.Tensor] | None]
#: Shown a unit's fetched slices before its step overwrites them (`tierzero.stages.speculative`).
Keep = Callable[[Unit, dict[Kind, torch.Tensor]], None]


@dataclass(frozen=True, slots=True)
class StepScalars:
    """What the engine decided for one optimizer step, the same on every rank."""

    grad_scale: float
    """Multiplies the summed gradient slices: 1 / (world size x accumulation x loss scale)."""
    step: int
    lr_factor: float
    """The schedule's multiplier this step: each parameter group steps at its base lr times it."""


class Steppable(Protocol):
    """What the step asks of a stage (`tierzero.stages.base.Stage` is one)."""

    units: list[Unit]
    store: SliceStore
    comm: CommGroup
    optimizer: FlatOptimizer
    held_grads: HeldGrads
    homes: Homes
    plan: SlicePlan
    device: torch.device
    shards_params: bool
    shards_grads: bool

    def mixed(self, unit: Unit) -> bool: ...

    def dtype_of(self, unit: Unit) -> torch.dtype: ...

    def grad_slice(self, grads: torch.Tensor, unit: Unit) -> torch.Tensor: ...

    def publish(self, unit: Unit, master: torch.Tensor, *, cast: torch.Tensor | None = None) -> list[PendingWrite]: ...

    def cast_slice(self, unit: Unit, master: torch.Tensor) -> torch.Tensor | None: ...

    def unshard(self, unit: Unit) -> None: ...

    def leaves_grads_stale(self, unit: str) -> bool: ...


def slice_group(stage: Steppable, unit: Unit) -> SliceGroup:
    """The slices the unit's step fetches, and where to: states to the step tier, grads as cheaply as possible."""
    tier = unit_step_tier(stage.homes, unit.name)
    fetches: list[tuple[Kind, Tier]] = [(Kind.GRAD, _grad_tier(stage, unit.name))]
    if stage.mixed(unit):
        fetches.append((Kind.MASTER, tier))
    elif stage.shards_params:
        fetches.append((Kind.PARAM, tier))  # fp32 stage 3: the PARAM slice is its own master
    fetches += [(kind, tier) for kind in stage.optimizer.state_kinds]
    return SliceGroup(unit=unit.name, fetches=tuple(fetches))


def group_sizes(stage: Steppable) -> dict[str, int]:
    """Each trained unit's step group in the bytes the store allocates for it (`StepPipeline`'s `sizes`),
    so that a small unit's group takes a small part of the bound. A slice fetched to its home tier is the
    home itself: a unit whose states live in memory takes only its gradient's part."""
    sizes = {}
    for unit in stage.units:
        if unit.trainable:
            to = dict(slice_group(stage, unit).fetches)
            copied = [spec for spec in stage.plan.of(unit) if spec.kind in to and spec.home is not to[spec.kind]]
            sizes[unit.name] = sum(align_up(spec.nbytes) for spec in copied)
    return sizes


def unit_step_tier(homes: Homes, unit: str) -> Tier:
    """Where `unit` steps: where its optimizer states live (`Homes.units` may place them apart from the rest)."""
    return step_tier(homes.tier(unit, "optimizer"))


def _grad_tier(stage: Steppable, unit: str) -> Tier:
    """Where the step takes the gradients from. NVMe-homed ones come up to the step tier, and so do a
    GPU's sharded gradients for a step on the host: the swapper copies them on its copy stream while the
    pipeline reads ahead, where a copy in the compute would block the host. Otherwise they are read in place."""
    tier, home = unit_step_tier(stage.homes, unit), stage.plan.home(unit, Kind.GRAD)
    if stage.plan.staged(unit, Kind.GRAD) or (home is not tier and stage.shards_grads and stage.device.type == "cuda"):
        return tier
    return home


def run_step(
    stage: Steppable,
    scalars: StepScalars,
    *,
    clip_coef: float,
    first: list[str] | None = None,
    written: Callable[[str], None] | None = None,
    prepared: Sequence[Prepared] = (),
    hand_off: HandOff | None = None,
) -> PipelineReport:
    """Step every unit that has gradients, in unit order, through the pipeline.

    A unit that ran no forward since the last step keeps its parameters and states, as
    torch.optim skips parameters whose .grad is None. Every rank runs the same modules
    (ZeRO's collectives assume it), so every rank skips the same units. The units in
    `first` step first, in that order, and `written(unit)` is told as soon as a unit's
    new parameters are on their way home. `prepared`: reads a `StepAhead` started.
    """
    units = [unit for unit in stage.units if unit.has_grads]
    for unit in stage.units:
        unit.has_grads = False
    # The groups read ahead step first, so that they never stay held beside the bound's groups.
    ahead = [group.unit for group, _ in prepared]
    head = [unit for name in [*ahead, *(first or ())] for unit in units if unit.name == name]
    ordered = list(dict.fromkeys(head)) + [unit for unit in units if unit not in head]
    pipeline = _pipeline(stage, scalars, clip_coef=clip_coef, written=written, prepared=prepared, hand_off=hand_off)
    # Drained: the step leaves no host copy behind, so the next step's memory starts from zero.
    return pipeline.run([slice_group(stage, unit) for unit in ordered])


class BackwardStep:
    """The optimizer step run during backward: each unit steps once backward has finished its gradient.

    Only where no step-wide decision waits for all gradients: no clipping (the global
    norm) and no fp16 overflow check. A unit is pushed when its gradient is final; its
    states are read while backward goes on with the next units, and it computes when
    the next unit is pushed (see `StepPipeline`). The arithmetic is `run_step`'s, so
    the bits are the same as stepping after backward.
    """

    def __init__(self, stage: Steppable, scalars: StepScalars, *, written: Callable[[str], None] | None = None,
                 hand_off: HandOff | None = None, keep: Keep | None = None) -> None:  # fmt: skip
        """`keep(unit, fetched)`: shown each unit's fetched slices just before its step overwrites them."""
        self._stage = stage
        self._pieces: dict[str, GradPieces] = {}
        """Gradients handed over as pieces (`ready`), booked in the store's ledger until stepped."""

        def stepped(unit: str) -> None:
            self._unbook(unit)
            if written is not None:
                written(unit)

        self._pipeline = _pipeline(stage, scalars, clip_coef=1.0, written=stepped, hand_off=hand_off, keep=keep)

    def expect(self, unit: Unit, *, given: dict[Kind, Transfer[torch.Tensor]] | None = None) -> None:
        """`unit`'s backward has started: read its states now, ahead of its gradient (`given`: those
        already on their way, see `StepPipeline.prepare`), once there is room (`has_room`)."""
        if self.has_room(unit) or given:  # a slice given without room: `prepare` says so
            self._pipeline.prepare(slice_group(self._stage, unit), given=given)

    def read_ahead(self, unit: Unit) -> bool:
        """Read the states of `unit`, whose backward comes later, now if the bound has room without
        waiting for a write-back: whether they are read (or were already). Its PARAM slice is left
        to the push: the unit's gather has yet to read it."""
        group = slice_group(self._stage, unit)
        if self._pipeline.is_prepared(group):
            return True
        if not self._pipeline.has_room(group):
            return False
        self._pipeline.prepare(group, leave=Kind.PARAM)
        return True

    def has_room(self, unit: Unit) -> bool:
        """Whether `expect(unit)` reads ahead: after the oldest write-backs land where that makes
        room. The unit's `ready` would wait for them anyway; waiting before its backward, its
        states are read while that backward runs, and its gathered parameters can move down
        (`Stage3._hand_down`) instead of being read from NVMe again."""
        return self._pipeline.has_room(slice_group(self._stage, unit), wait=True)

    def ready(
        self, unit: Unit, *, grad: Transfer[torch.Tensor] | None = None, pieces: GradPieces | None = None
    ) -> None:
        """`unit`'s gradient for this step is complete: start its step (`grad`: its GRAD slice already
        on its way to the step tier, handed over from memory; `pieces`: autograd's own tensors,
        see [Note: gradient pieces])."""
        unit.has_grads = False
        group = slice_group(self._stage, unit)
        if pieces is not None:
            book(self._stage.store, pieces, held=True)
            self._pieces[unit.name] = pieces
            self._pipeline.push(group, given={Kind.GRAD: Transfer.ready(pieces)}, outside=frozenset({Kind.GRAD}))
        else:
            self._pipeline.push(group, given=None if grad is None else {Kind.GRAD: grad})

    def grad_tier(self, unit: Unit) -> Tier:
        """Where the unit's step takes its gradient."""
        return _grad_tier(self._stage, unit.name)

    def finish(self) -> PipelineReport:
        """Step the last unit pushed; the last write-backs may still be landing (`report.wait()`)."""
        return self._pipeline.flush(drain=False)

    def abort(self) -> None:
        try:
            self._pipeline.abort()
        finally:
            for unit in list(self._pieces):
                self._unbook(unit)

    def _unbook(self, unit: str) -> None:
        held = self._pieces.pop(unit, None)
        if held is not None:
            book(self._stage.store, held, held=False)


class ForwardStep:
    """The optimizer step run in the next forward's order: each unit steps just before its gather.

    For steps that need every gradient first (clipping, fp16 overflow checks): the scalars
    are known once backward has ended, so the step can wait for the next forward, which
    needs each unit's new parameters only when it reaches the unit. A unit is pushed when
    the forward needs the one before it, so its states are read while that one computes
    (see `StepPipeline`). Units the forward does not reach step at `finish`. The arithmetic
    is `run_step`'s, so the bits are the same as stepping after backward.
    """

    LOOKAHEAD = 2
    """Units stepped ahead of the one the forward reaches: time for their writes to land."""
    MAX_RESIDENT = 3
    """Groups held at once beside the forward's own memory: read ahead, computing, writing."""

    def __init__(self, stage: Steppable, scalars: StepScalars, *, clip_coef: float, order: list[Unit],
                 written: Callable[[str], None] | None = None, prepared: Sequence[Prepared] = (),
                 hand_off: HandOff | None = None) -> None:  # fmt: skip
        units = [unit for unit in stage.units if unit.has_grads]
        for unit in stage.units:
            unit.has_grads = False
        ahead = [unit for unit in order if unit in units]
        self._queue = ahead + [unit for unit in units if unit not in ahead]
        self._stage = stage
        self._pushed = 0
        self._stepped: set[str] = set()
        self._report: PipelineReport | None = None

        def stepped(unit: str) -> None:
            self._stepped.add(unit)
            if written is not None:
                written(unit)

        self._pipeline = _pipeline(
            stage, scalars, clip_coef=clip_coef, written=stepped, prepared=prepared, hand_off=hand_off,
            max_resident=self.MAX_RESIDENT,
        )  # fmt: skip
        if self._queue:
            # The forward's first units step now, while the caller gets the next batch, so that
            # their new parameters can come up before the forward starts.
            self.need(self._queue[0])

    def pending(self, unit: Unit) -> bool:
        """Whether `unit` still waits for its step (its parameters are not the new ones yet)."""
        return unit in self._queue and unit.name not in self._stepped

    def need(self, unit: Unit) -> None:
        """Step every unit queued up to `unit`, which the forward reaches now, and `LOOKAHEAD` after
        it: their new parameters are then written and come up (the prefetcher) while `unit` computes."""
        if unit not in self._queue:
            return
        # The units stepped so far had the forward's last unit to land their write-backs: waiting
        # for them bounds the host copies by the groups read and computing (on a disk that keeps
        # up, as `tierzero estimate` counts them), at no cost (bench train --clip: within noise).
        self._pipeline.drain(keep=0)
        index = self._queue.index(unit)
        target = self._queue[min(index + self.LOOKAHEAD, len(self._queue) - 1)]
        while self.pending(target):
            if self._pushed < len(self._queue):
                self._push_next()  # computes the unit pushed before it
            else:
                self.finish()

    def finish(self) -> PipelineReport:
        """Step what the forward did not reach; the last write-backs may still be landing."""
        if self._report is None:
            while self._pushed < len(self._queue):
                self._push_next()
            self._report = self._pipeline.flush(drain=False)
        return self._report

    def abort(self) -> None:
        self._pipeline.abort()

    def _push_next(self) -> None:
        self._pipeline.push(slice_group(self._stage, self._queue[self._pushed]))
        self._pushed += 1


def _pipeline(
    stage: Steppable,
    scalars: StepScalars,
    *,
    clip_coef: float,
    written: Callable[[str], None] | None,
    prepared: Sequence[Prepared] = (),
    hand_off: HandOff | None = None,
    max_resident: int = MAX_RESIDENT_GROUPS,
    keep: Keep | None = None,
) -> StepPipeline:
    by_name = {unit.name: unit for unit in stage.units}

    def compute(group: SliceGroup, fetched: dict[Kind, torch.Tensor]) -> list[PendingWrite]:
        if keep is not None:
            keep(by_name[group.unit], fetched)
        return _step_unit(stage, by_name[group.unit], fetched, scalars, clip_coef=clip_coef)

    told = None if written is None else (lambda group: written(group.unit))
    return StepPipeline(
        stage.store, compute, written=told, prepared=prepared, hand_off=hand_off, max_resident=max_resident,
        keep_home=lambda key: key.kind is Kind.GRAD and stage.leaves_grads_stale(key.unit), sizes=group_sizes(stage),
    )  # fmt: skip


def _step_unit(
    stage: Steppable, unit: Unit, fetched: dict[Kind, torch.Tensor], scalars: StepScalars, *, clip_coef: float
) -> list[PendingWrite]:
    tier = unit_step_tier(stage.homes, unit.name)
    store = stage.store
    held = stage.held_grads.get(unit.name)  # [Note: held gradient pieces]: in place of the home's slice
    grads = fetched[Kind.GRAD] if held is None else held
    lrs = stage.optimizer.group_lrs(scalars.lr_factor)
    if isinstance(grads, GradPieces):  # [Note: gradient pieces]: one rank, its home left as it was
        master, scratch = _master(stage, unit, fetched, tier)
        assert not scratch, "pieces are stage 3's, whose step fetches its master"
        states = {kind: fetched[kind] for kind in stage.optimizer.state_kinds}
        converting = converts_on_host(stage, tier)
        cast = stage.cast_slice(unit, master) if converting else None
        per_unit = stage.optimizer.per_unit and not converting
        optimizer = stage.optimizer.for_unit(unit, rank=stage.comm.rank, master=master) if per_unit else stage.optimizer
        step_pieces(optimizer, unit, master=master, pieces=grads, states=states, scale=scalars.grad_scale * clip_coef,
                    step=scalars.step, lrs=lrs, converting=converting, cast=cast)  # fmt: skip
        stage.held_grads.take(unit.name)
        return stage.publish(unit, master, cast=cast)
    source = stage.grad_slice(grads, unit)
    # The GRAD slice is zeroed (or left stale) after the step, so when it already is fp32 in
    # the step tier's memory it is the optimizer's gradient itself (scaled, and used as
    # scratch by SGD's weight decay, in place): same bits as a copy, one slice-sized pass
    # fewer. Judged by tier, not by tensor, so that the estimate's meta tensors count alike:
    # without a GPU every memory tier is host memory.
    same_memory = _grad_tier(stage, unit.name) is tier or stage.device.type == "cpu"
    in_place = source.dtype == torch.float32 and same_memory
    # A low-precision gradient in the memory of a host step is converted a chunk at a time by
    # the optimizer itself ([Note: the converting step] in optim/flat.py): no fp32 scratch slice.
    converting = not in_place and same_memory and converts_on_host(stage, tier)
    g = source if in_place or converting else store.allocate(
        kind=Kind.GRAD, numel=source.numel(), dtype=torch.float32, tier=tier, label=f"{unit.name} step"
    )
    master, scratch_master = _master(stage, unit, fetched, tier)
    scale = scalars.grad_scale * clip_coef
    try:
        states = {kind: fetched[kind] for kind in stage.optimizer.state_kinds}
        # Cut at the unit's original tensors, so that each element takes the vector lane or the
        # scalar tail torch.optim's per-tensor kernel would give it: the same bits as torch.
        layout = SliceLayout.of([slot.numel for slot in unit.slots], offset=unit.shard_range(stage.comm.rank)[0],
                                groups=[slot.group for slot in unit.slots])  # fmt: skip
        cast = stage.cast_slice(unit, master) if converting else None
        if converting:
            stage.optimizer.step_converting(
                param=master, grad=source, scale=scale, states=states, step=scalars.step, lr=lrs, layout=layout,
                cast=cast,
            )  # fmt: skip
        else:
            if not in_place:
                g.copy_(source)
            if scale != 1.0:
                g.mul_(scale)
            # [Note: a torch.optim class per unit]
            optimizer = stage.optimizer.for_unit(unit, rank=stage.comm.rank, master=master) if stage.optimizer.per_unit else stage.optimizer
            optimizer.step(param=master, grad=g, states=states, step=scalars.step, lr=lrs, layout=layout)
        writes = stage.publish(unit, master, cast=cast)
        if stage.leaves_grads_stale(unit.name):
            unit.grads_stale = True  # the pipeline releases the slice unwritten (`keep_home`)
        else:
            grads.zero_()
            unit.grads_zero = True
    finally:
        if not in_place and not converting:
            store.free(g)
        if scratch_master:
            store.free(master)
    return writes


def converts_on_host(stage: Steppable, tier: Tier) -> bool:
    """Whether a step in `tier` runs on the host by an optimizer widening a gradient as it reads it ([Note: the converting step])."""
    return _steps_on_host(stage, tier) and stage.optimizer.converts_gradients


def computes_on_host(device: torch.device) -> bool:
    """Whether the units compute in host memory: on the CPU, or in the estimate's dry run (the meta
    device) standing for a machine without a GPU."""
    return device.type == "cpu" or (device.type == "meta" and not torch.cuda.is_available())


def _steps_on_host(stage: Steppable, tier: Tier) -> bool:
    """Whether the step runs on the host: the cpu tier's, or any tier's where the units compute on the
    host, judged by tier so that the dry run counts alike."""
    return tier is Tier.CPU or computes_on_host(stage.device)


def _master(stage: Steppable, unit: Unit, fetched: dict[Kind, torch.Tensor], tier: Tier) -> tuple[torch.Tensor, bool]:
    """(the fp32 slice to step, whether it is step-tier scratch the caller frees)."""
    if Kind.MASTER in fetched:
        return fetched[Kind.MASTER], False
    if Kind.PARAM in fetched:
        return fetched[Kind.PARAM], False
    # fp32 stages 1 and 2: the owned range of the full parameters, resident on the device.
    stage.unshard(unit)
    assert unit.gathered is not None
    start, end = unit.shard_range(stage.comm.rank)
    own = unit.gathered[start:end]
    if tier is Tier.DEVICE:
        return own, False
    copy = stage.store.allocate(kind=Kind.MASTER, numel=own.numel(), dtype=torch.float32, tier=tier, label=unit.name)
    copy.copy_(own)
    return copy, True
