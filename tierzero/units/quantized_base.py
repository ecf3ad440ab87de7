"""A frozen base kept block-wise quantized (QLoRA): the bytes a frozen unit's PARAM slice holds.

[Note: quantized base]
Under `model.lora.base_dtype: nf4 | int8`, each frozen unit's PARAM slice holds, in place of
its compute-dtype values, uint8 bytes: the quantized form of each of the unit's N shards (N
the world size), one after the other, each encoded alone. A piece of n elements (n a
multiple of the shard alignment, hence of every block) is laid out as

- int8: n int8 codes, then ceil(n / 64) fp32 scales (tierzero/units/blockwise.py's `quantize_int8`);
- nf4: n / 2 bytes of packed 4-bit codes, then n / 64 fp32 absmax; with double quantization
  n / 64 uint8 absmax codes, ceil(n / 16384) fp32 scales and one fp32 offset instead of the absmax
  (`quantize_nf4`).

Because the pieces are the shards, a rank of stage 3 keeps exactly its own piece, an all-gather
of the pieces is the same bytes stages 1 and 2 keep whole, and the dequantized values are the
same at every stage for a given N. Without double quantization they do not depend on N either:
blocks never straddle a shard. The values are quantized once, from fp32, when the unit's slices
are registered (from the model's weights or streamed from `model.pretrained`, unit by unit), and
dequantized to the compute dtype after each gather, into the unit's gathered buffer.

[Note: decoding a chunk on one core]
Without the native kernels ([Note: a native decode]), on the host a unit is dequantized `CHUNK`
elements at a time so that the temporaries stay in a core's cache, on the calling thread with one
intra-op thread (`one_thread`, common/threads.py): split over the cores, each op of a chunk costs
more in its fork and join than in its work. On the 2-core dev VM, busy with
other processes, 8M elements decoded in 221 ms per 100M at one thread against 1223 at two (medians
of 5, /tmp/nf4/deq3.py). This decode on a thread of its own, overlapping the matmuls of the unit before,
was slower still there (2B model, one LoRA step: 28-37 s against 20-25 s on the compute thread): its
ops and the compute's share the intra-op threads. The native decode runs ahead so
([Note: decoding ahead] in units/decode_ahead.py); this one stays on the compute thread.

[Note: a native decode]
Where the native library is built (tierzero/native/build.py), a host piece is decoded by one call
of native/dequant.cpp instead: each packed byte read once, its two code values looked up and scaled
in fp32 and each rounded once into `out`, the torch path's arithmetic, with no temporaries. Before
its first use for a codec and an output dtype, `_native_decoder` decodes probe pieces both ways (whole
blocks and a short one, zero and tiny and huge blocks, two absmax scales) and keeps the torch path
for the process on any bit apart. A piece with a bad stored scale is the torch path's too, which
raises its error. On the 2-core dev VM, busy, 8M elements decoded into bf16 in 0.21 ns an element
(NF4), 0.26 (double-quantized) and 0.25 (int8) against 1.46, 1.97 and 0.70 by the torch path; into
fp32, bound by the writes, 2-2.5 times as fast (medians of 7, alternated, /tmp/dq43/bench2.py). A
2B LoRA step (r 16, base on NVMe, 64 tokens) took 7.8 s against 14.3 with the torch path's decode,
and 8.4 with a bf16 base (medians of 4, alternated, /tmp/dq43/ab_native.py).

Into bf16, where the CPU has AVX512-BF16, the kernels round in registers and stream whole cache lines
past the caches (an ordinary store first reads the line it writes, and a unit's 150 MB are evicted long
before its matmuls read them). Decoding 16 weights of 5632 x 2048 then took 0.195 ns an element
against 0.32-0.37 (one thread), 0.15 against 0.20-0.27 (two) (session 32, /tmp/s32/parts.py). A piece
runs on one thread, since in the engine it runs beside the compute ([Note: decoding ahead] in
units/decode_ahead.py).
"""

from __future__ import annotations

import enum
import functools
import logging
from dataclasses import dataclass

import torch

from tierzero.common.safe_files import say_once
from tierzero.common.threads import one_thread
from tierzero.native.dequant import NativeDequant, SharedDecode, native_dequant
from tierzero.units.blockwise import (
    ABSMAX_BLOCK,
    INT8_BLOCK,
    NF4_BLOCK,
    NF4_CODE,
    Int8Tensor,
    NF4Tensor,
    QuantizedAbsmax,
    dequantize_int8,
    dequantize_nf4,
    dynamic_table,
    nf4_nbytes,
    quantize_int8,
    quantize_nf4,
)
from tierzero.units.code_tables import CHUNK

__all__ = ["BaseCodec", "BaseDtype", "CodesInFlight"]

