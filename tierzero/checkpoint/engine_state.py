"""What checkpoints read from and write to an engine: its slices, layouts and scalars.

Kept apart from save_load.py so that the file protocol there never reaches into the
engine's attributes itself. The engine is seen only as a `Checkpointable` (protocol.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from tierzero.checkpoint.format import dtype_name
from tierzero.checkpoint.manifest import EngineScalars, SlotLayout, UnitLayout
from tierzero.checkpoint.moments import packed, saved_parts, split
from tierzero.checkpoint.protocol import Checkpointable
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.offload.tiers import traits_of
from tierzero.stages.plan import SliceSpec
from tierzero.units.unit import Unit


def saved_specs(engine: Checkpointable, unit: Unit) -> list[SliceSpec]:
    # Gradients are zero at a step boundary, and hpZ's secondary copy is rewritten by the next
    # forward: neither is state worth saving.
    return [spec for spec in engine.stage.slice_specs(unit) if spec.kind not in (Kind.GRAD, Kind.SECONDARY)]


def own_range(engine: Checkpointable, unit: Unit, spec: SliceSpec, tensor: torch.Tensor) -> torch.Tensor:
    """This rank's range of the unit's logical buffer: the slice itself, or its range of a replicated buffer."""
    if spec.codec is not None and spec.parameters != unit.shard_numel:  # this rank's piece of all N
        piece, rank = spec.codec.piece_nbytes(unit.shard_numel), engine.comm.rank
        return tensor[rank * piece : (rank + 1) * piece]
    if spec.parameters == unit.shard_numel:
        return tensor
    assert spec.parameters == unit.padded_numel, (unit.name, spec)
    start, end = unit.shard_range(engine.comm.rank)
    return tensor[start:end]


def wanted_range(engine: Checkpointable, unit: Unit, spec: SliceSpec) -> tuple[int, int]:
    if spec.codec is not None:  # bytes of the unit's pieces, one a rank ([Note: a quantized base in a checkpoint])
        piece, rank = spec.codec.piece_nbytes(unit.shard_numel), engine.comm.rank
        return (rank * piece, (rank + 1) * piece) if spec.parameters == unit.shard_numel else (0, unit.world_size * piece)
    if spec.parameters == unit.shard_numel:
        return unit.shard_range(engine.comm.rank)
    return 0, unit.padded_numel


def saved_tensors(engine: Checkpointable, unit: Unit, spec: SliceSpec, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """What the slice is saved as, in `saved_parts`' order: its own range, or an int8 moment's codes and absmax."""
    if packed(spec):
        yield from split(tensor, unit.shard_numel)
    else:
        yield own_range(engine, unit, spec, tensor)


@contextmanager
def slice_for_reading(engine: Checkpointable, unit: Unit, spec: SliceSpec) -> Iterator[torch.Tensor]:
    """The slice's current bytes: its home tensor in memory tiers, a host copy of any other home (NVMe)."""
    key = SliceKey(unit.name, spec.kind)
    if traits_of(spec.home).in_memory:
        yield engine.store.home_tensor(key)
        return
    tensor = engine.store.fetch(key, to=Tier.CPU).wait()
    try:
        yield tensor
    finally:
        engine.store.release(key)


#: A rank's JSON state file and its share of the manifest, generously.
_JSON_BYTES = 1 << 20


def checkpoint_nbytes(engine: Checkpointable) -> int:
    """About how many bytes this rank's files of one checkpoint take."""
    slices = sum(
        numel * dtype.itemsize
        for unit in engine.units
        for spec in saved_specs(engine, unit)
        for _, numel, dtype in saved_parts(spec, unit.shard_numel)
    )
    module = sum(t.numel() * t.element_size() for t in engine.module.state_dict().values())
    return slices + module + _JSON_BYTES


def unit_layout(engine: Checkpointable, unit: Unit) -> UnitLayout:
    return UnitLayout(
        name=unit.name,
        numel=unit.numel,
        padded_numel=unit.padded_numel,
        world_size=unit.world_size,
        slots=tuple(
            SlotLayout(names=tuple(b.name for b in slot.bindings), shape=tuple(slot.shape), offset=slot.offset, numel=slot.numel)
            for slot in unit.slots
        ),
        kinds={
            name: dtype_name(dtype) for spec in saved_specs(engine, unit) for name, _, dtype in saved_parts(spec, unit.shard_numel)
        },
    )


def read_scalars(engine: Checkpointable) -> EngineScalars:
    return EngineScalars(
        global_step=engine.global_step,
        micro_steps=engine.micro_steps,
        lr=engine.lr,
        loss_scaler=engine.loss_scaler.state_dict(),
        run_id=engine.run_id,
    )


def restore_scalars(engine: Checkpointable, scalars: EngineScalars) -> None:
    engine.global_step, engine.micro_steps, engine.lr = scalars.global_step, scalars.micro_steps, scalars.lr
    engine.loss_scaler.load_state_dict(scalars.loss_scaler)
    if scalars.run_id is not None:  # resumed: later saves continue (and prune) that run
        engine.run_id = scalars.run_id


def require_step_boundary(engine: Checkpointable, *, action: str) -> None:
    accumulation = engine.cfg.gradient_accumulation_steps
    if engine.micro_steps % accumulation:
        raise ValueError(
            f"cannot {action} in the middle of gradient accumulation "
            f"({engine.micro_steps % accumulation} of {accumulation} micro-steps done): call it after engine.step() "
            "completes an optimizer step"
        )

