"""Where a unit's reduced gradient lands: added into its GRAD slice at home, or handed over
from memory to the unit's optimizer step in this backward.

[Note: stale gradients]
At stages 2 and 3 a step leaves the GRAD slices it used as they are (`Unit.grads_stale`)
instead of zeroing them: the next reduce writes over a stale slice and never reads it. Where
the home is memory the compute device works in (its own, or host memory without a GPU) the
sum is written over it in place; elsewhere (NVMe, host memory under a GPU) it starts in
device scratch and goes home in one write, so that the old sum is never read up. A home known
to hold zeros (`Unit.grads_zero`) is written over the same way. `add_into` fills either in one
pass, writing zeros plus each gradient (`g + 0.0`, so a -0.0 lands as the +0.0 that zeros plus
it give) and zeros where no gradient is: the same bits as zeroing the slice and adding, without
the step's zero fill or the landing's read. Whoever reads a stale slice some other way
(`Stage.slice`) gets zeros. Without a GPU, scratch handed over to a host step changes tier
without a copy (`SliceStore.adopt_scratch`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from tierzero.comm import collectives as C
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.native.convert import plus_zero_into
from tierzero.native.squares import Squares
from tierzero.stages.grads.held import HeldGrads
from tierzero.stages.grads.norm import GradNorm, square_sum
from tierzero.stages.grads.pieces import GradPieces
from tierzero.stages.step import BackwardStep, computes_on_host, converts_on_host, unit_step_tier
from tierzero.units.unit import Unit

__all__ = ["GradLanding", "add_into"]


def add_into(shard: torch.Tensor, pieces: Sequence[tuple[int, torch.Tensor]], *, fresh: bool, squares: Squares | None = None) -> None:
    """Add each flat gradient of `pieces` (offset, tensor) into `shard` at its offset; a `fresh`
    shard holds garbage and gets zeros plus each, in one pass (see the module note). `squares`:
    a fresh host shard's squares are summed into it too, each piece as it is written
    ([Note: the squares' order] in native/squares.py)."""
    if not fresh:
        assert squares is None, "a sum is counted once it is complete: only a fresh shard's landing counts it"
        for offset, grad in pieces:
            shard.narrow(0, offset, grad.numel()).add_(grad)
        return
    end = 0
    for offset, grad in sorted(pieces, key=lambda piece: piece[0]):
        shard[end:offset].zero_()
        end = offset + grad.numel()
        if squares is not None:
            squares.land(grad, shard[offset:end], offset)
        elif not plus_zero_into(grad, shard[offset:end]):
            torch.add(grad, 0.0, out=shard[offset:end])
    shard[end:].zero_()


class GradLanding:
    """The gradients' way home, half of `Stage` (a mixin: it uses the stage's store, plan and buckets).

    [Note: gradients freed a unit late]
    Without a GPU, autograd writes each unit's gradients into host memory the allocator hands out,
    most often the block the previous unit's gradients were just landed from and freed. On the
    2-core VM, two threads writing lines written and read a moment before took twice as long as
    writing lines left alone for a while (a 12.5M bf16 product 5.2 against 2.4 ms; one thread, 6.5
    against 6.0), and the eight units' backward of `bench step-host --params 100M` took 46 ms
    against plain PyTorch's 23. So the landing keeps the last unit's gradients until the next
    unit's have landed (`_landed_late`): the allocator alternates between two blocks, and the
    backward's end frees them. The cost is one unit's gradients held a unit longer; with a GPU
    they are device memory, counted in the device's budget, and are freed at once.
    """

    _landed_late: list[torch.Tensor] | None = None

    comm: C.CommGroup
    replica: C.CommGroup | None
    store: Any
    plan: Any
    homes: Any
    optimizer: Any
    device: torch.device
    last_micro_step: bool
    _buckets: Any
    _backward_step: BackwardStep | None
    slice: Callable[..., Any]
    scratch: Callable[..., torch.Tensor]
    note_grad: Callable[[Unit, torch.Tensor], None]
    grad_norm: GradNorm
    held_grads: HeldGrads
    shards_params: bool
    grad_slice: Callable[[torch.Tensor, Unit], torch.Tensor]

    def reduce_grads(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        """Flatten `grads` and queue their reduce-scatter into the owned GRAD slice (stages 2, 3).

        See [Note: gradient buckets] for when the collective starts and how many units
        may wait in scratch, which bounds the gradient scratch.
        """
        if self.comm.world_size == 1 and self.replica is None:
            if unit.name in self.held_grads:
                self.land_held(unit)  # a backward again before the step: its sum goes on in the home
            pieces = self._as_pieces(unit, grads)
            if pieces is not None and self._backward_step is not None:
                self._backward_step.ready(unit, pieces=pieces)
                return
            if pieces is not None and self._hold(unit, pieces):
                return
            # The reduce-scatter of one rank is the identity: add each gradient into its place.
            with self._landing(unit, final=unit.pending_uses == 0) as (shard, fresh, squares):
                pieces = [(slot.offset, grad.reshape(-1)) for slot, grad in zip(unit.slots, grads, strict=True)]
                add_into(shard, pieces, fresh=fresh, squares=squares)
            if self._on_host():
                self._landed_late = grads
            return
        self._buckets.add(unit, grads, final=unit.pending_uses == 0)

    def _as_pieces(self, unit: Unit, grads: list[torch.Tensor]) -> GradPieces | None:
        """The unit's complete gradient as the pieces its step takes in place, where it can ([Note: gradient
        pieces]): on its way to the step in this backward, or held for the step after it ([Note: held
        gradient pieces]), its home holding nothing to add it to (no earlier use's or micro-step's sum),
        in the memory the step reads it from."""
        job = self._backward_step
        if not self.last_micro_step or unit.pending_uses != 0 or not self._counts_as_zeros(unit):
            return None
        if job is None and (not self.shards_params or not self._on_host() or self.plan.staged(unit.name, Kind.GRAD)):
            return None  # held only by stage 3 without a GPU, and never in place of an NVMe home
        spec = self.plan.spec(unit.name, Kind.GRAD)
        if spec.dtype != torch.float32 and not converts_on_host(self, unit_step_tier(self.homes, unit.name)):
            return None  # a step that takes fp32 only: the slice widens them, or rounds (`precision.reduce_dtype`)
        if any(s.dtype != torch.float32 for s in self.plan.of(unit) if s.kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ)):
            return None  # compact moments step a window of whole blocks at a time, never a slot alone
        tier = self.plan.home(unit.name, Kind.GRAD) if job is None else job.grad_tier(unit)
        if tier is not Tier.DEVICE and not self._on_host():
            return None  # a host step of a GPU's gradients: they cross on the copy stream
        # Of another dtype than the slice's, they are not its bits: the slice rounds them (`reduce_dtype`).
        return GradPieces.take(unit, grads, tier=tier, nbytes=spec.nbytes, dtype=spec.dtype)

    def _hold(self, unit: Unit, pieces: GradPieces) -> bool:
        """Keep the unit's pieces for the step after backward, their squares counted for the norm, where
        there is room for them ([Note: held gradient pieces]); whether they are kept."""
        if not self.held_grads.hold(unit.name, pieces):
            return False
        if self.grad_norm.enabled and all(piece.device.type == "cpu" for piece in pieces.tensors):
            self.grad_norm.add_later(unit.name, pieces.placed(unit))
        elif self.grad_norm.enabled:  # the estimate's meta tensors: no bits to keep
            self.grad_norm.add_sum(unit.name, sum(square_sum(piece) for piece in pieces.tensors))
        return True

    def land_held(self, unit: Unit) -> None:
        """Write the unit's held pieces into its GRAD home, which something reads before the step."""
        pieces = self.held_grads.take(unit.name)
        assert pieces is not None, unit.name
        with self.slice(unit, Kind.GRAD, write=True, unread=True) as shard:
            add_into(shard, pieces.placed(unit), fresh=True)
        unit.grads_stale = False

    def _on_host(self) -> bool:
        """Whether the gradients are in host memory (`computes_on_host`)."""
        return computes_on_host(self.device)

    def _counts_as_zeros(self, unit: Unit) -> bool:
        """Whether the unit's GRAD home holds no gradient of this step: a stale NVMe home, or a memory
        home nothing was added into since it was zeroed (`Unit.grads_zero`)."""
        if self.plan.staged(unit.name, Kind.GRAD):
            return unit.grads_stale
        return unit.grads_zero or unit.grads_stale

    def _lands_in_place(self, unit: Unit) -> bool:
        """Whether the unit's GRAD home is memory the compute device works in (its own, or host memory
        without a GPU), where a stale home is written over in place; elsewhere (NVMe, host memory
        under a GPU) the sum starts in device scratch and goes home in one write."""
        if self.plan.staged(unit.name, Kind.GRAD):
            return False
        return self.plan.home(unit.name, Kind.GRAD) is Tier.DEVICE or self._on_host()

    def finish_reduces(self) -> None:
        self._buckets.finish()
        self._landed_late = None

    def land_grad(self, unit: Unit, part: torch.Tensor, *, final: bool) -> None:
        """Add a reduced gradient `part` into the unit's owned GRAD slice."""
        with self._landing(unit, final=final) as (shard, fresh, squares):
            add_into(shard, [(0, part)], fresh=fresh, squares=squares)

    @contextmanager
    def _landing(self, unit: Unit, *, final: bool) -> Iterator[tuple[torch.Tensor, bool, Squares | None]]:
        """(the unit's GRAD slice to add a gradient into, whether it is fresh scratch, the norm's sum
        for the landing to take as it writes or None: `add_into`'s arguments); then home, or to the
        unit's step in this backward when it hands over (`_hands_over_grad`). `final`: the unit's
        gradient is complete."""
        key = SliceKey(unit.name, Kind.GRAD)
        hands_over = final and self._hands_over_grad(unit)
        if unit.grads_stale and not self._lands_in_place(unit):
            spec = self.plan.spec(unit.name, Kind.GRAD)
            grads = self.scratch(unit, spec.numel, spec.dtype, kind=Kind.GRAD)
            squares = self._squares(unit, grads, final=final, fresh=True)
            try:
                yield grads, True, squares
                if final:
                    self._count(unit, grads, squares)
                if not hands_over:
                    self.store.write_back(key, grads).wait()
                    unit.grads_stale = False
            except BaseException:
                self.store.free(grads)
                raise
            if not hands_over:
                self.store.free(grads)
                self._grad_complete(unit, final=final)
                return
            assert self._backward_step is not None
            handed = self.store.adopt_scratch(key, to=self._backward_step.grad_tier(unit), scratch=grads)
        elif not hands_over:
            # A home known to hold zeros is written, not read and added to: zeros plus each
            # gradient, in one pass (`add_into`), the same bits as adding it to the zeros.
            zeros = self._counts_as_zeros(unit)
            with self.slice(unit, Kind.GRAD, write=True, unread=zeros) as shard:
                squares = self._squares(unit, shard, final=final, fresh=zeros)
                yield shard, zeros, squares
                if final:
                    self._count(unit, shard, squares)
            unit.grads_stale = False
            self._grad_complete(unit, final=final)
            return
        else:
            # The earlier micro-steps' sum, read to add this one's to; the copy then moves to the step.
            assert self._backward_step is not None
            grads = self.store.fetch(key, to=Tier.DEVICE).wait()
            try:
                yield grads, False, None
                self.note_grad(unit, grads)
            except BaseException:
                self.store.release(key)
                raise
            handed = self.store.adopt(key, to=self._backward_step.grad_tier(unit))
            unit.grads_stale = True  # the home keeps the earlier micro-steps' sum only
        self._backward_step.ready(unit, grad=handed)

    def _squares(self, unit: Unit, shard: torch.Tensor, *, final: bool, fresh: bool) -> Squares | None:
        """The norm's sum for a fresh host shard's landing to take as it writes, where the step needs the
        norm and the shard is the unit's whole gradient slice ([Note: the squares' order]); None: counted after."""
        counts = final and fresh and self.grad_norm.enabled and self.last_micro_step
        if not counts or shard.device.type != "cpu" or self.grad_slice(shard, unit) is not shard:
            return None
        return Squares()

    def _count(self, unit: Unit, shard: torch.Tensor, squares: Squares | None) -> None:
        """The unit's complete gradient is in `shard`: count its squares for the norm (summed already where
        the landing took them)."""
        if squares is None:
            self.note_grad(unit, shard)
        else:
            self.grad_norm.add_sum(unit.name, squares.total)

    def _hands_over_grad(self, unit: Unit) -> bool:
        """Whether the unit's complete gradient goes to its step in this backward from memory, as
        its NVMe home is written only to be read back at once: it would cross the disk twice for
        nothing. The home is left stale (`Unit.grads_stale`): the next reduce starts from zeros."""
        steps_now = self._backward_step is not None and self.last_micro_step
        return steps_now and self.plan.staged(unit.name, Kind.GRAD)

    def _grad_complete(self, unit: Unit, *, final: bool) -> None:
        if final and self._backward_step is not None and self.last_micro_step:
            self._backward_step.ready(unit)
