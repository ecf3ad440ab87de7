"""Cutting a model into units: one flat, padded parameter buffer per wrapped module.

A unit is the granularity of gathering, of reduce-scatter and of I/O. By default the
units are the blocks of the model's largest `nn.ModuleList` (its transformer layers)
plus a *root* unit holding every other parameter; `unit_classes` names module classes
to wrap instead, like FSDP's auto-wrap policy.

Each unit's parameters are laid end to end in one buffer whose length is padded to a
multiple of `world_size x align_numel`, so rank r owns the contiguous slice
`[r * shard_numel, (r + 1) * shard_numel)` and every slice is I/O-aligned. With ZeRO++'s
quantised collectives the shards are whole quantisation blocks too (`quant_block`), so that
no block straddles two ranks' shards ([Note: qwZ] in tierzero/comm/quantized.py).

A parameter reachable from two units (tied weights across units) belongs to the root;
a parameter reachable twice from the same unit (GPT-2's embedding and LM head, both in
the root) occupies one slot with two bindings.

Frozen parameters (`requires_grad=False`) are sharded and placed like trained ones, in units
of their own: each wrapped module's (and the root's) frozen parameters form the unit
`<name>:frozen`, which keeps only its parameters (no gradient, no optimizer state), is
gathered with its module's trained unit and released after its backward. Frozen units come
after all trained ones, so a model's trained units are numbered the same with or without them.

Under `precision.autocast` the parameters autocast would read in fp32 (all but the weights
and biases of the layers whose op it lowers: `nn.Linear`, convolutions) stay fp32 in units
of their own, `<name>:fp32` (`<name>:fp32:frozen` for frozen ones), gathered with their
module's other units; a module's that come to less than `SMALL_FP32_BYTES` (a block's
norms) join `root:fp32`, gathered all step ([Note: autocast's fp32 parameters] in
tierzero/units/precision.py).
"""

from __future__ import annotations

import enum
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._utils import _unflatten_dense_tensors

from tierzero.common.slices import IO_ALIGNMENT, align_up

ROOT = "root"
_MODULE_SETATTR = nn.Module.__setattr__
#: Appended to a module's unit name to name the unit of its frozen parameters.
FROZEN_SUFFIX = ":frozen"
#: Appended to a module's unit name to name the unit of its parameters kept in fp32 (`precision.autocast`).
FP32_SUFFIX = ":fp32"
#: A module's fp32 parameters below this many bytes join the root's fp32 unit rather than forming their own.
SMALL_FP32_BYTES = 1 << 20
#: Elements per alignment step: a 2-byte slice of this many elements is one I/O block.
DEFAULT_ALIGN_NUMEL = IO_ALIGNMENT // 2


class UnitState(enum.Enum):
    """Whether the unit's full parameters are materialised on the compute device."""

    SHARDED = "sharded"
    GATHERING = "gathering"
    GATHERED = "gathered"


@dataclass(frozen=True, slots=True)
class Binding:
    """One place a parameter is reachable: `module.<attr>`, known to the user as `name`."""

    module: nn.Module
    attr: str
    name: str

    def set(self, value: torch.Tensor) -> None:
        """`setattr(module, attr, value)` for a plain tensor where the parameter was unregistered: past
        `nn.Module.__setattr__`'s checks (which end in object's own setattr for it) unless the module's
        class sets attributes its own way. Engines bind every slot twice a step."""
        if type(self.module).__setattr__ is _MODULE_SETATTR:
            object.__setattr__(self.module, self.attr, value)
        else:
            setattr(self.module, self.attr, value)


@dataclass(frozen=True, slots=True)
class ParamSlot:
    """One parameter inside a unit's flat buffer."""

    name: str
    shape: torch.Size
    offset: int
    numel: int
    bindings: tuple[Binding, ...]
    group: int = 0
    """The optimizer parameter group it is stepped with (`tierzero.optim.groups`); 0 is optimizer.*'s own."""

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.narrow(0, self.offset, self.numel).view(self.shape)