log = logging.getLogger(__name__)

_F32 = 4
_BYTES = torch.arange(256)
_PAIRS = torch.tensor(NF4_CODE, dtype=torch.float32)[torch.stack((_BYTES >> 4, _BYTES & 0x0F), dim=1)]
"""The two NF4 values of each packed byte, the even element's (high nibble) first."""
_PAIR_WORDS = _PAIRS.contiguous().view(torch.int64).view(256)
"""`_PAIRS` with each byte's two fp32 values as one 8-byte word: one lookup moves both."""
_NF4_VALUES = torch.tensor(NF4_CODE, dtype=torch.float32)
_DYNAMIC_VALUES = dynamic_table(signed=True, device=torch.device("cpu")).values
"""The signed dynamic code's values, which rebuild a double-quantized absmax (`QuantizedAbsmax.dequantize`)."""
_NATIVE_THREADS = 1
"""Threads a native decode runs on ([Note: a native decode]): one, the decoder's or the calling thread's."""
_DEVICE_CHUNK = 1 << 24
"""Elements dequantized at a time off the host: no cache to stay in, but a bound on the temporaries
(6 bytes an element) and few kernel launches."""


class BaseDtype(enum.Enum):
    """How a quantized frozen base is stored (`model.lora.base_dtype`)."""

    INT8 = "int8"
    NF4 = "nf4"


