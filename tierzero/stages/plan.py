"""The slice plan: every slice each unit keeps on this rank, with its size, dtype and home tier.

Computed once, by `plan_slices`, before anything is allocated. The engine sizes the
store's swap file and the prefetcher's budgets from it, the stage registers exactly
these slices, checkpoints save them, and `tierzero estimate` runs the same engine over
the same plan with a store that only counts bytes.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial

import torch

from tierzero.common.slices import Kind, Tier, align_up
from tierzero.config import ConfigError, OffloadConfig
from tierzero.offload.tiers import traits_of
from tierzero.optim.moments import MomentFormat
from tierzero.units.quantized_base import BaseCodec
from tierzero.units.unit import Unit

__all__ = ["KIND_HOMES", "Homes", "SlicePlan", "SliceSpec", "plan_slices"]


#: The kinds each `Homes` field places: the optimizer's tier holds the fp32 master with the states.
KIND_HOMES: dict[Kind, str] = {
    Kind.PARAM: "params",
    Kind.SECONDARY: "params",
    Kind.GRAD: "grads",
    Kind.MASTER: "optimizer",
    Kind.EXP_AVG: "optimizer",
    Kind.EXP_AVG_SQ: "optimizer",
}


@dataclass(frozen=True, slots=True)
class Homes:
    """The home tier of each kind of model state, from `cfg.offload.*` or the placement planner.

    `units` lets the planner (tierzero/placement/planner.py) place a unit's slices of a kind apart
    from the rest of that kind: (unit name, field) -> tier, so that some units' optimizer states
    live on the device, others' in host memory and the rest on NVMe. Where a unit's optimizer
    states live, its step runs (`step_tier`); a stage that keeps full parameters on the device
    (1 and 2) refuses any unit's parameters elsewhere.
    """

    params: Tier = Tier.DEVICE
    grads: Tier = Tier.DEVICE
    optimizer: Tier = Tier.DEVICE
    units: Mapping[tuple[str, str], Tier] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for unit, what in self.units:
            if what not in ("params", "grads", "optimizer"):
                raise ValueError(f"{unit}: no kind of state called {what!r}; expected params, grads or optimizer")

    @classmethod
    def configured(cls, offload: OffloadConfig) -> Homes:
        """The `offload` section's tiers, each kind whole; refused when a kind is left to the planner."""
        if offload.planned:
            raise ConfigError(
                "offload is auto but no placement was planned: build the engine with tierzero.initialize (or "
                "tierzero train), which plans it, or pass homes=plan_placement(cfg).homes; or set offload.params, "
                "offload.gradients and offload.optimizer to device, cpu or nvme",
                key="offload",
            )
        return cls(params=offload.params, grads=offload.gradients, optimizer=offload.optimizer)

    def of(self, unit: str, kind: Kind) -> Tier:
        """Where `unit`'s slice of `kind` lives."""
        return self.tier(unit, KIND_HOMES[kind])

    def tier(self, unit: str, what: str) -> Tier:
        """Where `unit`'s slices of the field `what` (params, grads or optimizer) live."""
        tier = self.units.get((unit, what))
        return self._whole(what) if tier is None else tier

    def tiers(self, what: str) -> set[Tier]:
        """Every tier some unit's slices of the field `what` live on."""
        return {self._whole(what), *(tier for (_, kind), tier in self.units.items() if kind == what)}

    def _whole(self, what: str) -> Tier:
        """The tier of the field `what` for the units `units` does not name."""
        return {"params": self.params, "grads": self.grads, "optimizer": self.optimizer}[what]


@dataclass(frozen=True, slots=True)
class SliceSpec:
    """One slice a stage keeps per unit: what it holds, how big, where it lives."""

    kind: Kind
    numel: int
    dtype: torch.dtype
    home: Tier
    elements: int | None = None
    """The parameters whose state the slice holds, where its storage packs them (int8 moments: `numel`
    bytes of absmax and codes, [Note: compact moments]); None: `numel`."""
    codec: BaseCodec | None = None
    """A frozen unit's PARAM slice kept quantized: `numel` bytes encoding `elements` values
    ([Note: quantized base] in tierzero/units/quantized_base.py); None: values in `dtype`."""

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    @property
    def parameters(self) -> int:
        """How many parameters' state the slice holds."""
        return self.numel if self.elements is None else self.elements


