"""The sum of a host gradient slice's squares for the norm: one pass at memory speed, in an order
written down, natively where the library is built and with torch's ops where it is not.

[Note: the squares' order]
Clipping needs the norm of every gradient before the step. A dot product of the slice with
itself fixes no order (the BLAS picks one per call and machine), and a bf16 slice had to be
widened into fp32 first: on the 2-core VM the norm of 100M bf16 gradients took 53 ms in 96
widening copies and dots, most of a bare AdamW's 69 ms. Here the order is this module's own:

- a slice is cut into blocks of `BLOCK` elements from its start; in a block, element `i`
  goes to lane `i % lanes`, and each lane adds its elements' squares in element order, from
  zero. fp32 values take `LANES` lanes in fp64; 16-bit values (bf16, fp16) `NARROW_LANES` lanes
  in fp32: the square of a value with at most 11 significant bits has at most 22, exact in either
  precision, so no rounding happens before the sums (a bf16 value past 1.8e19 squares to inf in
  fp32, as its total would round to in fp32 anyway);
- a block's sum is its lanes, in fp64, added in lane order from zero; the slice's total is the
  blocks' sums added in block order from zero, rounded to fp32 once at the end.

Each lane's sum is a chain of adds, so threads take whole blocks and the bits never depend on
how many run. Elements may come in ranges of any size and start (`Squares.add(values, at)`),
ranges in increasing order with gaps between them: a gap stands for zeros, whose squares
add nothing to any lane. So the landing (stages/grads/landing.py) sums each gradient as it
writes it into the slice (`Squares.land`), gaps and all, with the bits of summing the landed
slice afterwards. Without the library the same order runs in torch's ops: the lanes take a
block's rows one `addcmul_` at a time (for many blocks at once), a block's lanes are summed
by a cumulative sum, a chain of adds in order, and the blocks' sums in Python's fp64 floats;
at some forty times the native pass's cost (12.5M bf16 values in 33 ms, fp32 ones in 41, on the dev VM).

Why 128 fp32 lanes for 16-bit values: 128 lanes stay in eight registers while a block is read in
element order, two blocks at a time, and this VM's cores read at the memory's speed only from
more than one stream each (bench step-host, session 37: 12.5M bf16 values in 0.73 ms on two
threads, against 0.97 ms for 1024 fp64 lanes, whose chunks read a block 64 rows at a time). The
price: a lane of 512 squares in fp32 may lose about 512 of its roundings, so a bf16 slice's norm is
within about 1e-5 of the exact one rather than 1e-7, far inside what clipping asks of it.

The native kernels are checked against the torch path on a probe before their first use, as every
kernel here is ([Note: native kernels, torch's bits] in native/adam.py).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import threading
from collections.abc import Sequence

import torch

from tierzero.common.safe_files import say_once
from tierzero.native.build import library

__all__ = ["BLOCK", "LANES", "NARROW_LANES", "Squares", "lanes_of"]

log = logging.getLogger(__name__)

LANES = 1 << 10
NARROW_LANES = 1 << 7
"""Lanes a block for 16-bit values, in fp32 (fp32 values take `LANES`, in fp64)."""
BLOCK = 1 << 16
"""Elements a block: the unit of a thread's share, aligned at the slice's start."""
_TOTAL, _INDEX = LANES, LANES + 1
"""The state's slots past the lanes: the closed blocks' total, the current block's index."""
_TORCH_BLOCKS = {torch.float64: 16, torch.float32: 64}
"""Whole blocks the torch path sums at a time, by the lanes' precision: 8 MiB of fp64 values, or 16 of fp32
(their rows are 8 times as many, so more blocks share each op), in a buffer kept per thread (`_wide`)."""
_buffers = threading.local()
_NATIVE = (torch.bfloat16, torch.float32)


