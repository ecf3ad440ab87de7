"""How a unit's parameters reach its modules: views of the gathered buffer, bound per forward.

[Note: binding parameters]
A unit's parameters are removed from their modules at set-up. Before each forward of
the unit, `UnitParams` (a custom autograd Function with one empty anchor leaf as
input) returns one view of the unit's full buffer per parameter slot, and these views
are set as plain attributes on the owning modules. The Function's backward runs once
all of a use's parameter gradients are known, so it *is* the unit's post-backward hook:
it hands the gradients to the stage. A unit used twice in one step has two Function
nodes, hence two post-backward calls; a module that runs no forward simply contributes
no gradient.

Stage 3 frees the full buffer after forward. Autograd still wants the parameter views
that ops saved for backward; stage 3's saved-tensor hooks replace any saved tensor
that lives in a gathered buffer by its (unit, offset, size, stride), and gather the
unit again if backward unpacks it before the unit's pre-backward hook did.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierzero.units.unit import Unit

__all__ = ["GradientReceiver", "SavedView", "UnitParams", "bind", "tensors_in", "unregister_params"]


class GradientReceiver(Protocol):
    """What `UnitParams` hands a use's gradients to (a stage)."""

    def post_backward(self, unit: Unit, grads: list[torch.Tensor]) -> None: ...


class UnitParams(torch.autograd.Function):
    """Returns one view per parameter slot of `unit.gathered`; its backward hands grads to the stage."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, stage: GradientReceiver, unit: Unit) -> tuple[torch.Tensor, ...]:
        ctx.stage, ctx.unit = stage, unit
        assert unit.gathered is not None
        return tuple(slot.view(unit.gathered) for slot in unit.slots)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, None, None]:
        ctx.unit.has_grads = True
        ctx.unit.pending_uses -= 1
        ctx.stage.post_backward(ctx.unit, list(grads))
        return None, None, None


def bind(unit: Unit, tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    """Set each slot's tensor on every module attribute that names it."""
    for slot, tensor in zip(unit.slots, tensors, strict=True):
        for b in slot.bindings:
            setattr(b.module, b.attr, tensor)


def unregister_params(unit: Unit) -> None:
    """Take the unit's nn.Parameters off their modules; `bind` sets plain tensors in their place."""
    for slot in unit.slots:
        for b in slot.bindings:
            if b.attr in b.module._parameters:
                del b.module._parameters[b.attr]


@dataclass(frozen=True, slots=True)
class SavedView:
    """A saved tensor that lived in a unit's gathered buffer, by position rather than by memory."""

    unit: Unit
    offset: int
    """Elements from the start of the gathered buffer."""
    size: tuple[int, ...]
    stride: tuple[int, ...]


def tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    """Tensors inside a forward's output: nested tuples, lists and mappings (HF ModelOutput too)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for value in obj.values():
            yield from tensors_in(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensors_in(value)
