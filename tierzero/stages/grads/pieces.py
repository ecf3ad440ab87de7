"""A unit's gradient handed to its step as autograd produced it, without a copy into one flat slice.

[Note: gradient pieces]
On one rank, a unit whose gradient goes straight from backward to its step (stage 3's
step in backward) used to have its gradients copied into a flat GRAD slice first: into
scratch where the home is on NVMe (`GradLanding._hands_over_grad`: written only to be read
back), added into the home where it is in memory, which the step then zeroed. That is one
pass over every gradient byte a step (0.6 s a step for the 2B preset's 2.05B fp32 gradients
on the 2-core VM, a pass the backward's cores had to find time for), and a second for a
memory home. Where the home holds no earlier sum (a stale NVMe home, `Unit.grads_stale`; a
memory home nothing was added into since it was zeroed, `Unit.grads_zero`: one use and one
micro-step) and the gradients are tensors of their own in the GRAD slice's dtype, one per
parameter slot, the step takes them as they are. That dtype is fp32, or where the step runs
on the host and widens a gradient as it reads it (`converts_on_host`), the compute dtype: a
bf16 model without a GPU, whose landing copy cost as much as the rest of the host's work
beside the optimizer (`bench step-host --clip 0` at 100M: 1.55x a bare AdamW with the copy,
1.25x without, session 36). It steps each slot as a slice of its own (the optimizer's bits
do not change, see [Note: vector lanes and scalar tails]: a slot is one of the unit's
original tensors), the flat slice's padding, whose gradient is zero, keeps its zero
parameters and states as a step over it would, and the home is left as it was. Where the
native kernel takes them, a converting step runs all of a unit's slots in one call
(`FlatOptimizer.step_converting_slots`, native/adam.py `step_slots`), and a step of fp32 pieces
(a GPU's) gives each parameter group's slots to one fused call (`FlatOptimizer.step_slots`): a
call and its checks a slot had cost more than a small slot's arithmetic. The store
books the pieces' bytes as scratch while the step holds them, as a flat slice of the unit's
in the tier the step reads the gradient from (held beside a memory home until the step).
The estimate's dry run takes pieces as the engine does (its meta tensors told apart by
storage, `storage_id`) and counts no landing pass for them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from tierzero.common.slices import Kind, Tier, storage_id
from tierzero.optim.flat import FlatOptimizer
from tierzero.store.protocol import SliceStore
from tierzero.units.unit import Unit

__all__ = ["GradPieces", "book", "step_pieces"]


@dataclass(frozen=True, slots=True)
class GradPieces:
    """A unit's complete fp32 gradient, one flat tensor per parameter slot, booked in `tier`."""

    tensors: tuple[torch.Tensor, ...]
    tier: Tier
    nbytes: int
    """What the store books for them: the flat GRAD slice they stand in for, padding included,
    as it booked the copy they replace."""

    @classmethod
    def take(
        cls, unit: Unit, grads: Sequence[torch.Tensor], *, tier: Tier, nbytes: int, dtype: torch.dtype = torch.float32
    ) -> GradPieces | None:
        """The pieces of `grads` (autograd's, one per slot of `unit`) if the step can use them in place:
        of the GRAD slice's `dtype` (fp32, or the compute dtype a converting step widens), contiguous,
        each the sole user of its own memory (the step may scale it in place); None where they must be
        copied into a flat slice (of `nbytes`, what the store books)."""
        if len(grads) != len(unit.slots):
            return None
        storages = set()
        for slot, grad in zip(unit.slots, grads, strict=True):
            whole = grad.untyped_storage().nbytes() == grad.numel() * grad.element_size()
            if grad.dtype != dtype or grad.numel() != slot.numel or not grad.is_contiguous() or not whole:
                return None
            storages.add(storage_id(grad))
        if len(storages) != len(grads):
            return None
        return cls(tensors=tuple(grad.reshape(-1) for grad in grads), tier=tier, nbytes=nbytes)

    def placed(self, unit: Unit) -> list[tuple[int, torch.Tensor]]:
        """(offset in the unit's flat slice, piece), in the slice's order: what `add_into` lands, and the
        order a slice's squares are counted in."""
        return sorted(((slot.offset, piece) for slot, piece in zip(unit.slots, self.tensors, strict=True)), key=lambda p: p[0])


def step_pieces(
    optimizer: FlatOptimizer,
    unit: Unit,
    *,
    master: torch.Tensor,
    pieces: GradPieces,
    states: Mapping[Kind, torch.Tensor],
    scale: float,
    step: int,
    lrs: Sequence[float],
    converting: bool = False,
    cast: torch.Tensor | None = None,
) -> None:
    """Step each slot of `unit` as its own slice, its gradient the slot's piece: scaled in place by
    `scale`, or, `converting`, widened and scaled by the optimizer as it steps, which writes the new
    parameters into `cast` on its way ([Note: the converting step] in optim/flat.py; the padding after
    the slots gets the zeros a step over the flat slice would cast there)."""
    slots = [(slot.offset, grad, slot.group) for slot, grad in zip(unit.slots, pieces.tensors, strict=True)]
    if converting:
        optimizer.step_converting_slots(param=master, grads=slots, scale=scale, states=states, step=step, lr=lrs, cast=cast)
    else:
        optimizer.step_slots(param=master, grads=slots, scale=scale, states=states, step=step, lr=lrs)
    if cast is not None:
        cast[unit.numel :].zero_()  # the slots tile the slice's start (`plan_units`): the padding after them


def book(store: SliceStore, pieces: GradPieces, *, held: bool) -> None:
    """Count the pieces' bytes in the store's ledger while the step holds them (`held`), and no more after."""
    store.book(pieces.tier, Kind.GRAD, pieces.nbytes if held else -pieces.nbytes)