class Squares:
    """The running sum of one slice's squares ([Note: the squares' order]), fed ranges in increasing order."""

    __slots__ = ("_end", "_lanes", "_state")

    def __init__(self) -> None:
        self._state = torch.zeros(LANES + 2, dtype=torch.float64)
        self._end = 0
        """The element after the last range counted: the next range starts there or later."""
        self._lanes: int | None = None
        """The lanes the first range's dtype took: every range of a slice takes the same."""

    def add(self, values: torch.Tensor, at: int) -> None:
        """Count the squares of `values` (1-D, host), the slice's elements `at` to `at + values.numel()`."""
        self._advance(at, values)
        self._count(values, at)

    @staticmethod
    def add_many(many: Sequence[tuple[Squares, Sequence[tuple[int, torch.Tensor]]]]) -> None:
        """`add(values, at)` of each (at, values) of each (squares, pieces) of `many` (the gradient pieces of
        every held unit's slice, [Note: held gradient pieces] in stages/grads/held.py), in one native call
        where it takes every range; a range out of order in any of them is refused before any counts."""
        before = [(squares, squares._end, squares._lanes) for squares, _ in many]
        try:
            for squares, pieces in many:
                for at, values in pieces:
                    squares._advance(at, values)
        except ValueError:
            for squares, end, lanes in before:
                squares._end, squares._lanes = end, lanes
            raise
        ranges = [(squares, at, values) for squares, pieces in many for at, values in pieces]
        kernel = _pieces_kernel([(at, values) for _, at, values in ranges])
        if kernel is None:
            for squares, at, values in ranges:
                squares._count(values, at)
            return
        count = len(ranges)
        kernel(
            (ctypes.c_void_p * count)(*(values.data_ptr() for _, _, values in ranges)),
            (ctypes.c_int64 * count)(*(values.numel() for _, _, values in ranges)),
            (ctypes.c_int64 * count)(*(at for _, at, _ in ranges)), count,
            (ctypes.c_void_p * count)(*(squares._state.data_ptr() for squares, _, _ in ranges)), torch.get_num_threads(),
        )  # fmt: skip

    def _count(self, values: torch.Tensor, at: int) -> None:
        """Add the squares of a range `_advance` has taken."""
        kernels = _kernels(values)
        if kernels is not None and values.is_contiguous():
            kernels[0](values.data_ptr(), values.numel(), at, self._state.data_ptr(), torch.get_num_threads())
        else:
            _add_torch(values, at, self._state)

    def land(self, src: torch.Tensor, out: torch.Tensor, at: int) -> None:
        """Write `out = src + 0.0` (the landing, [Note: stale gradients] in stages/grads/landing.py) and count
        the squares of what it wrote, the slice's elements `at` on, in one pass where the kernels take them."""
        kernels = _kernels(src)
        if kernels is not None and src.dtype == out.dtype and src.is_contiguous() and out.is_contiguous():
            self._advance(at, src)
            ptrs = (src.data_ptr(), out.data_ptr())
            kernels[1](*ptrs, src.numel(), at, self._state.data_ptr(), torch.get_num_threads())
            return
        torch.add(src, 0.0, out=out)
        self.add(out, at)

    def _advance(self, at: int, values: torch.Tensor) -> None:
        count, (lanes, _) = values.numel(), lanes_of(values.dtype)
        if at < self._end:
            raise ValueError(
                f"a slice's squares are counted in increasing order: elements {at}-{at + count} came after "
                f"elements up to {self._end}; count each slice from its start, or start a new Squares"
            )
        if self._lanes is not None and lanes != self._lanes:
            raise ValueError(
                f"a slice's squares are counted in one order: {values.dtype} values take {lanes} lanes after ranges "
                f"that took {self._lanes}; count a slice's ranges in its own dtype"
            )
        self._end, self._lanes = at + count, lanes

    @property
    def total(self) -> torch.Tensor:
        """The sum so far, rounded to fp32 (a 0-d tensor); more ranges may still be added after."""
        lib = _checked()
        if lib is not None:
            return torch.tensor(lib.tz_squares_total(self._state.data_ptr()), dtype=torch.float32)
        return torch.tensor(_total(self._state), dtype=torch.float32)


def _kernels(values: torch.Tensor) -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr] | None:
    """(sum, land-and-sum) for this dtype where the library takes it, else None."""
    if values.device.type != "cpu" or values.dtype not in _NATIVE:
        return None
    lib = _checked()
    if lib is None:
        return None
    if values.dtype == torch.bfloat16:
        return lib.tz_squares_bf16, lib.tz_land_squares_bf16
    return lib.tz_squares_f32, lib.tz_land_squares_f32


