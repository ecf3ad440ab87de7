"""The slice plan: every slice each unit keeps on this rank, with its size, dtype and home tier.

Computed once, by `plan_slices`, before anything is allocated. The engine sizes the
store's swap file and the prefetcher's budgets from it, the stage registers exactly
these slices, checkpoints save them, and `tierzero estimate` runs the same engine over
the same plan with a store that only counts bytes.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from tierzero.slices import Kind, Tier, align_up
from tierzero.units import Unit

__all__ = ["Homes", "SlicePlan", "SliceSpec", "plan_slices"]


@dataclass(frozen=True, slots=True)
class Homes:
    """The home tier of each kind of model state, from `cfg.offload.*`."""

    params: Tier = Tier.DEVICE
    grads: Tier = Tier.DEVICE
    optimizer: Tier = Tier.DEVICE


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """One slice a stage keeps per unit: what it holds, how big, where it lives."""

    kind: Kind
    numel: int
    dtype: torch.dtype
    home: Tier

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class SlicePlan:
    """Each unit's slices on this rank, by unit name, in unit order."""

    specs: dict[str, tuple[SliceSpec, ...]]
    grad_dtype: torch.dtype
    """The dtype gradients are reduced and kept in (`precision.reduce_dtype`)."""

    def of(self, unit: Unit) -> tuple[SliceSpec, ...]:
        return self.specs[unit.name]

    def all(self) -> Iterable[SliceSpec]:
        return (spec for specs in self.specs.values() for spec in specs)

    def nvme_bytes(self) -> int:
        """What this rank's swap file must hold: every NVMe-homed slice at its I/O-aligned size."""
        return sum(align_up(spec.nbytes) for spec in self.all() if spec.home is Tier.NVME)

    def fetched_param_bytes(self) -> dict[str, int]:
        """What a fetched copy of each unit's PARAM slice costs the device tier (its region, I/O-aligned)."""
        return {
            name: align_up(spec.nbytes) for name, specs in self.specs.items() for spec in specs if spec.kind is Kind.PARAM
        }


def plan_slices(
    units: list[Unit],
    *,
    shards_params: bool,
    shards_grads: bool,
    param_dtype: torch.dtype,
    grad_dtype: torch.dtype | None = None,
    state_kinds: tuple[Kind, ...],
    homes: Homes,
    secondary_parts: int = 0,
) -> SlicePlan:
    """PARAM in the compute dtype and GRAD in the reduce dtype (the compute dtype unless given),
    sharded as the stage says, an fp32 MASTER in mixed precision, and the optimizer's fp32
    states, each sharded, each at its kind's home. A frozen unit keeps its PARAM slice only:
    in the compute dtype, with no fp32 copy, since nothing steps it. With `secondary_parts`
    (hpZ), every unit also keeps a SECONDARY slice, 1/secondary_parts of its parameters in
    the compute dtype, at the parameters' home."""
    grad_dtype = grad_dtype or param_dtype
    mixed = param_dtype != torch.float32
    specs = {}
    for unit in units:
        shard = unit.shard_numel
        unit_specs = [SliceSpec(Kind.PARAM, shard if shards_params else unit.padded_numel, param_dtype, homes.params)]
        if secondary_parts:
            part = unit.padded_numel // secondary_parts
            unit_specs.append(SliceSpec(Kind.SECONDARY, part, param_dtype, homes.params))
        if not unit.trainable:
            specs[unit.name] = tuple(unit_specs)
            continue
        unit_specs.append(SliceSpec(Kind.GRAD, shard if shards_grads else unit.padded_numel, grad_dtype, homes.grads))
        if mixed:
            unit_specs.append(SliceSpec(Kind.MASTER, shard, torch.float32, homes.optimizer))
        unit_specs += [SliceSpec(kind, shard, torch.float32, homes.optimizer) for kind in state_kinds]
        specs[unit.name] = tuple(unit_specs)
    return SlicePlan(specs=specs, grad_dtype=grad_dtype)
