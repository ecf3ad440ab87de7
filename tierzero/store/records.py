"""What the store keeps per slice and per scratch buffer (see [Note: slice lifecycle] in tiered.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.common.transfer import Transfer
from tierzero.offload.base import Region

__all__ = ["FETCHED_STATES", "ScratchRecord", "SliceRecord", "SliceState"]


class SliceState(enum.Enum):
    HOME = "home"
    """Only the home copy exists."""
    FETCHING = "fetching"
    FETCHED = "fetched"
    WRITING = "writing"
    """Fetched, with a write-back to the home still in flight."""


FETCHED_STATES = (SliceState.FETCHING, SliceState.FETCHED, SliceState.WRITING)


@dataclass(slots=True, kw_only=True)
class SliceRecord:
    key: SliceKey
    numel: int
    dtype: torch.dtype
    home: Region
    state: SliceState = SliceState.HOME
    copy_tier: Tier | None = None
    copy: Region | None = None
    """The fetched copy; None while fetched to the home tier (the home tensor is the copy)."""
    fetch: Transfer[torch.Tensor] | None = None
    writes: list[Transfer[None]] = field(default_factory=list)
    inherited: tuple[Transfer[None], ...] = ()
    """Writes from a copy `adopt` moved away: the copy now held does not wait for them to go."""

    @property
    def nbytes(self) -> int:
        return self.home.nbytes

    @property
    def fetched_in_place(self) -> bool:
        """Whether the slice is fetched and its fetched copy is its home itself (`TieredStore.fetch` to the home's memory)."""
        return self.state in FETCHED_STATES and self.copy is None

    def settle(self) -> None:
        if self.writes:
            self.writes = [w for w in self.writes if not w.done()]
        if self.state is SliceState.FETCHING and self.fetch is not None and self.fetch.done():
            self.state = SliceState.FETCHED
        if self.state is SliceState.WRITING and not self.writes:
            self.state = SliceState.FETCHED

    def require(self, *states: SliceState, action: str) -> None:
        if self.state not in states:
            wanted = " or ".join(s.value for s in states)
            raise ValueError(f"cannot {action} {self.key}: it is {self.state.value}, expected {wanted}")

    def typed(self, region: Region) -> torch.Tensor:
        """The slice's value in `region` (its home or a copy): a typed 1-D view."""
        assert region.buffer is not None, f"{region.label}: a memory region without a tensor"
        return region.buffer.view(self.dtype)[: self.numel]

    def source_bytes(self, src: torch.Tensor) -> tuple[torch.Tensor, Tier]:
        """`src`, a whole new value of the slice, as bytes, and the tier its memory counts as."""
        if src.dtype != self.dtype or src.numel() != self.numel:
            raise ValueError(
                f"write_back of {self.key} expects {self.numel} elements of {self.dtype}, got {src.numel()} of {src.dtype}"
            )
        if not src.is_contiguous():
            raise ValueError(f"write_back of {self.key} needs a contiguous tensor: pass src.contiguous()")
        # Where the source memory is decides the path: a CUDA tensor is device memory; a host tensor
        # counts as the fetched copy's tier (the emulated device is host memory), else as cpu memory
        # (the NVMe tier bounces it if unaligned).
        tier = Tier.DEVICE if src.is_cuda else (self.copy_tier or Tier.CPU)
        return src.reshape(-1).view(torch.uint8), tier


@dataclass(slots=True, kw_only=True)
class ScratchRecord:
    kind: Kind
    region: Region
