"""Activations: what autograd saves for backward, counted in the tiers, recomputed or offloaded.

[Note: saved activations]
With `activations.checkpoint` or `activations.offload` set, every tensor autograd saves
during a forward (besides a unit's parameters, which stage 3 replaces by their place in the
gathered buffer) goes through `SavedActivations.pack`:

- it is booked against the device tier (`Kind.ACTIVATION`) while autograd holds it, so
  `memory_report`, the device tier's peak and `tierzero estimate` (whose dry run saves the
  same tensors on the meta device) all count activations. The meta kernels may save other
  dtypes than the device's (LayerNorm's statistics, attention's): on a small bf16 GPT on
  the CPU the dry run books about a seventh more, so it is off by default, where estimates
  of the model state stay within a few percent;
- with `activations.offload: cpu` it is copied into cpu-tier memory instead (pinned with
  CUDA, the copy queued on the current stream without waiting) and comes back for backward.

Stage 3's own saved-tensor hooks call these, so an offload composes with its handling of
parameter views instead of being silently overridden by it, as an outer
`torch.autograd.graph.save_on_cpu` is. `activations.checkpoint: n` recomputes every n-th
block unit's activations in backward (torch's composable, non-reentrant checkpoint): such a
unit saves only its inputs.
"""

from __future__ import annotations

import weakref
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.distributed._composable import checkpoint

from tierzero.common.slices import Kind, Tier
from tierzero.store.protocol import SliceStore
from tierzero.units.unit import ROOT, Unit, module_of

__all__ = ["SavedActivations", "checkpoint_units", "recomputing"]


def recomputing() -> bool:
    """Whether a module runs inside backward: activation checkpointing recomputing its forward."""
    return torch._C._current_graph_task_id() != -1


def checkpoint_units(units: Sequence[Unit], every: int) -> list[str]:
    """Recompute the activations of every `every`-th block unit (0: none); the modules wrapped.

    Called once the engine's unit hooks are registered, so that a unit is gathered before the
    checkpoint starts recording and released after it stops.
    """
    if every <= 0:
        return []
    blocks: list[Unit] = []
    for unit in units:
        if module_of(unit.name) != ROOT and all(unit.module is not b.module for b in blocks):
            blocks.append(unit)
    chosen = blocks[::every]
    for unit in chosen:
        checkpoint(unit.module)
    return [module_of(unit.name) for unit in chosen]


@dataclass(eq=False, slots=True, weakref_slot=True)
class _Kept:
    """A saved tensor left where it is, booked on the device tier while autograd holds it."""

    tensor: torch.Tensor


@dataclass(eq=False, slots=True, weakref_slot=True)
class _Parked:
    """A saved tensor copied into cpu-tier memory, to come back to `device` for backward."""

    buffer: torch.Tensor
    shape: torch.Size
    device: torch.device
    copied_back: list[torch.cuda.Event] = field(default_factory=list)
    """On CUDA, the event after the copy back to the device: the buffer is reused only once it fired."""


class SavedActivations:
    """The pack and unpack of saved tensors: booked on the device tier, or parked in the cpu tier.

    On CUDA both copies run on the current stream without blocking the host (the buffers are
    pinned), so autograd's kernels see them in order; a buffer whose copy back may still run
    when autograd drops it waits in `_returning` until its event has fired.
    """

    def __init__(self, store: SliceStore, *, offload: bool) -> None:
        self.store, self.offload = store, offload
        self._returning: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()

    def pack(self, tensor: torch.Tensor) -> _Kept | _Parked:
        nbytes = tensor.numel() * tensor.element_size()
        if not self.offload or nbytes == 0:
            kept = _Kept(tensor)
            self.store.book(Tier.DEVICE, Kind.ACTIVATION, nbytes)
            weakref.finalize(kept, self.store.book, Tier.DEVICE, Kind.ACTIVATION, -nbytes)
            return kept
        self._free_returned()
        buffer = self.store.allocate(
            kind=Kind.ACTIVATION, numel=tensor.numel(), dtype=tensor.dtype, tier=Tier.CPU, label="activation"
        )
        buffer.view(tensor.shape).copy_(tensor, non_blocking=True)
        parked = _Parked(buffer=buffer, shape=tensor.shape, device=tensor.device)
        weakref.finalize(parked, self._give_back, buffer, parked.copied_back)
        return parked

    def unpack(self, packed: _Kept | _Parked) -> torch.Tensor:
        if isinstance(packed, _Kept):
            return packed.tensor
        back = packed.buffer.view(packed.shape).to(packed.device, non_blocking=True)
        if back.is_cuda:
            event = torch.cuda.Event()
            event.record()
            packed.copied_back.append(event)
        return back

    def _give_back(self, buffer: torch.Tensor, copied_back: list[torch.cuda.Event]) -> None:
        """Autograd dropped a parked tensor: its buffer goes back to the cpu tier once no copy reads it."""
        if copied_back and not copied_back[-1].query():
            self._returning.append((copied_back[-1], buffer))
            return
        self.store.free(buffer)

    def _free_returned(self) -> None:
        while self._returning and self._returning[0][0].query():
            self.store.free(self._returning.popleft()[1])
