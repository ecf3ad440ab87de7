"""Reproducible test bytes for benchmarks: random, yet cheap to make and to check again.

Drawing gigabytes of random bytes costs seconds per GiB on this machine, which would
dwarf the I/O being measured. So a buffer is filled with a seeded random block,
repeated, and the first 8 bytes of every 4 KiB page are overwritten with a stamp
(`stamp << 32 | page index`). The stamp makes each page distinct, so a page that was
dropped, written twice, or landed at the wrong offset no longer matches, and a new
stamp per pass catches a write that never happened.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAGE = 4096
_BLOCK = 16 << 20
_STAMP_BYTES = 8


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The first byte that differs between what was read and what was expected."""

    offset: int
    expected: int
    actual: int

    def __str__(self) -> str:
        return f"byte {self.offset}: expected 0x{self.expected:02x}, read 0x{self.actual:02x}"


def random_block(seed: int, nbytes: int = _BLOCK) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)


def fill(buf: torch.Tensor, *, block: torch.Tensor, stamp: int) -> None:
    """Overwrite the 1-D uint8 `buf` with `block` repeated, then stamp each full page."""
    assert buf.dim() == 1 and buf.dtype == torch.uint8
    n, size = buf.numel(), block.numel()
    for start in range(0, n, size):
        stop = min(n, start + size)
        buf[start:stop].copy_(block[: stop - start])
    stamp_pages(buf, stamp=stamp)


def stamp_pages(buf: torch.Tensor, *, stamp: int) -> None:
    """Rewrite only the 8-byte page stamps of `buf`: a new pass in milliseconds per GiB."""
    pages = buf.numel() // PAGE
    if pages:
        marks = torch.arange(pages, dtype=torch.int64) + (stamp << 32)
        stamps = marks.view(torch.uint8).view(pages, _STAMP_BYTES)
        buf[: pages * PAGE].view(pages, PAGE)[:, :_STAMP_BYTES].copy_(stamps)


def first_mismatch(actual: torch.Tensor, expected: torch.Tensor) -> Mismatch | None:
    """None when the two 1-D uint8 tensors are equal, else where they first differ."""
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    if torch.equal(actual, expected):
        return None
    offset = int((actual != expected).nonzero()[0, 0])
    return Mismatch(offset=offset, expected=int(expected[offset]), actual=int(actual[offset]))