def _pieces_kernel(pieces: Sequence[tuple[int, torch.Tensor]]) -> ctypes._CFuncPtr | None:
    """The library's call for these ranges together: host, contiguous, one dtype it takes; else None."""
    if not pieces:
        return None
    dtype = pieces[0][1].dtype
    together = all(values.dtype == dtype and values.device.type == "cpu" and values.is_contiguous() for _, values in pieces)
    if not together or _kernels(pieces[0][1]) is None:
        return None
    lib = _checked()
    assert lib is not None
    return lib.tz_squares_pieces_bf16 if dtype == torch.bfloat16 else lib.tz_squares_pieces_f32


def _lanes_sum(lanes: torch.Tensor) -> torch.Tensor:
    """Each row of lanes added in lane order from zero, (blocks, lanes) -> (blocks,): a cumulative sum is
    a chain of adds in order, the kernel's adds in fp64 (`_block_sum` for one block)."""
    return torch.cat([lanes.new_zeros(lanes.shape[0], 1), lanes], dim=1).cumsum(1)[:, -1]


def _block_sum(state: torch.Tensor) -> float:
    """The current block's lanes added in lane order from zero, in Python's fp64 floats: the kernel's
    adds, without the torch calls a cumulative sum of one row costs."""
    block = 0.0
    for lane in state[:LANES].tolist():
        block += lane
    return block


def _total(state: torch.Tensor) -> float:
    """The closed blocks' total plus the current block's sum: `tz_squares_total`'s adds."""
    return state[_TOTAL].item() + _block_sum(state)


def _close(state: torch.Tensor) -> None:
    """The current block's sum added to the total; the lanes start again."""
    state[_TOTAL] = _total(state)
    state[:LANES] = 0.0


def lanes_of(dtype: torch.dtype) -> tuple[int, torch.dtype]:
    """(lanes a block, their precision) for values of `dtype` ([Note: the squares' order])."""
    if dtype.is_floating_point and dtype.itemsize == 2:
        return NARROW_LANES, torch.float32
    return LANES, torch.float64


def _add_rows(lanes: torch.Tensor, rows: torch.Tensor) -> None:
    """`lanes` (..., lanes) += each row's squares in turn, rows along dim -2: a lane's adds in element order."""
    for r in range(rows.shape[-2]):
        row = rows[..., r, :]
        lanes.addcmul_(row, row)  # the square is exact in the lanes' precision: fused or not, one rounding, the add's