@dataclass(slots=True, eq=False)
class Unit:
    """A wrapped module's parameters as one flat buffer, and its gathering state (compared by identity)."""

    name: str
    module: nn.Module
    slots: tuple[ParamSlot, ...]
    numel: int
    padded_numel: int
    world_size: int
    trainable: bool = True
    """False for a unit of frozen parameters: it has no gradient and no optimizer state."""
    dtype: torch.dtype | None = None
    """The dtype its parameters are gathered and computed in: None for the engine's
    `precision.param_dtype`; fp32 for the parameters autocast reads in fp32."""
    state: UnitState = UnitState.SHARDED
    gathered: torch.Tensor | None = field(default=None, repr=False)
    """The full parameter buffer while GATHERED (stage 3) or from forward to step (stages 1, 2)."""
    pending_uses: int = 0
    """Forward uses in this micro-step whose backward has not run yet."""
    has_grads: bool = False
    """Some use of the unit produced gradients since the last optimizer step."""
    grads_stale: bool = False
    """The GRAD slice's home holds an old gradient that counts as zeros: the step left it rather
    than write zeros over it, and the next reduce writes over it instead of reading it
    ([Note: stale gradients] in tierzero/stages/grads/landing.py)."""
    grads_zero: bool = False
    """The GRAD slice's home, in memory, holds zeros: registered or zeroed, and written since by
    nothing. Its complete gradient may then go to a step in backward as autograd left it, the home
    left as it is ([Note: gradient pieces])."""
    _templates: tuple[tuple[ParamSlot, ...], torch.device, list[torch.Tensor] | None] | None = field(default=None, init=False, repr=False)
    """`views`' shapes, for the slots and the device they were made for (None: the slots do not lie end to end)."""

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One view of `flat` (a full buffer of the unit's) per slot, shaped as its parameter: `ParamSlot.view`
        of each, made in one call where the slots lie end to end from the start, as `plan_units` lays them."""
        cached = self._templates
        if cached is None or cached[0] is not self.slots or cached[1] != flat.device:
            # End to end, and no empty slot: the one call gives an empty parameter a tensor of its own, not a view.
            starts = itertools.accumulate((slot.numel for slot in self.slots), initial=0)
            tiled = all(slot.numel and slot.offset == start for slot, start in zip(self.slots, starts))
            # Each slot's shape as a tensor of one element on the buffer's device, broadcast: no memory of its size.
            one = torch.empty((), device=flat.device)
            templates = [one.expand(slot.shape) for slot in self.slots] if tiled else None
            self._templates = cached = (self.slots, flat.device, templates)
        if cached[2] is None:
            return tuple(slot.view(flat) for slot in self.slots)
        return tuple(_unflatten_dense_tensors(flat, cached[2]))

    def shard_range(self, rank: int) -> tuple[int, int]:
        start = rank * self.shard_numel
        return start, start + self.shard_numel

    def transition(self, to: UnitState, *, allowed_from: tuple[UnitState, ...]) -> None:
        assert self.state in allowed_from, f"unit {self.name}: {self.state.value} -> {to.value}"
        self.state = to

    def flatten(self, tensors: list[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
        """Write one tensor per slot into `out` (padded length), zeroing the padding."""
        assert out.numel() == self.padded_numel and len(tensors) == len(self.slots)
        for slot, t in zip(self.slots, tensors):
            out.narrow(0, slot.offset, slot.numel).copy_(t.reshape(-1))
        out.narrow(0, self.numel, self.padded_numel - self.numel).zero_()
        return out


def module_of(unit_name: str) -> str:
    """The wrapped module (or ROOT) a unit's parameters belong to, from its name without suffixes:
    units of one module (its frozen and fp32 companions) share it."""
    return unit_name.partition(":")[0]


def is_root(unit: Unit) -> bool:
    """The root unit or one of its companions: gathered all through forward and backward (stage 3)."""
    return module_of(unit.name) == ROOT


def plan_units(
    model: nn.Module,
    *,
    world_size: int,
    unit_classes: list[str] | tuple[str, ...] = (),
    align_numel: int = DEFAULT_ALIGN_NUMEL,
    quant_block: int = 1,
    group_of: Callable[[Binding], int] | None = None,
    keep_fp32: Callable[[list[Binding]], bool] | None = None,
) -> list[Unit]:
    """The model's units: wrapped blocks in module order, the root, then the fp32 units and the
    frozen units, each in the same order.

    Every shard is a multiple of `align_numel` and of `quant_block` (qwZ / qgZ's block; 1: none).
    `group_of(binding)` gives each trained parameter its optimizer group (default 0), from
    its first binding. `keep_fp32(bindings)` picks the parameters kept in fp32 units
    (`precision.autocast`: `reads_fp32_under_autocast`). Raises ValueError when `unit_classes`
    names a class the model does not contain.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    align_numel = math.lcm(align_numel, quant_block)
    wrapped = _wrapped_modules(model, unit_classes)
    unit_of_module = _owner_names(model, wrapped)
    bindings = _bindings_by_param(model)

    owners = [*wrapped, ROOT]
    # (trained, kept in fp32) -> owner -> its parameters
    parts: dict[tuple[bool, bool], dict[str, list[tuple[nn.Parameter, list[Binding]]]]] = {
        (trained, fp32): {name: [] for name in owners} for trained in (True, False) for fp32 in (False, True)
    }
    for param, binds in bindings:
        found = {unit_of_module[b.name.rpartition(".")[0]] for b in binds}
        owner = found.pop() if len(found) == 1 else ROOT
        fp32 = keep_fp32 is not None and keep_fp32(binds)
        parts[param.requires_grad, fp32][owner].append((param, binds))
    for trained in (True, False):
        _merge_small(parts[trained, True])

    modules = {**wrapped, ROOT: model}
    units = []
    for (trained, fp32), by_owner in parts.items():
        suffix = (FP32_SUFFIX if fp32 else "") + ("" if trained else FROZEN_SUFFIX)
        for name, params in by_owner.items():
            if not params:
                continue
            groups = [0 if group_of is None or not trained else group_of(binds[0]) for _, binds in params]
            units.append(
                _make_unit(
                    name + suffix, modules[name], params, groups, world_size=world_size, align_numel=align_numel,
                    trainable=trained, dtype=torch.float32 if fp32 else None,
                )
            )  # fmt: skip
    return units


def _merge_small(by_owner: dict[str, list[tuple[nn.Parameter, list[Binding]]]]) -> None:
    """Move each module's fp32 parameters that fall short of `SMALL_FP32_BYTES` into the root's
    fp32 unit, after its own, module by module: a block's norms are a few KiB, which cost more as slices of
    their own (a gather, a read and a write each, every step) than kept gathered all step."""
    small = {name for name, params in by_owner.items() if 0 < sum(p.numel() for p, _ in params) * 4 < SMALL_FP32_BYTES}
    small.discard(ROOT)
    if small:
        by_owner[ROOT] = by_owner[ROOT] + [entry for name in by_owner if name in small for entry in by_owner[name]]
        for name in small:
            by_owner[name] = []


def _wrapped_modules(model: nn.Module, unit_classes: list[str] | tuple[str, ...]) -> dict[str, nn.Module]:
    if unit_classes:
        wanted = set(unit_classes)
        found: dict[str, nn.Module] = {}
        for name, module in model.named_modules():
            inside_wrapped = any(name.startswith(prefix + ".") for prefix in found)
            if name and not inside_wrapped and type(module).__name__ in wanted:
                found[name] = module
        seen = {type(m).__name__ for m in model.modules()}
        missing = sorted(wanted - seen)
        if missing:
            raise ValueError(
                f"zero.unit_classes names {missing}, which the model does not contain; "
                f"its module classes include {sorted(seen)[:12]}: fix zero.unit_classes"
            )
        return found
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        return {}
    name, largest = max(lists, key=lambda nm: sum(p.numel() for p in nm[1].parameters()))
    return {f"{name}.{i}": child for i, child in enumerate(largest)}


def _owner_names(model: nn.Module, wrapped: dict[str, nn.Module]) -> dict[str, str]:
    """Module name -> the unit that owns its parameters (nearest wrapped ancestor, else root)."""
    owners = {}
    for name, _ in model.named_modules(remove_duplicate=False):
        owner = ROOT
        for prefix in wrapped:
            if name == prefix or name.startswith(prefix + "."):
                owner = prefix
                break
        owners[name] = owner
    return owners


def _bindings_by_param(model: nn.Module) -> list[tuple[nn.Parameter, list[Binding]]]:
    """Every distinct parameter with all places it is reachable, in `named_parameters` order."""
    by_id: dict[int, tuple[nn.Parameter, list[Binding]]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module._parameters.items():
            if param is None:
                continue
            name = f"{mod_name}.{attr}" if mod_name else attr
            entry = by_id.setdefault(id(param), (param, []))
            if all(b.module is not module or b.attr != attr for b in entry[1]):
                entry[1].append(Binding(module=module, attr=attr, name=name))
    return list(by_id.values())


def _make_unit(
    name: str,
    module: nn.Module,
    params: list[tuple[nn.Parameter, list[Binding]]],
    groups: list[int],
    *,
    world_size: int,
    align_numel: int,
    trainable: bool = True,
    dtype: torch.dtype | None = None,
) -> Unit:
    slots, offset = [], 0
    for (param, binds), group in zip(params, groups, strict=True):
        slots.append(
            ParamSlot(
                name=binds[0].name, shape=param.shape, offset=offset, numel=param.numel(), bindings=tuple(binds), group=group
            )
        )
        offset += param.numel()
    padded = align_up(max(offset, 1), world_size * align_numel)
    return Unit(
        name=name,
        module=module,
        slots=tuple(slots),
        numel=offset,
        padded_numel=padded,
        world_size=world_size,
        trainable=trainable,
        dtype=dtype,
    )
