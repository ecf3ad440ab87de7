"""The native decode of a quantized frozen base ([Note: a native decode] in tierzero/units/quantized_base.py):
the torch path's bits for every codec and output dtype, over whole blocks and short tails; corrupt scales
refused with the torch path's error; the torch path kept where the kernels differ or are not built."""

from __future__ import annotations

import ctypes
import logging
import shutil
import struct
import threading
from collections.abc import Iterator

import pytest
import torch

from tierzero.native import dequant
from tierzero.native.dequant import NativeDequant, native_dequant
from tierzero.units import quantized_base
from tierzero.units.blockwise import dequantize_int8, dequantize_nf4, quantize_int8, quantize_nf4
from tierzero.units.quantized_base import BaseCodec, BaseDtype

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

CODECS = [BaseCodec(dtype=BaseDtype.NF4), BaseCodec(dtype=BaseDtype.NF4, double_quant=True), BaseCodec(dtype=BaseDtype.INT8)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
_CHECKED = quantized_base._native_decoder


@pytest.fixture(autouse=True)
def _fresh_checks() -> Iterator[None]:
    _CHECKED.cache_clear()
    yield
    _CHECKED.cache_clear()


def _kernel() -> NativeDequant:
    kernel = native_dequant()
    assert kernel is not None, "the library is built on this machine"
    return kernel


def _values(n: int, seed: int) -> torch.Tensor:
    """Magnitudes from fp16's subnormals to past its largest value, an all-zero block and a lone spike."""
    values = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * torch.logspace(-9, 6, n)
    values[64:128] = 0
    values[n // 3] = 7e5
    return values


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantized_base, "_native_decoder", lambda codec, dtype: None)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}{'-dq' if c.double_quant else ''}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [2, 64, 126, 64 * 257 + 10, 3 * 65536 + 64 * 5 + 18])
def test_a_piece_decodes_to_the_torch_paths_bits(codec: BaseCodec, dtype: torch.dtype, n: int) -> None:
    values = _values(n, seed=n)
    piece = codec.encode(values, pieces=1)
    ours = torch.full((n,), float("nan"), dtype=dtype)
    assert codec._decode_native(_kernel(), piece, out=ours)
    theirs = torch.empty(n, dtype=dtype)
    codec._decode_piece(piece, out=theirs, what="test")
    assert torch.equal(_bits(ours), _bits(theirs))
    q = quantize_int8(values) if codec.dtype is BaseDtype.INT8 else quantize_nf4(values, double_quant=codec.double_quant)
    expected = dequantize_int8(q, dtype=dtype) if codec.dtype is BaseDtype.INT8 else dequantize_nf4(q, dtype=dtype)
    assert torch.equal(_bits(ours), _bits(expected))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}{'-dq' if c.double_quant else ''}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scales_near_fp32s_subnormals_keep_the_torch_paths_bits(codec: BaseCodec, dtype: torch.dtype) -> None:
    # Blocks whose scales fall from normal fp32 through the subnormals, where the products' rounding in
    # registers (bf16) would read them as zero: the kernel must round them as torch does.
    n = 64 * 400
    values = torch.randn(n, generator=torch.Generator().manual_seed(3)) * torch.logspace(-44, -30, n)
    piece = codec.encode(values, pieces=1)
    ours, theirs = torch.full((n,), float("nan"), dtype=dtype), torch.empty(n, dtype=dtype)
    assert codec._decode_native(_kernel(), piece, out=ours)
    codec._decode_piece(piece, out=theirs, what="test")
    assert torch.equal(_bits(ours), _bits(theirs))
    if dtype != torch.float16:  # fp16 holds none of these magnitudes
        assert bool((theirs != 0).any()), "some products are not flushed to zero"


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}{'-dq' if c.double_quant else ''}")
def test_two_threads_write_the_bits_of_one(codec: BaseCodec) -> None:
    n = 4 * 65536 + 64 * 3 + 10  # parts cut on whole chunks of blocks, the last one short
    piece = codec.encode(_values(n, seed=7), pieces=1)
    one, two = torch.empty(n, dtype=torch.bfloat16), torch.full((n,), float("nan"), dtype=torch.bfloat16)
    for out, threads in ((one, 1), (two, 2)):
        if codec.dtype is BaseDtype.INT8:
            assert _kernel().int8(piece, out=out, threads=threads)
        else:
            kw = {"double_quant": codec.double_quant, "code": quantized_base._NF4_VALUES, "dynamic": quantized_base._DYNAMIC_VALUES}
            assert _kernel().nf4(piece, out=out, threads=threads, **kw)
    assert torch.equal(_bits(one), _bits(two))


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}{'-dq' if c.double_quant else ''}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_runs_natively_piece_by_piece_with_the_torch_paths_bits(
    codec: BaseCodec, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    values = _values(3 * 64 * 300, seed=3)
    stored = codec.encode(values, pieces=3)
    calls = []
    kernel = NativeDequant.int8 if codec.dtype is BaseDtype.INT8 else NativeDequant.nf4
    monkeypatch.setattr(NativeDequant, kernel.__name__, lambda self, *a, **kw: calls.append(1) or kernel(self, *a, **kw))
    ours = codec.decode(stored, out=torch.empty(values.numel(), dtype=dtype), pieces=3, what="test")
    assert len(calls) == len(quantized_base._PROBE_SIZES) + 3, "the probe, then the three pieces, natively"
    _torch_only(monkeypatch)
    theirs = codec.decode(stored, out=torch.empty(values.numel(), dtype=dtype), pieces=3, what="test")
    assert torch.equal(_bits(ours), _bits(theirs))


def _corrupt(stored: torch.Tensor, at: int, value: float) -> torch.Tensor:
    bad = stored.clone()
    bad[at : at + 4] = torch.frombuffer(bytearray(struct.pack("<f", value)), dtype=torch.uint8)
    return bad


N = 64 * 300


@pytest.mark.parametrize(
    ("codec", "at", "value"),
    [
        (CODECS[0], N // 2 + 4 * 3, -2.0),  # block 3's absmax
        (CODECS[0], N // 2 + 4 * 299, float("nan")),
        (CODECS[0], N // 2, float("inf")),
        (CODECS[1], N // 2 + 300 + 4, -1.5),  # the second absmax scale
        (CODECS[1], N // 2 + 300 + 8, float("-inf")),  # the offset
        (CODECS[2], N + 4 * 7, float("nan")),  # block 7's scale
        (CODECS[2], N + 4 * 299, -0.25),
    ],
)
def test_a_corrupt_scale_is_refused_with_the_torch_paths_error(
    codec: BaseCodec, at: int, value: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    stored = _corrupt(codec.encode(_values(N, seed=1), pieces=1), at, value)
    out = torch.full((N,), 3.0)
    assert codec.piece_nbytes(N) == stored.numel()
    assert not codec._decode_native(_kernel(), stored, out=out)
    assert bool((out == 3.0).all()), "nothing written"
    with pytest.raises(ValueError, match="quantized base holds .* which no quantizer writes") as native:
        codec.decode(stored, out=out, pieces=1, what="unit u")
    _torch_only(monkeypatch)
    with pytest.raises(ValueError) as torch_path:
        codec.decode(stored, out=out, pieces=1, what="unit u")
    assert str(native.value) == str(torch_path.value)


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.name}{'-dq' if c.double_quant else ''}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_decode_two_threads_share_writes_the_torch_paths_bits(
    codec: BaseCodec, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    # [Note: a shared decode]: one thread starts it, the other finishes it, chunk by chunk.
    monkeypatch.setattr(dequant, "_CHUNK", 16384)
    n = 64 * 3000 + 10  # 12 chunks a piece, the last block short
    stored = codec.encode(_values(2 * n, seed=8), pieces=2)
    ours = torch.full((2 * n,), float("nan"), dtype=dtype)
    shared = codec.share_natively(stored, out=ours, pieces=2, what="test")
    assert shared is not None
    _torch_only(monkeypatch)
    theirs = codec.decode(stored, out=torch.empty(2 * n, dtype=dtype), pieces=2, what="test")
    helper = threading.Thread(target=shared.help)
    helper.start()
    assert shared.finish()
    assert torch.equal(_bits(ours), _bits(theirs)), "all written once finish returns"
    helper.join()
    assert shared.finish(), "nothing left: it returns at once"


def test_finishing_a_shared_decode_waits_for_the_chunks_others_claimed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dequant, "_CHUNK", 16384)
    codec = CODECS[0]
    shared = codec.share_natively(codec.encode(_values(N, seed=9), pieces=1), out=torch.empty(N), pieces=1, what="test")
    assert shared is not None
    counters = (ctypes.c_int64 * 2).from_buffer(shared._states[0])  # dequant.cpp's `Shared`: next, finished
    counters[0] = 1  # chunk 0 taken by a thread that has not finished it
    returned = threading.Event()
    waiter = threading.Thread(target=lambda: shared.finish() and returned.set())
    waiter.start()
    assert not returned.wait(0.3), "it returned before the claimed chunk was done"
    counters[1] += 1
    assert returned.wait(10)
    waiter.join()


@pytest.mark.parametrize(("codec", "at"), [(CODECS[0], N // 2 + 4 * 290), (CODECS[1], N // 2 + 300 + 4), (CODECS[2], N + 4 * 7)])
def test_a_shared_decode_leaves_a_corrupt_scale_to_the_torch_paths_error(codec: BaseCodec, at: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dequant, "_CHUNK", 16384)
    stored = _corrupt(codec.encode(_values(N, seed=1), pieces=1), at, float("nan"))
    shared = codec.share_natively(stored, out=torch.empty(N), pieces=1, what="unit u")
    assert shared is not None
    assert not shared.finish()
    with pytest.raises(ValueError, match="quantized base holds .* which no quantizer writes"):
        codec.decode(stored, out=torch.empty(N), pieces=1, what="unit u")


def test_a_double_quantized_absmax_rebuilt_past_fp32_is_left_to_the_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    codec = CODECS[1]
    stored = codec.encode(_values(N, seed=2), pieces=1)
    stored = _corrupt(_corrupt(stored, N // 2 + 300, 3e38), N // 2 + 300 + 8, 3e38)  # valid, but dynamic * scale + offset overflows
    assert not codec._decode_native(_kernel(), stored, out=torch.empty(N, dtype=torch.bfloat16))
    ours = codec.decode(stored, out=torch.empty(N, dtype=torch.bfloat16), pieces=1, what="test")
    _torch_only(monkeypatch)
    theirs = codec.decode(stored, out=torch.empty(N, dtype=torch.bfloat16), pieces=1, what="test")
    assert not bool(theirs.float().isfinite().all()), "the probe reached the overflow"
    assert torch.equal(_bits(ours), _bits(theirs))


def test_kernels_that_differ_from_the_torch_path_are_not_used(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    nf4 = NativeDequant.nf4

    def off_by_one_ulp(self: NativeDequant, piece: torch.Tensor, *, out: torch.Tensor, **kwargs: object) -> bool:
        done = nf4(self, piece, out=out, **kwargs)
        out.view(torch.int16)[-1] += 1
        return done

    monkeypatch.setattr(NativeDequant, "nf4", off_by_one_ulp)
    codec = BaseCodec(dtype=BaseDtype.NF4)
    values = _values(N, seed=4)
    with caplog.at_level(logging.WARNING):
        assert quantized_base._native_decoder(codec, torch.bfloat16) is None
    assert "native nf4 decode (double_quant=False) into torch.bfloat16 differs" in caplog.text
    out = codec.decode(codec.encode(values, pieces=1), out=torch.empty(N, dtype=torch.bfloat16), pieces=1, what="test")
    assert torch.equal(_bits(out), _bits(dequantize_nf4(quantize_nf4(values), dtype=torch.bfloat16)))
    assert quantized_base._native_decoder(BaseCodec(dtype=BaseDtype.INT8), torch.bfloat16) is not None


def test_without_the_library_the_torch_path_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quantized_base, "native_dequant", lambda: None)
    for codec in CODECS:
        assert quantized_base._native_decoder(codec, torch.bfloat16) is None
        values = _values(N, seed=5)
        out = codec.decode(codec.encode(values, pieces=2), out=torch.empty(N), pieces=2, what="test")
        halves = values.view(2, -1)
        if codec.dtype is BaseDtype.INT8:
            expected = torch.cat([dequantize_int8(quantize_int8(h)) for h in halves])
        else:
            expected = torch.cat([dequantize_nf4(quantize_nf4(h, double_quant=codec.double_quant)) for h in halves])
        assert torch.equal(out, expected)


def test_a_piece_of_the_wrong_size_is_refused_before_it_is_read() -> None:
    piece = BaseCodec(dtype=BaseDtype.NF4).encode(_values(N, seed=6), pieces=1)
    with pytest.raises(ValueError, match=f"a piece of {piece.numel() - 1} bytes for {N} elements"):
        _kernel().nf4(piece[:-1], out=torch.empty(N), double_quant=False, code=torch.zeros(16), dynamic=torch.zeros(256))