def _wide(dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer of `dtype` for `_TORCH_BLOCKS[dtype]` blocks, made once: a fresh one each call spent
    most of the pass faulting its pages in (27 against 15 ms a 12.5M unit on the dev VM)."""
    buffers = getattr(_buffers, "wide", None)
    if buffers is None:
        buffers = _buffers.wide = {}
    if dtype not in buffers:
        buffers[dtype] = torch.empty(_TORCH_BLOCKS[dtype] * BLOCK, dtype=dtype)
    return buffers[dtype]


def _add_torch(values: torch.Tensor, at: int, state: torch.Tensor) -> None:
    """`Squares.add` in torch's ops, a group of blocks at a time in the lanes' precision."""
    count_lanes, precision = lanes_of(values.dtype)
    pos, end = at, at + values.numel()
    while pos < end:
        block = pos // BLOCK
        if block != int(state[_INDEX]):
            _close(state)
            state[_INDEX] = block
        if pos % BLOCK == 0 and end - pos >= BLOCK:
            # Whole blocks, none of whose elements came before: summed apart, added in block order.
            count = min((end - pos) // BLOCK, _TORCH_BLOCKS[precision])
            lanes = torch.zeros(count, count_lanes, dtype=precision)
            rows = _wide(precision)[: count * BLOCK].copy_(values[pos - at : pos - at + count * BLOCK])
            _add_rows(lanes, rows.view(count, BLOCK // count_lanes, count_lanes))
            total = state[_TOTAL].item()
            for block_sum in _lanes_sum(lanes.double()).tolist():
                total += block_sum
            state[_TOTAL] = total
            pos += count * BLOCK
            state[_INDEX] = pos // BLOCK
            continue
        stop = min(end, (block + 1) * BLOCK)
        head = pos % count_lanes
        part = values[pos - at : stop - at].to(precision)
        padded = torch.cat([part.new_zeros(head), part, part.new_zeros(-(head + part.numel()) % count_lanes)])
        lanes = state[:count_lanes].to(precision)  # fp32 lanes kept in fp64: exact both ways
        _add_rows(lanes, padded.view(-1, count_lanes))
        state[:count_lanes] = lanes
        pos = stop


@functools.cache
def _checked() -> ctypes.CDLL | None:
    """The library, once its sums gave the torch path's bits on a probe: every bf16 value, random bf16 and
    fp32 ones, ranges that start off a lane and cross blocks, on one thread and on two."""
    lib = library()
    if lib is None:
        return None
    call = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    for fn in (lib.tz_squares_bf16, lib.tz_squares_f32):
        fn.argtypes, fn.restype = call, None
    for fn in (lib.tz_land_squares_bf16, lib.tz_land_squares_f32):
        fn.argtypes, fn.restype = [ctypes.c_void_p, *call], None
    lib.tz_squares_total.argtypes, lib.tz_squares_total.restype = [ctypes.c_void_p], ctypes.c_double
    for fn in (lib.tz_squares_pieces_bf16, lib.tz_squares_pieces_f32):
        fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int], None
    generator = torch.Generator().manual_seed(0)
    words = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)
    finite = words.view(torch.bfloat16).isfinite()
    probes = (
        words.view(torch.bfloat16)[finite].repeat(5)[: 5 * BLOCK + 77],  # the largest square to inf in fp32 lanes
        torch.randn(5 * BLOCK + 77, generator=generator).to(torch.bfloat16),  # finite lanes, to the bit
        torch.randn(4 * BLOCK + 1001, generator=generator).mul_(1e3),
    )
    for values in probes:
        ranges = ((0, 5), (5, 40), (40, BLOCK + 3), (2 * BLOCK + 10, values.numel()))
        sum_fn, land_fn = (lib.tz_squares_bf16, lib.tz_land_squares_bf16) if values.dtype == torch.bfloat16 else (
            lib.tz_squares_f32, lib.tz_land_squares_f32)  # fmt: skip
        want = torch.zeros(LANES + 2, dtype=torch.float64)
        for lo, hi in ranges:
            _add_torch(values[lo:hi], lo, want)
        for threads in (1, 2):
            got, landed = torch.zeros_like(want), torch.zeros_like(want)
            out = torch.full_like(values, 7.0)
            for lo, hi in ranges:
                sum_fn(values[lo:].data_ptr(), hi - lo, lo, got.data_ptr(), threads)
                land_fn(values[lo:].data_ptr(), out[lo:].data_ptr(), hi - lo, lo, landed.data_ptr(), threads)
            together = torch.zeros_like(want)
            pieces_fn = lib.tz_squares_pieces_bf16 if values.dtype == torch.bfloat16 else lib.tz_squares_pieces_f32
            pieces_fn(
                (ctypes.c_void_p * len(ranges))(*(values[lo:].data_ptr() for lo, _ in ranges)),
                (ctypes.c_int64 * len(ranges))(*(hi - lo for lo, hi in ranges)), (ctypes.c_int64 * len(ranges))(*(lo for lo, _ in ranges)),
                len(ranges), (ctypes.c_void_p * len(ranges))(*[together.data_ptr()] * len(ranges)), threads,
            )  # fmt: skip
            kept = torch.cat([values[lo:hi] for lo, hi in ranges])
            written = torch.cat([out[lo:hi] for lo, hi in ranges])
            summed = lib.tz_squares_total(got.data_ptr()) == _total(want)
            if not (summed and torch.equal(got, want) and torch.equal(landed, want) and torch.equal(together, want) and torch.equal(written.view(torch.uint8), torch.add(kept, 0.0).view(torch.uint8))):
                say_once(log, "tierzero: the native sum of squares differs from torch's path; the norm runs torch's ops")
                return None
    return lib
