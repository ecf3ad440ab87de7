"""Gradient pieces held from backward to a step that waits for every gradient.

[Note: held gradient pieces]
Clipping needs every gradient before a unit can step, so its step runs after backward (or in
the next forward, `ForwardStep`), and each unit's gradient used to land in its GRAD home first:
on one rank without a GPU, a copy of every gradient byte into host memory the step then reads
back, with the squares for the norm summed on the way. Where gradient pieces would go straight
to a step in backward ([Note: gradient pieces]: one rank, stage 3, a home with nothing to add
them to, tensors of the slice's dtype), a memory home's unit now keeps them instead: their
squares are summed from the pieces in the slice's order (the bits of summing the landed slice,
[Note: the squares' order] in native/squares.py), and the step takes them as its gradient, a
slot at a time, with the bits of a step on the landed copy. The home is left as it was.

The pieces are booked in the home's tier while held, as the step's pieces are. They are a
second copy of the gradients beside the homes, so they are held only where the config leaves
the tier's capacity open (a `tiers.<tier>.capacity` is a bound to keep, not to fill) and within
half the host memory the process may still take when the step's first unit is held
(`host_headroom`, cgroup limits included); otherwise the unit lands as before. The estimate's
dry run holds them as a run on a machine with the room would, so that its peak is that run's.
Anything that reads a GRAD slice before the step (`Stage.slice`) has the unit's pieces landed
into it first (`GradLanding.land_held`), and the step then reads the slice; dropping the step's
gradients (`zero_grads`, close) drops the pieces. An NVMe home is never bypassed: its
point is that the gradients leave memory.
"""

from __future__ import annotations

from collections.abc import Callable

from tierzero.common.cgroup import host_headroom
from tierzero.common.slices import Tier
from tierzero.stages.grads.pieces import GradPieces, book
from tierzero.store.protocol import SliceStore

__all__ = ["HeldGrads"]


class HeldGrads:
    """The units whose gradient pieces wait for the step, booked in the store's ledger while held."""

    def __init__(self, store: SliceStore, *, headroom: Callable[[], int] = host_headroom) -> None:
        self._store, self._headroom = store, headroom
        self._held: dict[str, GradPieces] = {}
        self._open: dict[Tier, bool] = {}
        """Whether each tier's capacity is open (none given), read once."""
        self._host = 0
        """What the host memory leaves for more pieces, read when the first piece of a step is held."""

    def __contains__(self, unit: str) -> bool:
        return unit in self._held

    def hold(self, unit: str, pieces: GradPieces) -> bool:
        """Keep `unit`'s pieces for the step where there is room for them (the module note); whether they are kept."""
        if pieces.tier not in self._open:
            usage = self._store.report().tiers.get(pieces.tier)
            self._open[pieces.tier] = usage is None or usage.capacity is None
        if not self._held:
            self._host = self._headroom() // 2
        if not self._open[pieces.tier] or pieces.nbytes > self._host:
            return False
        self._host -= pieces.nbytes
        book(self._store, pieces, held=True)
        self._held[unit] = pieces
        return True

    def get(self, unit: str) -> GradPieces | None:
        """The unit's pieces, held still (the step `take`s them once it has stepped them)."""
        return self._held.get(unit)

    def take(self, unit: str) -> GradPieces | None:
        """The unit's pieces, no longer held (nor booked): stepped, or landed in its home."""
        pieces = self._held.pop(unit, None)
        if pieces is not None:
            book(self._store, pieces, held=False)
        return pieces

    def drop(self) -> None:
        """Forget every unit's pieces: the step's gradients are dropped."""
        for unit in list(self._held):
            self.take(unit)
