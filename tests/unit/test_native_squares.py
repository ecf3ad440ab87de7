"""The norm's sum of squares (tierzero/native/squares.py): the order its note writes down, to the bit,
natively and with torch's ops, on any number of threads and however the elements come in ranges."""

from __future__ import annotations

import shutil
import struct

import numpy as np
import pytest
import torch

from tierzero.native import squares as squares_module
from tierzero.native.squares import BLOCK, LANES, NARROW_LANES, Squares, lanes_of

native = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

EVERY_BF16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def _written_order(values: torch.Tensor) -> float:
    """The note's order in numpy's scalar arithmetic: lanes in element order (fp32 lanes of 16-bit values,
    fp64 ones of fp32 values), a block's lanes in fp64 in lane order, the blocks in block order, rounded
    to fp32 at the end."""
    count, precision = lanes_of(values.dtype)
    lane_type = np.float32 if precision == torch.float32 else np.float64
    squares = [lane_type(v) * lane_type(v) for v in values.double().tolist()]  # exact in either precision
    total = 0.0
    for start in range(0, len(squares), BLOCK):
        lanes = [lane_type(0.0)] * count
        for i, square in enumerate(squares[start : start + BLOCK]):
            lanes[i % count] = lanes[i % count] + square
        block = 0.0
        for lane in lanes:
            block += float(lane)
        total += block
    return struct.unpack("f", struct.pack("f", total))[0]


