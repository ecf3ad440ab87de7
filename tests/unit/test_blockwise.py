"""The block quantizers against references written here from the papers, bit for bit.

The references share nothing with tierzero/units/blockwise.py: their code books are the QLoRA
paper's published NF4 table and the 8-bit optimizers paper's dynamic tree (sign bit, a run
of zero bits for the exponent, an indicator bit, linear fraction bits), built with exact
fractions; each element is quantized in a plain Python loop, r = fl32(x / absmax) in numpy
fp32, its nearest code found by exact rational distances, ties to the lower code.
"""

from __future__ import annotations

import bisect
import io
import itertools
import math
import statistics
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

from tierzero.units.blockwise import (
    NF4_CODE,
    Int8Tensor,
    NF4Tensor,
    QuantizedAbsmax,
    dequantize_dynamic,
    dequantize_int8,
    dequantize_nf4,
    dynamic_code,
    dynamic_nbytes,
    nf4_nbytes,
    quantize_dynamic,
    quantize_int8,
    quantize_nf4,
)

PAPER_NF4 = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0,
)  # fmt: skip
"""QLoRA's NF4 table as published (bitsandbytes' `get_4bit_type("nf4")`)."""


def _fp32(value: Fraction) -> float:
    """``value`` rounded to the nearest fp32, ties to an even mantissa, decided in exact arithmetic."""
    guess = np.float32(float(value))
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    return float(min(candidates, key=lambda c: (abs(Fraction(float(c)) - value), int(np.array(c).view(np.uint32)) & 1)))


def _tree_code(*, signed: bool) -> list[float]:
    """The dynamic tree: after the sign bit (if any), e zero bits give 10^-e, a one bit, then linear fraction bits."""
    bits = 7 if signed else 8
    values = {Fraction(0), Fraction(1)}
    for zeros in range(7):
        fraction_bits = bits - 1 - zeros
        for k in range(2**fraction_bits):
            centre = Fraction(1, 10) + Fraction(9, 10) * Fraction(2 * k + 1, 2 ** (fraction_bits + 1))
            magnitude = centre / 10**zeros
            values |= {magnitude, -magnitude} if signed else {magnitude}
    return [_fp32(v) for v in sorted(values)]


def _nearest(r: float, code: list[float]) -> int:
    """Index of the code nearest to ``r``, the lower one on a tie, by exact rational distances."""
    upper = bisect.bisect_left(code, r)
    if upper == 0:
        return 0
    if upper == len(code):
        return len(code) - 1
    below, above = Fraction(r) - Fraction(code[upper - 1]), Fraction(code[upper]) - Fraction(r)
    return upper if above < below else upper - 1


def _ref_blocks(x: torch.Tensor, block: int, code: list[float]) -> tuple[list[int], list[float], list[float]]:
    """Reference code indices, per-block absmax and fp32 reconstruction of ``x`` flattened."""
    flat = x.detach().float().reshape(-1).numpy()
    indices, absmaxes, values = [], [], []
    for start in range(0, flat.size, block):
        chunk = flat[start : start + block]
        a = np.float32(max((abs(v) for v in chunk), default=0.0))
        absmaxes.append(float(a))
        for v in chunk:
            r = float(np.float32(v) / a) if a > 0 else 0.0
            indices.append(_nearest(r, code))
            values.append(float(np.float32(code[indices[-1]]) * a))
    return indices, absmaxes, values


def _ref_double_quant(absmax: list[float]) -> tuple[list[int], list[float], float, list[float]]:
    """Reference double quantization: codes, scales, offset and the reconstructed absmax."""
    offset = _fp32(sum(map(Fraction, absmax), Fraction(0)) / len(absmax)) if absmax else 0.0
    centred = torch.tensor([float(np.float32(a) - np.float32(offset)) for a in absmax])
    codes, scales, values = _ref_blocks(centred, 256, _tree_code(signed=True))
    return codes, scales, offset, [float(np.float32(v) + np.float32(offset)) for v in values]


