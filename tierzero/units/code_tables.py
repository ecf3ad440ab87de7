"""Nearest codes by table lookup: the per-element decision of tierzero/units/blockwise.py without a search.

[Note: code tables]
`torch.bucketize` costs a binary search an element (40 ns on the host, 166 ms per 4M
moments). The midpoints m_i ([Note: nearest code] in blockwise.py) are fixed, so the search
is done once per table cell instead: a cell is the fp32 values sharing their high 16 bits
(sign, exponent, 7 mantissa bits), an interval of values, and `code_table` records for each
of the 2^16 cells the code of its lowest value and the one midpoint inside it, if any (+inf
if none). It asserts, as it builds a table, that no cell holds two: the closest codes, the
unsigned code's top decade, are 0.007 apart where the cells are 0.0039 wide, and everywhere
else the codes are farther apart than the cells are wide. Then code = base[cell] + (r >
threshold[cell]), the very count bucketize gives, for every fp32 r;
tests/unit/test_blockwise_speed.py checks it against bucketize on every cell edge and
midpoint, a few ulps either side, and millions of random ratios. Quantizing runs a chunk of
`CHUNK` elements at a time (absmax, ratio, cell, two lookups, fix-up), dequantizing is one
gather and one multiply a chunk: 11 ms and 4.5 ms per 4M elements on one host core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["CELL_BITS", "CHUNK", "CodeTable", "absmax_of", "code_table", "nearest_into", "scale_by_block"]

CELL_BITS = 16
"""High bits of an fp32 ratio that pick its table cell."""
CHUNK = 1 << 16
"""Elements quantized at a time: their few temporaries (about 14 bytes an element) stay in a core's cache."""


@dataclass(frozen=True, slots=True)
class CodeTable:
    """A code's nearest-code decision as two lookups on a ratio's high 16 bits ([Note: code tables])."""

    base: torch.Tensor
    """uint8 per cell: the code of the cell's lowest value."""
    threshold: torch.Tensor
    """fp32 per cell: the midpoint inside the cell above which the code is base + 1 (+inf: none inside)."""


def code_table(midpoints: torch.Tensor) -> CodeTable:
    """The table of ``midpoints`` over every fp32 bit pattern's high 16 bits, checked to be exact."""
    cells = torch.arange(1 << CELL_BITS, dtype=torch.int64)
    first = cells << (32 - CELL_BITS)
    ends = torch.stack((first, first | ((1 << (32 - CELL_BITS)) - 1)))
    ends = torch.where(ends >= 1 << 31, ends - (1 << 32), ends).to(torch.int32).view(torch.float32)
    low, high = ends.amin(dim=0), ends.amax(dim=0)
    finite = torch.isfinite(low) & torch.isfinite(high)
    c_low, c_high = torch.bucketize(low, midpoints), torch.bucketize(high, midpoints)
    straddles = finite & (c_high > c_low)
    # Each cell is an interval of fp32 values: one midpoint inside it at most makes base + (r > m) exact.
    assert bool((c_high - c_low)[finite].le(1).all()), "a cell holds two midpoints: use more cell bits"
    threshold = torch.where(straddles, midpoints[c_low.clamp(max=midpoints.numel() - 1)], math.inf)
    return CodeTable(base=torch.where(finite, c_low, 0).to(torch.uint8), threshold=threshold.float())


def absmax_of(flat: torch.Tensor, *, block: int) -> torch.Tensor:
    """Per-block fp32 absmax of ``flat`` (fp32, 1-D), a chunk at a time (NaN anywhere makes its block's NaN)."""
    absmax = flat.new_empty(-(-flat.numel() // block))
    step = max(block, CHUNK // block * block)
    magnitude = flat.new_empty(min(step, flat.numel()))
    for lo in range(0, flat.numel(), step):
        hi = min(lo + step, flat.numel())
        m = torch.abs(flat[lo:hi], out=magnitude[: hi - lo])
        full = (hi - lo) // block * block
        first = lo // block
        if full:
            torch.amax(m[:full].view(-1, block), dim=1, out=absmax[first : first + full // block])
        if full < hi - lo:
            absmax[-1] = m[full:].amax()
    return absmax


def _divide(x: torch.Tensor, divisor: torch.Tensor, *, block: int, out: torch.Tensor) -> None:
    """``out = x / divisor`` of each element's block, ``x`` starting on a block boundary."""
    full = x.numel() // block * block
    if full:
        torch.div(x[:full].view(-1, block), divisor[: full // block, None], out=out[:full].view(-1, block))
    if full < x.numel():
        torch.div(x[full:], divisor[full // block], out=out[full:])


def nearest_into(flat: torch.Tensor, absmax: torch.Tensor, *, block: int, table: CodeTable, out: torch.Tensor) -> None:
    """Each element's nearest code index into ``out`` (uint8), `CHUNK` elements at a time so the
    temporaries stay in cache: ratio, cell, cell lookups, fix-up."""
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    base, threshold = table.base.to(flat.device), table.threshold.to(flat.device)
    step = max(block, CHUNK // block * block)
    size = min(step, flat.numel())
    ratio, cell = flat.new_empty(size), flat.new_empty(size, dtype=torch.int32)
    bound, above = flat.new_empty(size), flat.new_empty(size, dtype=torch.uint8)
    for lo in range(0, flat.numel(), step):
        hi = min(lo + step, flat.numel())
        n = hi - lo
        r, c, codes = ratio[:n], cell[:n], out[lo:hi]
        _divide(flat[lo:hi], divisor[lo // block :], block=block, out=r)
        torch.bitwise_right_shift(r.view(torch.int32), 32 - CELL_BITS, out=c)
        c.bitwise_and_((1 << CELL_BITS) - 1)
        torch.index_select(base, 0, c, out=codes)
        torch.index_select(threshold, 0, c, out=bound[:n])
        torch.gt(r, bound[:n], out=above[:n])
        codes.add_(above[:n])


def scale_by_block(values: torch.Tensor, absmax: torch.Tensor, *, block: int) -> None:
    """``values *= absmax`` of each element's block, in place, ``values`` starting on a block boundary."""
    full = values.numel() // block * block
    if full:
        values[:full].view(-1, block).mul_(absmax[: full // block, None])
    if full < values.numel():
        values[full:].mul_(absmax[full // block])
