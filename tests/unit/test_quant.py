"""Block-wise int8 / int4 quantisation: the error bound, exact cases, byte formula, errors.

The bound asserted for every element x of a block with scale s (qmax 127 or 7):

    |x - dequantize(q, dtype=float32)| <= s * (1/2 + qmax * 2**-22)

the rounding to the nearest step, s / 2, plus fp32 arithmetic slop (x / s and q * s are
each rounded once, together at most 2 ulps of the block's absmax, ~ qmax * s * 2**-23;
the test allows twice that). Dequantising to bf16 / fp16 is that fp32 result rounded
once more to nearest, so it adds at most eps/2 * |value| (+ half a subnormal step).
"""

from __future__ import annotations

import pytest
import torch

from tierzero.comm.quant import QMAX, Quantized, dequantize, quantize, quantized_nbytes

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _block_scales(q: Quantized) -> torch.Tensor:
    return q.scales.repeat_interleave(q.block_size)[: q.numel]


def _fp32_bound(q: Quantized) -> torch.Tensor:
    return _block_scales(q) * (0.5 + QMAX[q.bits] * 2**-22)


def _sample(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp(torch.randn(numel, generator=gen) * 2)
    return (torch.randn(numel, generator=gen) * magnitudes).to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [64, 33])
@pytest.mark.parametrize("blocks_and_tail", [(0, 1), (0, -1), (1, 0), (3, 5), (2, 1), (0, 7)])
def test_round_trip_within_half_a_scale(
    bits: int, dtype: torch.dtype, block_size: int, blocks_and_tail: tuple[int, int]
) -> None:
    full, tail = blocks_and_tail
    numel = full * block_size + tail if tail >= 0 else block_size + tail
    x = _sample(numel, dtype, seed=numel + bits)
    q = quantize(x, bits=bits, block_size=block_size)
    assert (q.numel, q.bits, q.block_size, q.dtype) == (numel, bits, block_size, dtype)

    exact = x.float()
    as_fp32 = dequantize(q, dtype=torch.float32)
    assert ((exact - as_fp32).abs() <= _fp32_bound(q)).all()

    back = dequantize(q)
    assert back.dtype == dtype and back.shape == (numel,)
    assert torch.equal(back, as_fp32.to(dtype))
    info = torch.finfo(dtype)
    cast = 0.0 if dtype == torch.float32 else info.eps / 2 * as_fp32.abs() + info.tiny * info.eps / 2
    assert ((exact - back.float()).abs() <= _fp32_bound(q) + cast).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_multiples_of_the_scale_are_exact(bits: int, dtype: torch.dtype) -> None:
    qmax, block_size = QMAX[bits], 16
    gen = torch.Generator().manual_seed(bits)
    steps = torch.randint(-qmax, qmax + 1, (5 * block_size - 3,), generator=gen)
    steps[::block_size] = qmax * torch.tensor([1, -1, 1, -1, 1])
    scales = torch.tensor([2.0**-3, 2.0**2, 1.0, 2.0**-7, 2.0**5])
    x = (steps * scales.repeat_interleave(block_size)[: steps.numel()]).to(dtype)
    q = quantize(x, bits=bits, block_size=block_size)
    assert torch.equal(q.scales, scales)
    assert torch.equal(dequantize(q), x)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_blocks_and_a_lone_value(bits: int, dtype: torch.dtype) -> None:
    block_size = 8
    x = torch.zeros(3 * block_size + 3, dtype=dtype)
    x[block_size + 5] = -3.7
    x[block_size + 2] = -0.0
    q = quantize(x, bits=bits, block_size=block_size)
    assert torch.equal(q.scales[[0, 2, 3]], torch.zeros(3))
    back = dequantize(q)
    assert torch.isfinite(back).all() and torch.isfinite(q.scales).all()
    assert (back[x == 0] == 0).all()
    if dtype == torch.float32:
        lone = (back[block_size + 5] - x[block_size + 5]).abs()
        assert lone <= q.scales[1] * QMAX[bits] * 2**-22
    else:
        assert torch.equal(back, x)

    empty = quantize(torch.zeros(0), bits=bits)
    assert empty.nbytes == 0 and dequantize(empty).shape == (0,)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 2, 7, 2047, 2048, 2049, 3 * 2048 + 5])