def _pack(indices: list[int]) -> list[int]:
    """Two codes a byte, the first in the high nibble; an odd count padded with the code of 0.0, as a
    zero-padded tensor quantizes (bitsandbytes' `quantize_4bit` does so)."""
    padded = indices + [PAPER_NF4.index(0.0)] * (len(indices) % 2)
    return [(padded[i] << 4) | padded[i + 1] for i in range(0, len(padded), 2)]


def _sample(kind: str, numel: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    if kind == "normal":
        return torch.randn(numel, generator=gen)
    if kind == "heavy":
        return torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen) * 3)
    if kind == "zeros":
        return torch.zeros(numel)
    if kind == "equal":
        return torch.full((numel,), -0.375)
    assert kind == "sparse"
    return torch.randn(numel, generator=gen) * (torch.rand(numel, generator=gen) < 0.05)


KINDS = ("normal", "heavy", "zeros", "equal", "sparse")
SIZES = (1, 63, 64, 64 * 3 + 5, 777)


def _as_list(t: torch.Tensor) -> list[float]:
    return t.reshape(-1).tolist()


def test_nf4_code_book_is_the_papers() -> None:
    assert NF4_CODE == PAPER_NF4
    assert len(NF4_CODE) == 16 and list(NF4_CODE) == sorted(set(NF4_CODE))
    assert {-1.0, 0.0, 1.0} <= set(NF4_CODE)
    assert all(float(np.float32(c)) == c for c in NF4_CODE)
    # QLoRA appendix E: quantiles at 8 (positive) and 7 (negative) steps from 1 - d to 1/2, an exact zero,
    # d = (1/30 + 1/32) / 2 rounded to 7 digits, as the table was computed (in fp32 steps: 1e-7 apart).
    normal, offset = statistics.NormalDist(), 0.9677083
    assert offset == pytest.approx(1 - (1 / 30 + 1 / 32) / 2, abs=1e-7)
    positive = [normal.inv_cdf(offset + (0.5 - offset) * k / 8) for k in range(8)]
    negative = [-normal.inv_cdf(offset + (0.5 - offset) * k / 7) for k in range(7)]
    derived = sorted(positive + [0.0] + negative)
    assert NF4_CODE == pytest.approx([v / max(derived) for v in derived], abs=2e-7)


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_code_is_the_papers_tree(signed: bool) -> None:
    code = dynamic_code(signed=signed)
    assert list(code) == _tree_code(signed=signed)
    assert len(code) == 256 and list(code) == sorted(set(code)) and {0.0, 1.0} <= set(code)
    assert min(code) == (pytest.approx(-0.99296875) if signed else 0.0)  # the signed code has no -1


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("double_quant", [False, True])
def test_nf4_equals_the_reference(kind: str, numel: int, double_quant: bool) -> None:
    x = _sample(kind, numel, seed=numel)
    q = quantize_nf4(x, double_quant=double_quant)
    indices, absmax, values = _ref_blocks(x, 64, list(PAPER_NF4))
    assert q.codes.tolist() == _pack(indices)
    if double_quant:
        codes, scales, offset, absmax = _ref_double_quant(absmax)
        assert isinstance(q.absmax, QuantizedAbsmax)
        assert (q.absmax.codes.tolist(), _as_list(q.absmax.scales), q.absmax.offset.item()) == (codes, scales, offset)
        values = [float(np.float32(PAPER_NF4[i]) * np.float32(absmax[k // 64])) for k, i in enumerate(indices)]
    else:
        assert _as_list(q.absmax) == absmax
    assert _as_list(dequantize_nf4(q, dtype=torch.float32)) == values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block", [2, 6, 128])
def test_nf4_other_dtypes_and_blocks(dtype: torch.dtype, block: int) -> None:
    x = _sample("heavy", 301, seed=block).clamp(-6e4, 6e4).to(dtype).view(7, 43)
    q = quantize_nf4(x, block=block)
    indices, absmax, values = _ref_blocks(x, block, list(PAPER_NF4))
    assert (q.codes.tolist(), _as_list(q.absmax)) == (_pack(indices), absmax)
    out = dequantize_nf4(q)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, torch.tensor(values).view(7, 43).to(dtype))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("block", [64, 5])
def test_int8_equals_the_reference(kind: str, numel: int, block: int) -> None:
    x = _sample(kind, numel, seed=numel + 1)
    q = quantize_int8(x, block=block)
    codes, scales, values = [], [], []
    flat = x.numpy()
    for start in range(0, numel, block):
        chunk = flat[start : start + block]
        scale = np.float32(max(abs(v) for v in chunk)) / np.float32(127)
        scales.append(float(scale))
        for v in chunk:
            code = max(-127, min(127, round(float(np.float32(v) / scale)))) if scale > 0 else 0
            codes.append(code)
            values.append(float(np.float32(code) * scale))
    assert (q.codes.tolist(), _as_list(q.scales)) == (codes, scales)
    assert _as_list(dequantize_int8(q)) == values


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("numel", [1, 255, 256, 600])
@pytest.mark.parametrize("block", [256, 7])
def test_dynamic_equals_the_reference(signed: bool, kind: str, numel: int, block: int) -> None:
    x = _sample(kind, numel, seed=numel + 2).view(-1, 1)
    x = x if signed else x.abs() ** 2
    codes, absmax = quantize_dynamic(x, signed=signed, block=block)
    indices, ref_absmax, values = _ref_blocks(x, block, _tree_code(signed=signed))
    assert codes.shape == x.shape and codes.dtype == torch.uint8
    assert (_as_list(codes), _as_list(absmax)) == (indices, ref_absmax)
    assert _as_list(dequantize_dynamic(codes, absmax, signed=signed, block=block)) == values


def _tie_cases(code: list[float]) -> tuple[list[float], list[int], int]:
    """Inputs r at and beside each midpoint of neighbouring codes, the index the rule gives each, and the exact ties."""
    inputs, expected, exact_ties = [], [], 0
    for i in range(len(code) - 1):
        exact = (Fraction(code[i]) + Fraction(code[i + 1])) / 2
        m = np.float32(float(exact))
        inputs += [float(np.nextafter(m, np.float32(-2))), float(np.nextafter(m, np.float32(2))), float(m)]
        expected += [i, i + 1, i if Fraction(float(m)) <= exact else i + 1]
        exact_ties += Fraction(float(m)) == exact
    return inputs, expected, exact_ties


def test_ties_go_to_the_lower_code() -> None:
    inputs, expected, exact_ties = _tie_cases(list(PAPER_NF4))
    assert exact_ties > 0
    x = torch.tensor([1.0] + inputs)  # absmax 1: r is x itself
    q = quantize_nf4(x, block=len(x) + len(x) % 2)
    unpacked = torch.stack((q.codes >> 4, q.codes & 15), dim=1).view(-1)[: len(x)].tolist()
    assert unpacked[1:] == expected
    for signed in (True, False):
        inputs, expected, exact_ties = _tie_cases(_tree_code(signed=signed))
        assert exact_ties > 0
        codes, _ = quantize_dynamic(torch.tensor([1.0] + inputs), signed=signed, block=1024)
        assert codes.tolist()[1:] == expected
    q8 = quantize_int8(torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5]))  # scale 1: half-even
    assert q8.codes.tolist() == [127, 0, 2, 2, 0, -2]


def test_nibble_order_and_packing_round_trip() -> None:
    assert quantize_nf4(torch.tensor([-1.0, 1.0])).codes.tolist() == [0x0F]
    assert quantize_nf4(torch.tensor([1.0, -1.0, 0.0])).codes.tolist() == [0xF0, 0x77]  # padded with 0.0's code, 7
    indices = torch.randint(0, 16, (129,), generator=torch.Generator().manual_seed(0))
    x = torch.tensor(PAPER_NF4)[indices]
    x[0] = 1.0  # one block of absmax 1: each value is its own code
    q = quantize_nf4(x, block=130)
    unpacked = torch.stack((q.codes >> 4, q.codes & 15), dim=1).view(-1)
    assert unpacked[:129].tolist() == [15] + indices[1:].tolist() and unpacked[129] == PAPER_NF4.index(0.0)
    assert torch.equal(dequantize_nf4(q), x)


def _radius(code: list[float], *, signed: bool) -> float:
    """The farthest a point of [-1, 1] ([0, 1] unsigned) lies from its nearest code."""
    gaps = [(b - a) / 2 for a, b in itertools.pairwise(code)]
    return max(gaps + [code[0] - (-1.0 if signed else 0.0), 1.0 - code[-1]])


@pytest.mark.parametrize("seed", [0, 1])
def test_error_bounds(seed: int) -> None:
    signed_x = _sample("heavy", 5000, seed=seed)
    squares = signed_x.square().clamp(max=1e38)
    for x, dq, block, code, signed in (
        (signed_x, dequantize_nf4(quantize_nf4(signed_x)), 64, list(PAPER_NF4), True),
        (signed_x, dequantize_int8(quantize_int8(signed_x)), 64, [k / 127 for k in range(-127, 128)], True),
        (
            signed_x,
            dequantize_dynamic(*quantize_dynamic(signed_x, signed=True), signed=True),
            256,
            _tree_code(signed=True),
            True,
        ),
        (
            squares,
            dequantize_dynamic(*quantize_dynamic(squares, signed=False), signed=False),
            256,
            _tree_code(signed=False),
            False,
        ),
    ):
        absmax = torch.nn.functional.pad(x.abs(), (0, -len(x) % block)).view(-1, block).amax(1)
        bound = absmax.repeat_interleave(block)[: len(x)] * (_radius(code, signed=signed) + 2**-22)
        assert bool(((x - dq).abs() <= bound).all())
    assert _radius(list(NF4_CODE), signed=True) == (1 - 0.6961928009986877) / 2  # between -1 and the next


def test_quantizing_nf4_values_again_is_exact() -> None:
    x = _sample("normal", 1000, seed=3)
    q = quantize_nf4(x)
    again = quantize_nf4(dequantize_nf4(q))
    assert torch.equal(again.codes, q.codes) and torch.equal(again.absmax, q.absmax)


def test_the_double_quantized_stored_form_round_trips() -> None:
    q = quantize_nf4(_sample("heavy", 3000, seed=4).bfloat16(), double_quant=True)
    assert isinstance(q.absmax, QuantizedAbsmax)
    buffer = io.BytesIO()
    torch.save({"codes": q.codes, "a": q.absmax.codes, "s": q.absmax.scales, "o": q.absmax.offset}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    absmax = QuantizedAbsmax(codes=saved["a"], scales=saved["s"], offset=saved["o"])
    loaded = NF4Tensor(codes=saved["codes"], absmax=absmax, shape=q.shape, dtype=q.dtype)
    assert torch.equal(dequantize_nf4(loaded), dequantize_nf4(q))
    assert q.nbytes == nf4_nbytes(3000, double_quant=True) < nf4_nbytes(3000)


@pytest.mark.parametrize("numel", [0, 1, 63, 64, 65, 100_000])
def test_byte_counts(numel: int) -> None:
    x = torch.ones(numel)
    for double_quant in (False, True):
        assert quantize_nf4(x, double_quant=double_quant).nbytes == nf4_nbytes(numel, double_quant=double_quant)
    codes, absmax = quantize_dynamic(x, signed=False)
    assert codes.numel() + 4 * absmax.numel() == dynamic_nbytes(numel)
    assert quantize_int8(x).nbytes == numel + 4 * math.ceil(numel / 64)
    assert nf4_nbytes(2**20, double_quant=True) == 2**19 + 2**14 + 4 * 2**6 + 4  # 0.516 B per element


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_values_are_refused(bad: float) -> None:
    x = torch.ones(100)
    x[70] = bad
    for quantize in (quantize_nf4, quantize_int8, lambda t: quantize_dynamic(t, signed=True)):
        with pytest.raises(ValueError, match="1 inf/NaN of 100"):
            quantize(x)


def test_bad_input_is_refused_with_the_fix() -> None:
    for x in (torch.arange(8), torch.ones(8, dtype=torch.float64), torch.ones(8, dtype=torch.bool)):
        with pytest.raises(ValueError, match="cast it first"):
            quantize_nf4(x)
        with pytest.raises(ValueError, match="cast it first"):
            quantize_dynamic(x, signed=True)
    blocks: tuple[Any, ...] = (0, -64, 63, 1, True, 64.0)
    for block in blocks:
        with pytest.raises(ValueError, match="positive even int"):
            quantize_nf4(torch.ones(8), block=block)
    with pytest.raises(ValueError, match="positive int"):
        quantize_int8(torch.ones(8), block=0)
    with pytest.raises(ValueError, match="non-negative values"):
        quantize_dynamic(torch.tensor([1.0, -1e-30]), signed=False)


def test_records_refuse_mismatched_parts() -> None:
    q = quantize_nf4(torch.ones(130))
    with pytest.raises(ValueError, match=r"codes must be torch.uint8 of shape \(65,\)"):
        NF4Tensor(codes=q.codes[:-1], absmax=q.absmax, shape=q.shape, dtype=q.dtype)
    assert isinstance(q.absmax, torch.Tensor)
    with pytest.raises(ValueError, match=r"absmax must be torch.float32 of shape \(3,\)"):
        NF4Tensor(codes=q.codes, absmax=q.absmax.half(), shape=q.shape, dtype=q.dtype)
    with pytest.raises(ValueError, match="offset must be torch.float32"):
        QuantizedAbsmax(codes=torch.zeros(3, dtype=torch.uint8), scales=torch.ones(1), offset=torch.ones(1))
    with pytest.raises(ValueError, match=r"scales must be torch.float32 of shape \(2,\)"):
        codes = torch.zeros(100, dtype=torch.int8)
        Int8Tensor(codes=codes, scales=torch.ones(1), shape=torch.Size([100]), dtype=torch.float32)
    with pytest.raises(ValueError, match=r"absmax must be torch.float32 of shape \(1,\)"):
        dequantize_dynamic(torch.zeros(10, dtype=torch.uint8), torch.ones(2), signed=True)


@pytest.mark.parametrize("double_quant", [False, True])
def test_bitsandbytes_quantize_4bit_agrees(double_quant: bool) -> None:
    bnb_functional = pytest.importorskip("bitsandbytes.functional")
    x = _sample("normal", 4096 + 37, seed=5)
    try:
        packed, state = bnb_functional.quantize_4bit(
            x, blocksize=64, quant_type="nf4", compress_statistics=double_quant
        )
        theirs = bnb_functional.dequantize_4bit(packed, state)
    except (RuntimeError, NotImplementedError) as error:  # no working CPU backend in this build
        pytest.skip(f"bitsandbytes has no working CPU backend here: {error}")
    ours = quantize_nf4(x, double_quant=double_quant)
    assert torch.equal(packed.view(-1), ours.codes)
    if isinstance(ours.absmax, QuantizedAbsmax):
        # bitsandbytes builds its dynamic code in fp32 steps, one ulp off ours in some values: near-ties may part
        assert (state.absmax.view(-1) == ours.absmax.codes).float().mean() > 0.99
    else:
        assert torch.equal(state.absmax.float(), ours.absmax)
        assert torch.equal(theirs.view(-1), dequantize_nf4(ours).view(-1))
