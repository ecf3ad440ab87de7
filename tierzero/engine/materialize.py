"""Turning a model's parameters into flat fp32 unit buffers: copied from a materialised model, or
created and initialised unit by unit for a model built on the meta device.

The engine calls these while it registers each unit's slices (`Engine._install`).
"""

from __future__ import annotations

import torch
from torch import nn

from tierzero.units.unit import ParamSlot, Unit

__all__ = ["flat_fp32", "has_meta", "materialize_rest", "materialize_unit", "unit_on_meta"]


def flat_fp32(unit: Unit, *, device: torch.device) -> torch.Tensor:
    full = torch.empty(unit.padded_numel, dtype=torch.float32, device=device)
    first = [getattr(slot.bindings[0].module, slot.bindings[0].attr) for slot in unit.slots]
    return unit.flatten([p.detach().float() for p in first], out=full)


# [Note: meta init]
# A model built on the meta device holds shapes only. `Engine._install` gives each unit, in turn,
# one CPU fp32 buffer, points the unit's parameters at views of it, runs the model's own
# per-module init (`model.init_module(module)` where the model has one, as tierzero's
# built-ins do, else `module.reset_parameters()`), registers this rank's slices and drops
# the buffer: host memory holds one unit's full parameters at a time, never the model.
# Every rank seeds unit i with `train.seed + i` and computes the same bytes, so no
# broadcast is needed and the weights do not depend on the world size; a tied parameter is
# one slot, allocated once and shared by all its bindings. The caller's RNG state is left as it was.


def has_meta(model: nn.Module) -> bool:
    tensors = [*model.parameters(), *model.buffers()]
    return any(t.device.type == "meta" for t in tensors)


def unit_on_meta(unit: Unit) -> bool:
    on_meta = {_first_param(slot).device.type == "meta" for slot in unit.slots}
    if len(on_meta) > 1:
        raise ValueError(
            f"unit {unit.name} has parameters both on the meta device and off it: "
            "build the model wholly on meta (or wholly materialised) before tierzero.initialize"
        )
    return on_meta == {True}


def _first_param(slot: ParamSlot) -> torch.Tensor:
    return getattr(slot.bindings[0].module, slot.bindings[0].attr)


def materialize_unit(model: nn.Module, unit: Unit, *, seed: int) -> torch.Tensor:
    """The unit's flat fp32 parameters on the CPU, initialised by the model's own init."""
    full = torch.zeros(unit.padded_numel, dtype=torch.float32)
    for slot in unit.slots:
        param = nn.Parameter(slot.view(full), requires_grad=True)
        for b in slot.bindings:
            setattr(b.module, b.attr, param)
    # In module order, as a whole-model init visits them.
    owned = {id(b.module) for slot in unit.slots for b in slot.bindings}
    _init_modules(model, [module for module in model.modules() if id(module) in owned], seed=seed)
    return full


def materialize_rest(model: nn.Module, *, seed: int) -> None:
    """Frozen parameters and buffers still on meta: allocate them on the CPU and initialise their modules."""
    owners = []
    for module in model.modules():
        tables = (module._parameters, module._buffers)
        names = [(table, name) for table in tables for name, t in table.items() if t is not None and t.is_meta]
        for table, name in names:
            t = table[name]
            fresh = torch.empty_like(t, device="cpu")
            table[name] = nn.Parameter(fresh, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else fresh
        if names:
            owners.append(module)
    _init_modules(model, owners, seed=seed)


def _init_modules(model: nn.Module, modules: list[nn.Module], *, seed: int) -> None:
    """Run the model's init on `modules` in order from `seed`, leaving the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.no_grad():
            for module in modules:
                _init_module(model, module)


def _init_module(model: nn.Module, module: nn.Module) -> None:
    # tierzero's built-ins name their per-module init `init_module`; a transformers model's is
    # `_init_weights(module)`, the hook its `post_init` runs on every module (rotary buffers too).
    init = getattr(model, "init_module", None) or getattr(model, "_init_weights", None)
    if init is not None:
        init(module)
        return
    reset = getattr(module, "reset_parameters", None)
    if reset is None:
        raise ValueError(
            f"{type(module).__name__} is on the meta device but has no reset_parameters and "
            f"{type(model).__name__} no init_module(module): build this model on the CPU instead of meta"
        )
    reset()
