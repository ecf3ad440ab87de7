"""Nearest codes by one table lookup, code values by one lookup per two codes: the per-element work of blockwise.py.

[Note: code tables]
`torch.bucketize` costs a binary search an element (40 ns on the host, 166 ms per 4M
moments). The midpoints m_i ([Note: nearest code] in blockwise.py) are fixed, so the search
is done once per table cell instead, on the bits of the ratio r (|r| <= 1). Let R be r's
fp32 bits as an int32 and Q = R ^ (R >> 31): R itself for r >= 0, R's bits flipped for r < 0,
so Q is non-negative and, within each of its cells (Q's high 16 bits), grows with r. The two
halves do not meet: r in [0, 1] gives Q <= 0x3F800000 (cells below 0x4000), r in [-1, 0) gives
Q >= 0x407FFFFF (cells from 0x4000), so 2^15 cells cover every ratio, and an index never leaves
the table whatever the bits; a NaN or inf never gets this far, refused by its block's absmax.
`code_table` asserts that no cell holds two midpoints: the closest codes, the unsigned code's
top decade, are 0.007 apart where the cells are 0.0039 wide, and everywhere else the codes are
farther apart than the cells are wide. A cell's code is then its lowest value's, plus one above
the midpoint inside it, if any, at Q's low 16 bits t: `offsets` holds (base << 16) + (0xFFFF - t)
minus the cell's own high bits (0xFFFF - t is 0 without a midpoint), so that
code = (Q + offsets[Q >> 16]) >> 16: the low bits carry into the code exactly when Q > the
midpoint's Q, i.e. r > m. That is the count bucketize gives, for every fp32 r;
tests/unit/test_blockwise_speed.py checks it on every cell edge and midpoint, a few ulps either
side, and millions of random ratios. The unsigned code skips the flip: its ratios are |x| / a,
never negative (-0.0 becomes +0.0, the same code).

Per element a quantize is |x|, the block's absmax, the division, the flip (signed code), the
cell, one gather, an add and a shift: `quantize_dynamic` of 4M elements took 8.3 ms signed and
7.5 unsigned on one dev-VM core, against 11.0 and 11.2 for the two-gather lookup before
(/tmp/q8b/qd_ab.py). A dequantize gathers two codes' values at once, from a table of 2^16 fp32
pairs indexed by two code bytes read as one uint16, then scales by the block's absmax: 2.2 ms
per 4M in a step's windows against 2.9 with one gather a code (/tmp/q8b/pairs_ab.py). Both run
one chunk of at most `Scratch`'s size at a time, in its reused buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["CELL_BITS", "CHUNK", "CodeTable", "Scratch", "code_table", "dequantize_into", "quantize_into"]

CELL_BITS = 16
"""High bits of Q (a ratio's flipped bits) that pick its table cell."""
CHUNK = 1 << 16
"""Elements quantized at a time: their few temporaries (about 14 bytes an element) stay in a core's cache."""
_CELLS = 1 << (31 - CELL_BITS)
_LOW = (1 << (32 - CELL_BITS)) - 1


@dataclass(frozen=True, slots=True)
class CodeTable:
    """A code's tables on one device: its nearest-code decision as one int32 lookup on Q's high bits
    ([Note: code tables]), and its values, singly and in pairs for dequantizing."""

    offsets: torch.Tensor
    """int32 per cell of Q: what added to Q leaves the code in bits 16-23."""
    values: torch.Tensor
    """fp32, the code's values, sorted: index i is code i."""
    pairs: torch.Tensor | None
    """int64 per uint16 (codes of 256 values only): the fp32 values of its two code bytes, in memory order."""

    def to(self, device: torch.device) -> CodeTable:
        if self.offsets.device == device:
            return self
        pairs = None if self.pairs is None else self.pairs.to(device)
        return CodeTable(offsets=self.offsets.to(device), values=self.values.to(device), pairs=pairs)


def code_table(values: torch.Tensor, midpoints: torch.Tensor) -> CodeTable:
    """The tables of a code of ``values`` (fp32, sorted, in [-1, 1]) whose nearest-code boundaries are
    ``midpoints``, the nearest-code decision checked to be exact over every cell of Q."""
    cells = torch.arange(_CELLS, dtype=torch.int64)
    q = torch.stack((cells << (32 - CELL_BITS), (cells << (32 - CELL_BITS)) | _LOW))  # each cell's first and last Q
    bits = torch.where(cells < _CELLS // 2, q, ~q)  # back to R: the upper half of the cells holds r < 0
    low, high = bits.to(torch.int32).view(torch.float32)
    c_low, c_high = torch.bucketize(low, midpoints), torch.bucketize(high, midpoints)
    straddles = c_high > c_low
    # Each cell is an interval of fp32 values: one midpoint inside it at most makes the carry exact.
    assert bool((c_high - c_low).le(1).all()), "a cell holds two midpoints: use more cell bits"
    m = midpoints[c_low.clamp(max=midpoints.numel() - 1)].view(torch.int32).to(torch.int64)
    m_q = torch.where(m < 0, ~m, m)
    assert bool((m_q >> (32 - CELL_BITS) == cells)[straddles].all()), "a midpoint's Q outside its cell"
    carry = torch.where(straddles, _LOW - (m_q & _LOW), 0)
    offsets = (c_low << (32 - CELL_BITS)) + carry - (cells << (32 - CELL_BITS))
    pairs = None
    if values.numel() == 256:
        two = torch.arange(1 << 16, dtype=torch.int32).to(torch.uint16).view(torch.uint8).view(-1, 2).long()
        pairs = torch.stack((values[two[:, 0]], values[two[:, 1]]), dim=1).contiguous().view(torch.int64).reshape(-1)
    return CodeTable(offsets=offsets.to(torch.int32), values=values, pairs=pairs)


@dataclass(frozen=True, slots=True)
class Scratch:
    """The buffers one chunk's quantize or dequantize reuses: allocated once a slice, never a chunk."""

    values: torch.Tensor
    """fp32: |x|, then the ratios, then Q (as int32)."""
    cells: torch.Tensor
    """int32: the sign mask, then the cells; a dequantize's code pairs."""
    sums: torch.Tensor
    """int32: offsets, then offsets + Q."""

    @classmethod
    def of(cls, numel: int, device: torch.device | str = "cpu") -> Scratch:
        def one(dtype: torch.dtype) -> torch.Tensor:
            return torch.empty(numel, dtype=dtype, device=device)

        return cls(values=one(torch.float32), cells=one(torch.int32), sums=one(torch.int32))

    @property
    def numel(self) -> int:
        return self.values.numel()


def _head(t: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` elements of ``t``: ``t`` itself when that is all of it (a window's every call
    costs; most windows are whole)."""
    return t if t.numel() == n else t[:n]


def _by_block(op: Callable[..., torch.Tensor], x: torch.Tensor, per_block: torch.Tensor, *, block: int, out: torch.Tensor) -> None:
    """``out = op(x, per_block of each element's block)``, ``x`` starting on a block boundary."""
    n = x.numel()
    if n % block == 0:
        op(x.view(-1, block), per_block.unsqueeze(1), out=out.view(-1, block))
        return
    full = n // block * block
    if full:
        op(x[:full].view(-1, block), per_block[: full // block, None], out=out[:full].view(-1, block))
    op(x[full:], per_block[full // block], out=out[full:])


def quantize_into(
    x: torch.Tensor, *, block: int, table: CodeTable, signed: bool, codes: torch.Tensor, absmax: torch.Tensor, scratch: Scratch
) -> bool:
    """The fp32 absmax of ``x``'s blocks into ``absmax`` and each element's nearest code into ``codes`` (uint8).

    ``x``: fp32, 1-D, starting on a block boundary, at most ``scratch.numel`` elements; ``signed=False``
    for a code without negative values, whose ratios are taken of |x| (``x`` is the caller's to check).
    False, the codes left as they were, where a NaN or inf in ``x`` makes an absmax non-finite."""
    n = x.numel()
    magnitude = torch.abs(x, out=_head(scratch.values, n))
    if n % block == 0:
        torch.amax(magnitude.view(-1, block), dim=1, out=absmax)
    else:
        full = n // block * block
        if full:
            torch.amax(magnitude[:full].view(-1, block), dim=1, out=absmax[: full // block])
        torch.amax(magnitude[full:], dim=0, keepdim=True, out=absmax[full // block :])
    if not math.isfinite(absmax.amax().item()):  # amax keeps a NaN; inf / inf would make a NaN of either sign
        return False
    divisor = torch.where(absmax > 0, absmax, 1.0)  # an all-zero block's ratios are its zeros
    _by_block(torch.div, x if signed else magnitude, divisor, block=block, out=magnitude)
    q, cells, sums = magnitude.view(torch.int32), _head(scratch.cells, n), _head(scratch.sums, n)
    if signed:
        q.bitwise_xor_(torch.bitwise_right_shift(q, 31, out=cells))
    torch.bitwise_right_shift(q, 32 - CELL_BITS, out=cells)
    torch.index_select(table.offsets, 0, cells, out=sums)
    codes.copy_(sums.add_(q).bitwise_right_shift_(32 - CELL_BITS))  # in place, then narrowed: cheaper than a shift into uint8
    return True


def dequantize_into(
    codes: torch.Tensor, absmax: torch.Tensor, *, block: int, table: CodeTable, out: torch.Tensor, scratch: Scratch
) -> None:
    """``codes``' values times their block's ``absmax`` into ``out`` (fp32, 1-D), two codes a lookup;
    ``codes`` start on a block boundary, at most ``scratch.numel`` of them."""
    n = codes.numel()
    # Two bytes read as one uint16 need an even start, as does the int64 view of two fp32 values; on the
    # host only, where a gather costs per element (uint16 is a bare dtype elsewhere: copies may lack it).
    even_starts = codes.storage_offset() % 2 == 0 and out.storage_offset() % 2 == 0
    pairs = table.pairs is not None and codes.device.type == "cpu" and even_starts
    even = n // 2 * 2 if pairs else 0
    if even:
        two = _head(scratch.cells, even // 2)
        two.copy_((codes if even == n else codes[:even]).view(torch.uint16))
        torch.index_select(table.pairs, 0, two, out=(out if even == n else out[:even]).view(torch.int64))
    if even < n:
        one = scratch.cells[: n - even]
        torch.index_select(table.values, 0, one.copy_(codes[even:]), out=out[even:])
    _by_block(torch.mul, out, absmax, block=block, out=out)