@dataclass(frozen=True, slots=True)
class SlicePlan:
    """Each unit's slices on this rank, by unit name, in unit order."""

    specs: dict[str, tuple[SliceSpec, ...]]
    _by_kind: dict[tuple[str, Kind], SliceSpec] = field(init=False, repr=False, compare=False)
    """Each slice by (unit, kind): the hooks ask `home` and `spec` several times a unit a step."""

    def __post_init__(self) -> None:
        by_kind = {(unit, spec.kind): spec for unit, specs in self.specs.items() for spec in reversed(specs)}
        object.__setattr__(self, "_by_kind", by_kind)  # reversed: a kind's first spec wins, as `next` found it

    def of(self, unit: Unit) -> tuple[SliceSpec, ...]:
        return self.specs[unit.name]

    def spec(self, unit: str, kind: Kind) -> SliceSpec:
        """`unit`'s slice of `kind`."""
        found = self._by_kind.get((unit, kind))
        if found is None:
            raise KeyError(f"unit {unit!r} keeps no {kind.value} slice")
        return found

    def dtype(self, unit: str, kind: Kind) -> torch.dtype:
        """The dtype of `unit`'s slice of `kind` (each unit has its own: see `plan_slices`)."""
        return self.spec(unit, kind).dtype

    def home(self, unit: str, kind: Kind) -> Tier | None:
        """Where `unit`'s slice of `kind` lives; None when the unit keeps none (a frozen unit's grads)."""
        spec = self._by_kind.get((unit, kind))
        return None if spec is None else spec.home

    def staged(self, unit: str, kind: Kind) -> bool:
        """Whether `unit`'s slice of `kind` lives where compute cannot use it in place (a tier whose
        `TierTraits` say it is not memory: NVMe), so every use moves it through a copy in memory."""
        home = self.home(unit, kind)
        return home is not None and not traits_of(home).in_memory

    def all(self) -> Iterable[SliceSpec]:
        return (spec for specs in self.specs.values() for spec in specs)

    def bytes_by_home(self) -> dict[str, dict[str, int]]:
        """Bytes of each kind by home tier: tier name -> kind name -> bytes (kinds with none left out)."""
        homes: dict[str, dict[str, int]] = {tier.value: {} for tier in Tier}
        for spec in self.all():
            by_kind = homes[spec.home.value]
            by_kind[spec.kind.value] = by_kind.get(spec.kind.value, 0) + spec.nbytes
        return homes

    def stepped_elements(self, *, on_device: bool | None = None) -> int:
        """Elements the optimizer steps per step on this rank: each trained unit's master or state
        slice (the owned shard), or its gradient slice where it has neither (SGD without momentum).
        `on_device`: only the units that step on the device (True: their states live there) or
        only the others (False)."""
        total = 0
        for specs in self.specs.values():
            owned = [s for s in specs if s.kind in (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)]
            if on_device is not None and (bool(owned) and owned[0].home is Tier.DEVICE) is not on_device:
                continue
            total += owned[0].parameters if owned else next((s.numel for s in specs if s.kind is Kind.GRAD), 0)
        return total

    def home_bytes(self, tier: Tier) -> int:
        """What this rank's slices homed on `tier` hold at their I/O-aligned sizes (for NVMe: what the
        swap file must hold)."""
        return sum(align_up(spec.nbytes) for spec in self.all() if spec.home is tier)

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
    moments: MomentFormat = MomentFormat(),
    base: BaseCodec | None = None,
) -> SlicePlan:
    """PARAM in the compute dtype and GRAD in the reduce dtype (the compute dtype unless given),
    sharded as the stage says, an fp32 MASTER in mixed precision, and the optimizer's states
    (stored as `moments` says: fp32, bf16, or int8 codes and absmax), each sharded, each at its kind's home. A frozen unit keeps its PARAM slice only:
    in the compute dtype, with no fp32 copy, since nothing steps it. With `secondary_parts`
    (hpZ), every unit also keeps a SECONDARY slice, 1/secondary_parts of its parameters in
    the compute dtype, at the parameters' home. A unit with a dtype of its own (`Unit.dtype`:
    fp32 under `precision.autocast`) computes in it and keeps its gradients in fp32 too. With `base`
    (`model.lora.base_dtype` int8 or nf4), a frozen unit in the compute dtype keeps its PARAM slice
    quantized, in one piece per shard ([Note: quantized base])."""
    grad_dtype = grad_dtype or param_dtype
    if base is not None and secondary_parts:
        raise ConfigError(
            f"model.lora.base_dtype {base.name} does not combine with zero.hpz_partition_size (hpZ's secondary "
            "copy is not quantized): set model.lora.base_dtype to the param dtype or drop hpZ",
            key="model.lora.base_dtype",
        )
    specs = {}
    for unit in units:
        dtype = unit.dtype or param_dtype
        mixed = dtype != torch.float32
        shard = unit.shard_numel
        home = partial(homes.of, unit.name)
        params = shard if shards_params else unit.padded_numel
        if base is not None and not unit.trainable and unit.dtype is None:
            pieces = params // shard
            stored = base.stored_nbytes(params, pieces=pieces)
            unit_specs = [SliceSpec(Kind.PARAM, stored, torch.uint8, home(Kind.PARAM), params, codec=base)]
        else:
            unit_specs = [SliceSpec(Kind.PARAM, params, dtype, home(Kind.PARAM))]
        if secondary_parts:
            part = unit.padded_numel // secondary_parts
            unit_specs.append(SliceSpec(Kind.SECONDARY, part, dtype, home(Kind.SECONDARY)))
        if not unit.trainable:
            specs[unit.name] = tuple(unit_specs)
            continue
        grads = shard if shards_grads else unit.padded_numel
        unit_specs.append(SliceSpec(Kind.GRAD, grads, grad_dtype if unit.dtype is None else dtype, home(Kind.GRAD)))
        if mixed:
            unit_specs.append(SliceSpec(Kind.MASTER, shard, torch.float32, home(Kind.MASTER)))
        stored = moments.storage_numel(shard)
        unit_specs += [
            SliceSpec(kind, stored, moments.stored_dtype, home(kind), None if stored == shard else shard) for kind in state_kinds
        ]
        specs[unit.name] = tuple(unit_specs)
    return SlicePlan(specs=specs)