def _summed(values: torch.Tensor, cuts: list[int], *, land: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(the total, what the landing wrote) with `values` fed in the ranges between `cuts`."""
    squares, out = Squares(), torch.full_like(values, 7.0)
    bounds = [0, *cuts, values.numel()]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        if land:
            squares.land(values[lo:hi], out[lo:hi], lo)
        else:
            squares.add(values[lo:hi], lo)
    return squares.total, out


def _values(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.logspace(-3, 3, n)[torch.randperm(n, generator=g)]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("library", [True, False], ids=["native", "torch"])
def test_the_sum_is_the_written_order_to_the_bit(dtype: torch.dtype, library: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if library and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not library:
        monkeypatch.setattr(squares_module, "_checked", lambda: None)
    values = _values(dtype, 3 * BLOCK + 1234, seed=0)  # enough whole blocks for two threads to share
    total, _ = _summed(values, [])
    assert total.dtype == torch.float32 and total.dim() == 0
    assert float(total) == _written_order(values)
    # And near the exact sum: within fp32 rounding, or within what fp32 lanes of 512 squares a block lose.
    rel = 1e-7 if dtype == torch.float32 else 1e-5
    assert float(total) == pytest.approx(float(values.double().square().sum()), rel=rel)


@native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ranges_threads_and_the_library_leave_the_bits_as_they_are(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    values = _values(dtype, 5 * BLOCK + 77, seed=1)
    whole, _ = _summed(values, [])
    # Cuts inside a lane's row, at a block's edge, one block apart, two elements apart.
    cuts = [5, 40, BLOCK, BLOCK + 3, 2 * BLOCK + 31, 2 * BLOCK + 33, 4 * BLOCK + 1]
    assert torch.equal(_summed(values, cuts)[0], whole)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(_summed(values, cuts)[0], whole)
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(squares_module, "_checked", lambda: None)
    assert torch.equal(_summed(values, cuts)[0], whole)


@native
def test_gaps_count_as_zeros() -> None:
    values = _values(torch.bfloat16, 3 * BLOCK, seed=2)
    values[100:BLOCK + 50] = 0.0
    values[2 * BLOCK - 7 : 2 * BLOCK + 9] = 0.0
    squares = Squares()
    for lo, hi in ((0, 100), (BLOCK + 50, 2 * BLOCK - 7), (2 * BLOCK + 9, 3 * BLOCK)):
        squares.add(values[lo:hi], lo)
    assert torch.equal(squares.total, _summed(values, [])[0])


@pytest.mark.parametrize("library", [True, False], ids=["native", "torch"])
def test_the_landing_writes_torchs_bits_and_sums_what_it_wrote(library: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if library and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not library:
        monkeypatch.setattr(squares_module, "_checked", lambda: None)
    finite = EVERY_BF16[EVERY_BF16.isfinite()]
    values = finite.repeat(3)[: 2 * BLOCK + 99]
    total, out = _summed(values, [17, BLOCK + 5], land=True)
    assert torch.equal(out.view(torch.int16), torch.add(values, 0.0).view(torch.int16))  # -0.0 lands as +0.0
    assert torch.equal(total, _summed(values, [])[0])
    # Into memory off a cache line's start: the rows cannot be streamed and are stored as usual.
    shifted = torch.full((values.numel() + 1,), 7.0, dtype=torch.bfloat16)
    squares = Squares()
    squares.land(values, shifted[1:], 0)
    assert torch.equal(shifted[1:].view(torch.int16), out.view(torch.int16)) and torch.equal(squares.total, total)
    special = torch.tensor([1.0, float("inf"), 2.0], dtype=torch.bfloat16)
    assert _summed(special, [], land=True)[0].item() == float("inf")
    special[1] = float("nan")
    assert _summed(special, [], land=True)[0].isnan()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("library", [True, False], ids=["native", "torch"])
def test_pieces_in_one_call_sum_as_each_range_alone(dtype: torch.dtype, library: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A unit's gradient pieces: tensors of their own, at offsets with gaps, across blocks and inside one."""
    if library and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not library:
        monkeypatch.setattr(squares_module, "_checked", lambda: None)
    values = _values(dtype, 4 * BLOCK + 301, seed=3)
    ranges = ((0, 7), (9, BLOCK + 3), (BLOCK + 3, BLOCK + 40), (2 * BLOCK - 5, 4 * BLOCK + 300))
    pieces = [(lo, values[lo:hi].clone()) for lo, hi in ranges]
    one_by_one = Squares()
    for at, piece in pieces:
        one_by_one.add(piece, at)
    together = Squares()
    Squares.add_many([(together, pieces)])
    assert torch.equal(together.total, one_by_one.total)
    gapped = values.clone()
    gapped[7:9] = 0
    gapped[BLOCK + 40 : 2 * BLOCK - 5] = 0
    gapped[-1] = 0
    assert torch.equal(together.total, _summed(gapped, [])[0])


@pytest.mark.parametrize("library", [True, False], ids=["native", "torch"])
def test_pieces_out_of_order_are_refused_before_any_counts(library: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if library and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not library:
        monkeypatch.setattr(squares_module, "_checked", lambda: None)
    squares = Squares()
    squares.add(torch.ones(4), 0)
    with pytest.raises(ValueError, match=r"increasing order: elements 8-10 came after elements up to 20"):
        Squares.add_many([(squares, [(10, torch.ones(10)), (8, torch.ones(2))])])
    assert float(squares.total) == 4.0
    Squares.add_many([(squares, [(4, torch.ones(2)), (10, torch.ones(3))])])  # the first refused piece may come again
    assert float(squares.total) == 9.0


def test_ranges_out_of_order_are_refused_before_they_count() -> None:
    squares = Squares()
    squares.add(torch.ones(10), 100)
    before = squares.total
    with pytest.raises(ValueError, match=r"increasing order: elements 105-115 came after elements up to 110"):
        squares.add(torch.ones(10), 105)
    with pytest.raises(ValueError, match="increasing order"):
        squares.land(torch.ones(3), torch.empty(3), 0)
    assert torch.equal(squares.total, before)
    squares.add(torch.ones(2), 110)  # the next range may start where the last ended
    assert float(squares.total) == 12.0


def test_a_slices_ranges_are_counted_in_one_order() -> None:
    assert lanes_of(torch.bfloat16) == lanes_of(torch.float16) == (NARROW_LANES, torch.float32)
    assert lanes_of(torch.float32) == (LANES, torch.float64)
    squares = Squares()
    squares.add(torch.ones(10, dtype=torch.bfloat16), 0)
    squares.add(torch.ones(10, dtype=torch.float16), 10)  # 16-bit values share one order
    with pytest.raises(ValueError, match="float32 values take 1024 lanes after ranges that took 128"):
        squares.add(torch.ones(10), 20)
    assert float(squares.total) == 20.0


def test_a_probe_that_differs_turns_the_library_off(monkeypatch: pytest.MonkeyPatch) -> None:
    if squares_module.library() is None:
        pytest.skip("no native library here")
    squares_module._checked.cache_clear()
    monkeypatch.setattr(squares_module, "_add_torch", lambda values, at, state: state.add_(1.0))
    try:
        assert squares_module._checked() is None
    finally:
        monkeypatch.undo()
        squares_module._checked.cache_clear()
    assert squares_module._checked() is not None


@pytest.mark.parametrize("library", [True, False], ids=["native", "torch"])
def test_many_slices_pieces_in_one_call_count_as_each_slices_alone(library: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`Squares.add_many` (every held unit's pieces at once) gives each slice the bits of adding its ranges alone,
    and a range out of order in any slice is refused before any slice counts."""
    if library and shutil.which("g++") is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not library:
        monkeypatch.setattr(squares_module, "_checked", lambda: None)
    gen = torch.Generator().manual_seed(39)
    slices = [
        [(0, torch.randn(BLOCK + 77, generator=gen).bfloat16()), (BLOCK + 80, torch.randn(300, generator=gen).bfloat16())],
        [(5, torch.randn(2 * BLOCK + 3, generator=gen).bfloat16())],
    ]
    alone = [Squares() for _ in slices]
    for squares, pieces in zip(alone, slices, strict=True):
        for at, values in pieces:
            squares.add(values, at)
    together = [Squares() for _ in slices]
    Squares.add_many(list(zip(together, slices, strict=True)))
    assert all(torch.equal(a.total, b.total) for a, b in zip(alone, together, strict=True))
    assert len({float(s.total) for s in together}) == 2  # each slice its own sum
    one = torch.ones(1, dtype=torch.bfloat16)
    late = 3 * BLOCK
    with pytest.raises(ValueError, match=rf"increasing order: elements {late - 1}-{late} came after elements up to {late + 1}"):
        Squares.add_many([(together[0], [(BLOCK + 400, one)]), (together[1], [(late, one), (late - 1, one)])])
    assert all(torch.equal(a.total, b.total) for a, b in zip(alone, together, strict=True))  # neither counted
    Squares.add_many([(together[0], [(BLOCK + 400, torch.ones(2, dtype=torch.bfloat16))])])  # nor moved on
    assert float(together[0].total) == float(alone[0].total) + 2.0