def test_bytes_match_the_formula_and_the_tensors(bits: int, numel: int) -> None:
    x = torch.randn(numel, dtype=torch.bfloat16)
    q = quantize(x, bits=bits, block_size=2048)
    blocks = -(-numel // 2048)
    expected = -(-numel * bits // 8) + 4 * blocks
    assert q.nbytes == quantized_nbytes(numel, bits=bits, block_size=2048) == expected
    assert q.data.untyped_storage().nbytes() + q.scales.untyped_storage().nbytes() == expected


@pytest.mark.parametrize("numel", [2, 4096, 3 * 2048 + 6])
def test_int8_halves_bf16_and_quarters_fp32_plus_scales(numel: int) -> None:
    scales = 4 * -(-numel // 2048)
    bf16 = torch.empty(numel, dtype=torch.bfloat16)
    fp32 = torch.empty(numel, dtype=torch.float32)
    assert quantized_nbytes(numel, bits=8, block_size=2048) == bf16.nbytes // 2 + scales
    assert quantized_nbytes(numel, bits=8, block_size=2048) == fp32.nbytes // 4 + scales
    assert quantized_nbytes(numel, bits=4, block_size=2048) == bf16.nbytes // 4 + scales
    assert quantized_nbytes(numel, bits=4, block_size=2048) == fp32.nbytes // 8 + scales


@pytest.mark.parametrize("bits", [8, 4])
def test_dequantize_writes_into_out(bits: int) -> None:
    x = torch.randn(101, dtype=torch.bfloat16)
    q = quantize(x, bits=bits, block_size=32)
    destination = torch.full((300,), 9.0, dtype=torch.bfloat16)
    piece = destination[100:201]
    written = dequantize(q, out=piece)
    assert written.data_ptr() == piece.data_ptr()
    assert torch.equal(piece, dequantize(q))
    assert (destination[:100] == 9).all() and (destination[201:] == 9).all()

    as_fp32 = torch.empty(101)
    dequantize(q, dtype=torch.float32, out=as_fp32)
    assert torch.equal(as_fp32, dequantize(q, dtype=torch.float32))


def test_int4_packs_low_nibble_first() -> None:
    q = quantize(torch.tensor([1.0, -7.0, 7.0]), bits=4, block_size=3)
    assert q.data.tolist() == [0x91, 0x07]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 3}, r"bits must be 8 \(int8\) or 4 \(int4\), got 3"),
        ({"bits": True}, r"bits must be 8 \(int8\) or 4 \(int4\), got True"),
        ({"block_size": 0}, r"block_size must be an int >= 1, got 0: pass e\.g\. block_size=2048"),
        ({"block_size": 2.0}, r"block_size must be an int >= 1, got 2\.0"),
    ],
)
def test_format_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        quantize(torch.ones(4), **kwargs)
    with pytest.raises(ValueError, match=message):
        quantized_nbytes(4, **{"bits": 8, "block_size": 2048, **kwargs})


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64, torch.bool])
def test_input_dtype_errors(dtype: torch.dtype) -> None:
    with pytest.raises(ValueError, match=rf"float32, bfloat16 or float16 tensor, got {dtype}: cast it first"):
        quantize(torch.ones(4, dtype=dtype))


def test_out_and_record_errors() -> None:
    q = quantize(torch.ones(10, dtype=torch.bfloat16), block_size=4)
    with pytest.raises(ValueError, match=r"out must be a contiguous torch\.bfloat16 tensor of 10 elements"):
        dequantize(q, out=torch.empty(10))
    with pytest.raises(ValueError, match=r"of 10 elements, got torch\.bfloat16 of 9 elements"):
        dequantize(q, out=torch.empty(9, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"contiguous: False"):
        dequantize(q, out=torch.empty(20, dtype=torch.bfloat16)[::2])
    with pytest.raises(ValueError, match=r"data must be uint8 of shape \(10,\)"):
        Quantized(data=q.data[:9], scales=q.scales, numel=10, bits=8, block_size=4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"scales must be torch\.float32 of shape \(3,\)"):
        Quantized(data=q.data, scales=q.scales.half(), numel=10, bits=8, block_size=4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"numel must be >= 0, got -1"):
        quantized_nbytes(-1, bits=8, block_size=4)
