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

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from tierzero.units.unit import Unit

__all__ = ["GradientReceiver", "InputGradHooks", "SavedView", "UnitParams", "bind", "tensors_in", "unregister_params"]


class GradientReceiver(Protocol):
    """What `UnitParams` hands a use's gradients to (a stage)."""

    def post_backward(self, unit: Unit, grads: list[torch.Tensor]) -> None: ...


class UnitParams(torch.autograd.Function):
    """Returns one view per parameter slot of `unit.gathered`; its backward hands grads to the stage."""

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, stage: GradientReceiver, unit: Unit) -> tuple[torch.Tensor, ...]:
        ctx.stage, ctx.unit = stage, unit
        assert unit.gathered is not None
        return unit.views(unit.gathered)

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
            b.set(tensor)


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

    @classmethod
    def within(cls, unit: Unit, tensor: torch.Tensor) -> SavedView | None:
        """`tensor` by its place in the unit's gathered buffer; None where it is not in it (another
        dtype, or a tensor that shares the buffer's storage but not the buffer)."""
        gathered = unit.gathered
        if gathered is None or tensor.dtype != gathered.dtype:
            return None
        offset = tensor.storage_offset() - gathered.storage_offset()
        if not 0 <= offset < gathered.numel():
            return None
        return cls(unit=unit, offset=offset, size=tuple(tensor.size()), stride=tuple(tensor.stride()))

    def view(self) -> torch.Tensor:
        """The tensor again, in the unit's buffer as gathered now."""
        gathered = self.unit.gathered
        assert gathered is not None
        return gathered.as_strided(self.size, self.stride, gathered.storage_offset() + self.offset)


class InputGradHooks:
    """Calls a function once backward has computed every gradient it will of some tensors, for
    the hooks registered since the last `clear`; the stage clears them as each backward ends.

    Torch's "all" multi-grad hook keeps its tensors' grad_fns inside the hook it puts on them, so
    a graph that has one references itself and outlives its backward, with everything it saved.
    Before the handles were removed, a 2B LoRA model with an NF4 base at stage 3 kept one more
    graph's worth a step: about 20 adapter units' nodes, and the heap in use grew 2.4 MB a step."""

    def __init__(self) -> None:
        self._handles: list[RemovableHandle] = []

    def after_grads(self, tensors: list[torch.Tensor], fn: Callable[[], None]) -> None:
        self._handles.append(torch.autograd.graph.register_multi_grad_hook(tensors, lambda _: fn(), mode="all"))

    def clear(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


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
