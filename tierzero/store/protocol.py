"""What the stages, the step pipeline and the prefetcher ask of a store: `SliceStore`.

Two stores speak it: `TieredStore`, which moves real bytes between tiers, and the
estimator's `CountingStore`, which hands out tensors on the meta device and only
counts what each tier would hold. The callers never learn which one they talk to,
nor where a slice lives (see [Note: slice lifecycle] in tiered.py).
"""

from __future__ import annotations

from typing import Protocol

import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.common.transfer import Transfer
from tierzero.store.ledger import StoreReport

__all__ = ["SliceStore"]


class SliceStore(Protocol):
    def register(self, key: SliceKey, *, numel: int, dtype: torch.dtype, home: Tier) -> None:
        """Allocate the slice's home in `home`."""

    def home_tensor(self, key: SliceKey) -> torch.Tensor:
        """The typed 1-D home of a device- or cpu-homed slice, once its pending writes have landed."""

    def fetch(self, key: SliceKey, *, to: Tier) -> Transfer[torch.Tensor]:
        """Bring the slice to `to` (idempotent while fetched); `.wait()` gives a typed 1-D tensor."""

    def adopt(self, key: SliceKey, *, to: Tier, src: torch.Tensor | None = None) -> Transfer[torch.Tensor]:
        """A fetched copy on `to` made from memory: from `src` (the new value just written home)
        or from the caller's copy on another tier, which moves; not read from the home."""

    def adopt_scratch(self, key: SliceKey, *, to: Tier, scratch: torch.Tensor) -> Transfer[torch.Tensor]:
        """`adopt` from scratch `allocate` made, which the store takes over: moved to `to` where it
        is the same memory, else copied and freed once read."""

    def write_back(self, key: SliceKey, src: torch.Tensor | None = None) -> Transfer[None]:
        """Copy the fetched copy, or `src`, to the slice's home."""

    def release(self, key: SliceKey) -> None:
        """Drop the fetched copy once its transfers are done."""

    def at_home(self, key: SliceKey) -> bool:
        """Whether only the home copy exists."""

    def fetched_in_place(self, key: SliceKey) -> bool:
        """Whether the slice is fetched and its fetched copy is its home itself (no byte of its own)."""

    def allocate(self, *, kind: Kind, numel: int, dtype: torch.dtype, tier: Tier, label: str = "") -> torch.Tensor:
        """Scratch memory in a memory tier, accounted under `kind` until `free`."""

    def free(self, tensor: torch.Tensor) -> None:
        """Give back scratch memory `allocate` returned."""

    def book(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        """Account memory the store did not allocate (what autograd saves); negative gives it back."""

    def kind_bytes(self) -> dict[Kind, int]:
        """Bytes of each model-state kind in their homes, all tiers together."""

    def report(self) -> StoreReport:
        """Bytes per tier, now and at peak."""

    def close(self) -> None:
        """Finish every transfer and free everything. Idempotent."""