def _blocks(numel: int, block: int) -> int:
    return -(-numel // block)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def _floats(stored: torch.Tensor) -> torch.Tensor:
    """fp32 values of a byte range (copied: the range need not be 4-byte aligned)."""
    return stored.clone().view(torch.float32)


@dataclass(frozen=True, slots=True, kw_only=True)
class BaseCodec:
    """Encodes a frozen unit's values into the bytes its PARAM slice keeps, and back ([Note: quantized base])."""

    dtype: BaseDtype
    double_quant: bool = False
    """nf4 only: the absmax double-quantized (QLoRA's section 3)."""

    def __post_init__(self) -> None:
        if self.double_quant and self.dtype is not BaseDtype.NF4:
            raise ValueError("model.lora.double_quant applies to model.lora.base_dtype nf4 only: unset it or use nf4")

    @classmethod
    def of(cls, dtype: str | None, *, double_quant: bool = False) -> BaseCodec | None:
        """The codec for a quantized base dtype ("int8", "nf4"); None for None (the base in the compute dtype)."""
        return None if dtype is None else cls(dtype=BaseDtype(dtype), double_quant=double_quant)

    @property
    def name(self) -> str:
        return self.dtype.value

    def piece_nbytes(self, numel: int) -> int:
        """Bytes of one encoded piece of `numel` elements."""
        if self.dtype is BaseDtype.INT8:
            return numel + _F32 * _blocks(numel, INT8_BLOCK)
        return nf4_nbytes(numel, block=NF4_BLOCK, double_quant=self.double_quant)

    def stored_nbytes(self, numel: int, *, pieces: int) -> int:
        """Bytes of `numel` elements encoded as `pieces` equal pieces."""
        assert numel % pieces == 0, (numel, pieces)
        return pieces * self.piece_nbytes(numel // pieces)

    def encode(self, values: torch.Tensor, *, pieces: int) -> torch.Tensor:
        """`values` (1-D, any float dtype) as `pieces` encoded pieces, uint8, on their device."""
        nbytes = self.stored_nbytes(values.numel(), pieces=pieces)
        if values.device.type == "meta":
            return torch.empty(nbytes, dtype=torch.uint8, device="meta")
        n = values.numel() // pieces
        out = torch.cat([self._encode_piece(piece) for piece in values.reshape(pieces, n)])
        assert out.numel() == nbytes
        return out

    def decode(self, stored: torch.Tensor, *, out: torch.Tensor, pieces: int, what: str) -> torch.Tensor:
        """Dequantize `stored` (as `encode` made it) into `out` (1-D, the compute dtype); returns `out`.

        Raises ValueError when a stored scale is not finite and >= 0: no quantizer writes one, so the
        bytes are corrupt (`what` names the slice in the message).
        """
        split = self._split(stored, out=out, pieces=pieces, what=what)
        if stored.device.type == "meta":
            return out
        native = self.native_decoder(stored, out=out)
        with one_thread(out.device):
            for piece, into in split:
                if native is None or not self._decode_native(native, piece, out=into):
                    self._decode_piece(piece, out=into, what=what)
        return out

    def native_decoder(self, stored: torch.Tensor, *, out: torch.Tensor) -> NativeDequant | None:
        """The native kernels that decode `stored` into `out` with the torch path's bits; None where
        there are none (off the host, not built, or differing: [Note: a native decode])."""
        return _native_decoder(self, out.dtype) if stored.device.type == out.device.type == "cpu" else None

    def share_natively(self, stored: torch.Tensor, *, out: torch.Tensor, pieces: int, what: str) -> SharedDecode | None:
        """`decode` by the native kernels alone, shared by the threads that call the result's `help` or
        `finish` ([Note: a shared decode] in native/dequant.cpp): no torch op, no torch thread count.
        None where the kernels do not take a piece; `finish` says False where one is left to the torch
        path (`decode` then decodes it all again, and raises for a corrupt scale)."""
        split = self._split(stored, out=out, pieces=pieces, what=what)
        native = self.native_decoder(stored, out=out)
        nf4 = self.dtype is BaseDtype.NF4
        if native is None or not all(native.supports(piece, into) and not (nf4 and into.numel() % 2) for piece, into in split):
            return None
        return native.shared(split, nf4=nf4, double_quant=self.double_quant, code=_NF4_VALUES, dynamic=_DYNAMIC_VALUES)

    def _split(self, stored: torch.Tensor, *, out: torch.Tensor, pieces: int, what: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`stored`'s pieces, each with the part of `out` it decodes into; ValueError where `stored` is
        not `pieces` pieces for `out`."""
        n = out.numel() // pieces
        size = self.piece_nbytes(n)
        if stored.numel() != size * pieces:
            raise ValueError(f"{what}: {stored.numel()} bytes stored, {self.name} needs {size * pieces} for {out.numel()} elements")
        return [(stored.narrow(0, i * size, size), out.narrow(0, i * n, n)) for i in range(pieces)]

    # ---- one piece ----------------------------------------------------------------

    def _encode_piece(self, piece: torch.Tensor) -> torch.Tensor:
        if self.dtype is BaseDtype.INT8:
            q8 = quantize_int8(piece.float())
            return torch.cat([_bytes(q8.codes), _bytes(q8.scales)])
        q4 = quantize_nf4(piece.float(), double_quant=self.double_quant)
        if isinstance(q4.absmax, QuantizedAbsmax):
            dq = q4.absmax
            return torch.cat([q4.codes, dq.codes, _bytes(dq.scales), _bytes(dq.offset.reshape(1))])
        return torch.cat([q4.codes, _bytes(q4.absmax)])

    def _decode_native(self, native: NativeDequant, piece: torch.Tensor, *, out: torch.Tensor) -> bool:
        """The piece decoded natively; False where it is the torch path's: a layout the kernels do not
        take, a bad stored scale (the torch path raises), a double-quantized absmax rebuilt out of range."""
        if not native.supports(piece, out):
            return False
        if self.dtype is BaseDtype.INT8:
            return native.int8(piece, out=out, threads=_NATIVE_THREADS)
        if out.numel() % 2:
            return False
        return native.nf4(
            piece, out=out, double_quant=self.double_quant, code=_NF4_VALUES, dynamic=_DYNAMIC_VALUES, threads=_NATIVE_THREADS
        )

    def _decode_piece(self, piece: torch.Tensor, *, out: torch.Tensor, what: str) -> None:
        n = out.numel()
        if self.dtype is BaseDtype.INT8:
            scales = _floats(piece[n:])
            _check_scales(scales, what=what, name="scale")
            _int8_into(piece[:n].view(torch.int8), scales, out=out)
            return
        half, blocks = n // 2, _blocks(n, NF4_BLOCK)
        codes = piece[:half]
        if not self.double_quant:
            absmax = _floats(piece[half:])
            _check_scales(absmax, what=what, name="absmax")
        else:
            floats = _floats(piece[half + blocks :])
            scales, offset = floats[:-1], floats[-1]
            _check_scales(scales, what=what, name="absmax scale")
            _check_scales(offset.abs().reshape(1), what=what, name="absmax offset")
            dq = QuantizedAbsmax(codes=piece[half : half + blocks], scales=scales, offset=offset.clone(), block=ABSMAX_BLOCK)
            absmax = dq.dequantize()
        _nf4_into(codes, absmax, out=out)


def _chunk(out: torch.Tensor) -> int:
    """Elements decoded at a time: `CHUNK` on the host, where a chunk's temporaries stay in a core's cache."""
    return min(CHUNK if out.device.type == "cpu" else _DEVICE_CHUNK, out.numel())


def _nf4_into(codes: torch.Tensor, absmax: torch.Tensor, *, out: torch.Tensor) -> None:
    """`dequantize_nf4`'s values, bit for bit, written into `out` (the compute dtype) a chunk at a time.

    Three passes over a chunk, all in cache: the packed bytes widened to lookup indices, one lookup a
    byte in `_PAIR_WORDS` (both of its fp32 code values), and one broadcast multiply by each 64-element
    block's absmax whose fp32 product is rounded once, straight into `out`: the same two roundings as
    `dequantize_nf4`, with no fp32 copy of the unit. A piece that is not whole blocks goes the slow way.
    """
    n = out.numel()
    if n % NF4_BLOCK:
        shape = torch.Size([n])
        out.copy_(dequantize_nf4(NF4Tensor(codes=codes, absmax=absmax, shape=shape, dtype=out.dtype)))
        return
    step = max(NF4_BLOCK, _chunk(out))
    table = _PAIR_WORDS.to(codes.device)
    index = codes.new_empty(step // 2, dtype=torch.int32)
    words = codes.new_empty(step // 2, dtype=torch.int64)
    # The chunks' views made in three calls, not six slicings a chunk: Python's share of a chunk's time.
    blocks = step // NF4_BLOCK
    for piece, scales, into in zip(codes.split(step // 2), absmax[:, None].split(blocks), out.view(-1, NF4_BLOCK).split(blocks)):
        i, w = index[: piece.numel()], words[: piece.numel()]
        i.copy_(piece)
        torch.index_select(table, 0, i, out=w)
        torch.mul(w.view(torch.float32).view(-1, NF4_BLOCK), scales, out=into)


def _int8_into(codes: torch.Tensor, scales: torch.Tensor, *, out: torch.Tensor) -> None:
    """`dequantize_int8`'s values, bit for bit, written into `out` a chunk at a time: one multiply of the
    int8 codes by their block's scale, in fp32 (exact for the codes), its product rounded once into `out`."""
    n = out.numel()
    if n % INT8_BLOCK:
        shape = torch.Size([n])
        out.copy_(dequantize_int8(Int8Tensor(codes=codes, scales=scales, shape=shape, dtype=out.dtype)))
        return
    blocks = max(1, _chunk(out) // INT8_BLOCK)
    chunks = zip(codes.view(-1, INT8_BLOCK).split(blocks), scales[:, None].split(blocks), out.view(-1, INT8_BLOCK).split(blocks))
    for block, scale, into in chunks:
        torch.mul(block, scale, out=into)


@dataclass(frozen=True, slots=True, kw_only=True)
class CodesInFlight:
    """A quantized unit's gathered codes, until they are dequantized into its gathered buffer."""

    codes: torch.Tensor
    owned: bool
    """Scratch gathered into, freed once decoded; False: the fetched shard itself (one rank), released by its owner."""
    decoding: SharedDecode | None = None
    """The decode started ahead on the decoder's thread (`share_natively`), which the stage finishes; None:
    decoded when needed."""


def _check_scales(scales: torch.Tensor, *, what: str, name: str) -> None:
    bad = ~(torch.isfinite(scales) & (scales >= 0))
    if bool(bad.any()):
        index = int(bad.nonzero()[0, 0])
        value = float(scales[index])
        raise ValueError(
            f"{what}: quantized base holds {name} {value!r} at block {index} ({int(bad.sum())} bad), which no "
            "quantizer writes (finite, >= 0): its stored bytes are corrupt; reload the weights or an earlier checkpoint"
        )


_PROBE_SIZES = (64 * 600, 64 * 300 + 38)
"""Elements of the pieces `_native_decoder` checks: whole blocks, and a short last block; both more than
256 blocks, so that a double-quantized absmax has two scales."""


@functools.cache
def _native_decoder(codec: BaseCodec, dtype: torch.dtype) -> NativeDequant | None:
    """The native kernels where they are built and decode `codec`'s pieces into `dtype` with the torch
    path's bits; else None (said once). Checked once a process and codec ([Note: a native decode])."""
    native = native_dequant()
    if native is None or not native.supports(torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=dtype)):
        return None
    gen = torch.Generator().manual_seed(20261207)
    for n in _PROBE_SIZES:
        # Magnitudes from fp16's subnormals to past its largest value, and an all-zero block.
        values = torch.randn(n, generator=gen) * torch.logspace(-9, 6, n)
        values[64:128] = 0
        piece = codec.encode(values, pieces=1)
        ours, theirs = torch.empty(n, dtype=dtype), torch.empty(n, dtype=dtype)
        codec._decode_piece(piece, out=theirs, what="probe")
        if not codec._decode_native(native, piece, out=ours) or not torch.equal(ours.view(torch.uint8), theirs.view(torch.uint8)):
            say_once(
                log,
                f"tierzero: the native {codec.name} decode (double_quant={codec.double_quant}) into {dtype} differs from "
                "the torch path's bits; the base is decoded by torch",
            )
            return None
    return native
