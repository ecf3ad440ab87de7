"""What a checkpoint needs of an engine, spelled as protocols.

[Note: checkpointable engine]
The checkpoint package sees the engine only through `Checkpointable`, never the Engine
class, so imports run one way: tierzero.engine.engine -> tierzero.checkpoint -> the layers
below (units, slices, comm, stages.plan, precision). Anything with these members can
be saved and loaded; `tierzero.engine.engine.Engine` has them without naming this file
(tests/unit/test_checkpoint_protocol.py holds it to that). Members are read-only
properties unless a load writes them: the engine may back them by plain attributes,
properties or class variables alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from tierzero.comm.collectives import CommGroup
from tierzero.common.slices import SliceKey, Tier
from tierzero.stages.plan import SliceSpec
from tierzero.units.precision import LossScaler
from tierzero.units.unit import Unit

T_co = TypeVar("T_co", covariant=True)


class Pending(Protocol[T_co]):
    """A store operation in flight; `wait()` gives its result once it has landed."""

    def wait(self) -> T_co: ...


@runtime_checkable
class CheckpointStore(Protocol):
    """The tiered store as a checkpoint uses it: read a slice's bytes, write them home.

    Beyond what the stages use (tierzero.store.protocol.SliceStore), a save reads
    memory-homed slices in place with `home_tensor`: `fetch` refuses a slice already
    fetched to another tier (a prefetched parameter), and `release` would drop that copy.
    """

    def home_tensor(self, key: SliceKey) -> torch.Tensor:
        """The 1-D home of a device- or cpu-homed slice, without a copy."""
        ...

    def fetch(self, key: SliceKey, *, to: Tier) -> Pending[torch.Tensor]:
        """A copy of the slice in tier `to` (an NVMe home is read this way)."""
        ...

    def release(self, key: SliceKey) -> None:
        """Drop the copy `fetch` made."""
        ...

    def write_back(self, key: SliceKey, src: torch.Tensor | None = None) -> Pending[None]:
        """Copy `src` (same numel and dtype) to the slice's home."""
        ...


@runtime_checkable
class CheckpointStage(Protocol):
    """The ZeRO stage: which slices a rank keeps for a unit, and the dtypes and device they use."""

    @property
    def number(self) -> int:
        """The ZeRO stage, 1 to 3 (recorded in the manifest)."""
        ...

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the PARAM slices (recorded in the manifest)."""
        ...

    @property
    def device(self) -> torch.device:
        """Where device-homed slices live: a loaded value goes there before its write-back."""
        ...

    def slice_specs(self, unit: Unit) -> Sequence[SliceSpec]:
        """Every slice this rank keeps for `unit`, with its kind, numel, dtype and home tier."""
        ...

    def finish(self) -> None:
        """Wait for every collective and write-back in flight, so the slices hold their final bytes."""
        ...


@runtime_checkable
class RunConfig(Protocol):
    """The parts of the run's config a checkpoint reads."""

    @property
    def gradient_accumulation_steps(self) -> int:
        """Micro-steps per optimizer step: saves and loads happen only at a boundary."""
        ...

    def to_dict(self) -> dict[str, Any]:
        """The whole config as JSON values, recorded in the manifest (consolidate reads its model section)."""
        ...


@runtime_checkable
class Checkpointable(Protocol):
    """An engine that `save_checkpoint` and `load_checkpoint` can work on; see [Note: checkpointable engine]."""

    global_step: int
    """Optimizer steps taken: names the checkpoint directory; set by a load."""
    micro_steps: int
    """Micro-steps counted, a multiple of the accumulation steps at a boundary; set by a load."""
    lr: float
    """The learning rate in force; set by a load."""
    run_id: str
    """The run the checkpoints belong to: saves prune only its own; set by a load."""

    @property
    def cfg(self) -> RunConfig:
        """The run's config."""
        ...

    @property
    def comm(self) -> CommGroup:
        """This rank and the world size; every save and load is collective over it."""
        ...

    @property
    def units(self) -> Sequence[Unit]:
        """The units whose slices are saved, in the engine's order."""
        ...

    @property
    def stage(self) -> CheckpointStage:
        """The ZeRO stage that decides each unit's slices."""
        ...

    @property
    def store(self) -> CheckpointStore:
        """Where every slice lives."""
        ...

    @property
    def module(self) -> nn.Module:
        """The model: its state_dict holds the buffers and frozen parameters no unit owns."""
        ...

    @property
    def loss_scaler(self) -> LossScaler:
        """The loss scaler, whose state is saved and restored."""
        ...


@runtime_checkable
class GatheringStage(CheckpointStage, Protocol):
    """A stage that also gathers a unit whole: what a transformers or peft export reads."""

    def gather_fp32(self, unit: Unit) -> torch.Tensor:
        """The unit's full parameters in fp32 on every rank (a collective: every rank calls it for the same unit)."""
        ...


@runtime_checkable
class Exportable(Checkpointable, Protocol):
    """An engine whose model a whole-model format (transformers, peft) can write: `Checkpointable`
    whose stage gathers each unit whole, since those formats store full tensors, never shards."""

    @property
    def stage(self) -> GatheringStage:
        """The ZeRO stage, which gathers each unit's full fp32 parameters in turn."""
        ...
