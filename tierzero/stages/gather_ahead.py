"""Stage 3's gathers beyond the unit computing: the units gathered ahead of their hooks, and those
that stay gathered from their forward to their backward.

[Note: homes kept across the turn]
A unit whose gather lends it its PARAM home itself (one rank, unquantised, the home in the memory the
units compute in: the device's own, or host memory without a GPU; the store says so, `fetched_in_place`)
holds no byte of its own while gathered. Such a unit stays gathered from its forward to its backward, as the quantized frozen units
of `_across_the_turn` do: no reshard after its forward, no second gather before its backward, and the
forward's binding serves the backward (a checkpointed recomputation finds the forward's weights,
requiring grad, as it must). Nothing writes the slice meanwhile: the optimizer steps a unit after its
post-backward, which frees it, or in the next forward. It counts in no gather-ahead bound, and the
gathers ahead pass it by. A forward without grad still frees each unit at its end. 100M parameters
in 8 units on the 2-vCPU VM (bench step-host): the pre-backward hooks 1.2-1.9 ms a step before, 0.15
after.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tierzero.common.slices import Kind, SliceKey
from tierzero.store.protocol import SliceStore
from tierzero.units.unit import Unit, UnitState, is_root

__all__ = ["GatherAhead"]


class GatherAhead:
    """Stage 3 mixes this in: which units are gathered beyond the one its hooks compute now."""

    units: list[Unit]
    store: SliceStore
    gather_ahead: int
    gather_budget: int
    persistence_threshold: int
    _order: list[Unit]
    _lent: dict[str, bool]
    _kept: set[str]
    _decoded_across: frozenset[str]
    start_gather: Callable[[Unit], None]
    codec: Callable[[Unit], Any]
    dtype_of: Callable[[Unit], torch.dtype]

    def _prefetch(self, unit: Unit, *, step: int) -> None:
        """Start gathering the units after (`step=1`) or before (-1) `unit` in the last forward's order.

        At most `gather_ahead` block units are gathered or gathering beyond the one that
        computes (besides the root and the units the persistence threshold keeps), and
        beyond the first, only while the gathered bytes ahead fit in `gather_budget`: the
        peak-memory promise of stage 3. The decision depends only on the order, the unit
        states and their sizes, never on timing, so every rank issues the same collectives
        in the same order.
        """
        if unit not in self._order:
            return
        index = self._order.index(unit) + step
        if is_root(unit) and step < 0:
            index = len(self._order) - 1  # backward starts at the root, then the last block
        while 0 <= index < len(self._order):
            target = self._order[index]
            index += step
            if target.module is unit.module or target.name in self._kept:
                continue  # the unit's frozen or trained companion, which its own hook gathers now; or kept since its forward
            ahead = [
                u for u in self.units
                if u.module is not unit.module and u.state is not UnitState.SHARDED and self._counts_ahead(u)
            ]  # fmt: skip
            # A module's trained and frozen units are gathered together: they take one place ahead.
            modules = {id(u.module) for u in ahead}
            if is_root(target) or (id(target.module) not in modules and len(modules) >= self.gather_ahead):
                return
            # In the order their hooks ran first, so that the prefetcher sees the order it learned.
            group = [u for u in self._order if u.module is target.module]
            nbytes = sum(u.padded_numel * self.dtype_of(u).itemsize for u in group)
            if ahead and sum(u.padded_numel * self.dtype_of(u).itemsize for u in ahead) + nbytes > self.gather_budget:
                return
            for member in group:
                self.start_gather(member)

    def _counts_ahead(self, unit: Unit) -> bool:
        """Whether a gathered unit counts against the gather-ahead bounds (not the root, not a persistent one)."""
        return not is_root(unit) and not self._persists(unit) and unit.name not in self._kept

    def _keeps_across(self, unit: Unit) -> bool:
        """Whether the unit, gathered for its forward with grad, stays gathered for its backward: a quantized
        frozen one `_across_the_turn` chose, or one whose gathered buffer is its PARAM home ([Note: homes kept
        across the turn])."""
        if unit.name in self._decoded_across:
            return True
        return unit.name in self._lent and self.store.fetched_in_place(SliceKey(unit.name, Kind.PARAM))

    def _persists(self, unit: Unit) -> bool:
        return unit.numel < self.persistence_threshold

    def _across_the_turn(self) -> frozenset[str]:
        """The last quantized frozen units in the model's order whose gathered bytes fit in `gather_budget`
        together: kept from forward to backward, they are read and dequantized once a step, not twice. In a
        stack of blocks they run last in forward and first in backward, so they are held the shortest."""
        kept, room = set(), self.gather_budget
        for unit in reversed(self.units):
            if unit.trainable or self.codec(unit) is None or is_root(unit) or self._persists(unit):
                continue
            room -= unit.padded_numel * self.dtype_of(unit).itemsize
            if room < 0:
                break
            kept.add(unit.name)
        return frozenset(kept)
