"""Block-wise symmetric int8 / int4 quantisation of flat buffers (ZeRO++ qwZ and qgZ).

A flat buffer of ``numel`` elements is cut into blocks of ``block_size`` (the last one may
be partial). Each block keeps one fp32 scale, ``absmax / qmax`` (qmax 127 for int8, 7 for
int4); each element becomes ``round(x / scale)`` clamped to [-qmax, qmax] and comes back
as ``q * scale``, so its error is at most ``scale / 2`` (plus fp32 rounding, a few ulps of
the block's absmax). An all-zero block has scale 0 and comes back as exact zeros.
(A block whose absmax is below ~1e-36, so that its scale is an fp32 subnormal, loses the bound.)

[Note: quantised bytes]
Scales are fp32, as DeepSpeed keeps them per group: bf16 weights reach 3e38 and fp16
scales would overflow past 65504 (and flush small gradients' scales to zero), while a
fp32 scale holds any bf16 / fp16 / fp32 block. The bytes of a quantised buffer are exactly

    ceil(numel * bits / 8) + 4 * ceil(numel / block_size)

so int8 halves a bf16 buffer and quarters a fp32 one, plus 4 bytes per block. int4 packs
two values per byte over the whole flat buffer, the even-indexed element in the low nibble
(two's complement), so any block size works and an odd ``numel`` leaves the last high
nibble zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

QMAX = {8: 127, 4: 7}
SCALE_DTYPE = torch.float32
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_format(*, bits: int, block_size: int) -> None:
    if isinstance(bits, bool) or bits not in QMAX:
        raise ValueError(f"bits must be 8 (int8) or 4 (int4), got {bits!r}: pass bits=8 or bits=4")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be an int >= 1, got {block_size!r}: pass e.g. block_size=2048")


def _blocks(numel: int, block_size: int) -> int:
    return -(-numel // block_size)


def quantized_nbytes(numel: int, *, bits: int, block_size: int) -> int:
    """Exact bytes of ``numel`` elements quantised: payload ceil(numel * bits / 8) + 4 B per block."""
    _check_format(bits=bits, block_size=block_size)
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")
    return -(-numel * bits // 8) + SCALE_DTYPE.itemsize * _blocks(numel, block_size)


@dataclass(frozen=True, slots=True, kw_only=True)
class Quantized:
    """A flat buffer quantised block-wise: what an all-gather sends in place of the buffer."""

    data: torch.Tensor
    """uint8, 1-D: int8 values viewed as uint8 (bits 8), or two int4 values per byte (bits 4)."""
    scales: torch.Tensor
    """fp32, 1-D: one scale per block, ``absmax / qmax``; 0 for an all-zero block."""
    numel: int
    """Elements of the original buffer."""
    bits: int
    """8 or 4."""
    block_size: int
    """Elements per block; the last block may be shorter."""
    dtype: torch.dtype
    """The original buffer's dtype, which `dequantize` returns by default."""

    def __post_init__(self) -> None:
        _check_format(bits=self.bits, block_size=self.block_size)
        payload = -(-self.numel * self.bits // 8)
        blocks = _blocks(self.numel, self.block_size)
        if self.data.dtype != torch.uint8 or self.data.shape != (payload,):
            raise ValueError(
                f"data must be uint8 of shape ({payload},) for numel={self.numel}, bits={self.bits}, "
                f"got {self.data.dtype} of shape {tuple(self.data.shape)}"
            )
        if self.scales.dtype != SCALE_DTYPE or self.scales.shape != (blocks,):
            raise ValueError(
                f"scales must be {SCALE_DTYPE} of shape ({blocks},) for numel={self.numel}, "
                f"block_size={self.block_size}, got {self.scales.dtype} of shape {tuple(self.scales.shape)}"
            )

    @property
    def nbytes(self) -> int:
        """Bytes sent: payload plus scales, equal to `quantized_nbytes`."""
        return self.data.numel() * self.data.element_size() + self.scales.numel() * self.scales.element_size()


def quantize(x: torch.Tensor, *, bits: int = 8, block_size: int = 2048) -> Quantized:
    """Quantise ``x`` (fp32, bf16 or fp16, flattened in row-major order) block-wise, symmetric absmax.

    Runs in fp32 on ``x``'s device, all blocks at once (the tail block padded with zeros).
    """
    _check_format(bits=bits, block_size=block_size)
    if x.dtype not in INPUT_DTYPES:
        raise ValueError(
            f"quantize takes a float32, bfloat16 or float16 tensor, got {x.dtype}: cast it first, e.g. x.float()"
        )
    qmax = QMAX[bits]
    numel = x.numel()
    blocks = _blocks(numel, block_size)
    flat = x.detach().reshape(-1).to(torch.float32)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - numel)).view(blocks, block_size)
    scales = padded.abs().amax(dim=1) / qmax
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(padded / divisor[:, None]).clamp_(-qmax, qmax).to(torch.int8).view(-1)
    if q.numel() != numel:
        q = q[:numel].clone()  # the payload owns exactly its bytes, not the padded tail
    data = q.view(torch.uint8) if bits == 8 else _pack_int4(q)
    return Quantized(data=data, scales=scales, numel=numel, bits=bits, block_size=block_size, dtype=x.dtype)


def dequantize(q: Quantized, *, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``q`` back as a 1-D tensor of ``dtype`` (default ``q.dtype``), written into ``out`` when given.

    The values are computed in fp32 and rounded once to ``dtype``.
    """
    target = q.dtype if dtype is None else dtype
    if out is not None:
        if out.dtype != target or out.numel() != q.numel or not out.is_contiguous():
            raise ValueError(
                f"out must be a contiguous {target} tensor of {q.numel} elements, got {out.dtype} "
                f"of {out.numel()} elements (contiguous: {out.is_contiguous()}): pass a matching buffer"
            )
    values = q.data.view(torch.int8) if q.bits == 8 else _unpack_int4(q.data, numel=q.numel)
    blocks = q.scales.numel()
    padded = torch.nn.functional.pad(values.to(torch.float32), (0, blocks * q.block_size - q.numel))
    result = (padded.view(blocks, q.block_size) * q.scales[:, None]).view(-1)[: q.numel]
    if out is None:
        return result.to(target)
    return out.view(-1).copy_(result)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 values in [-7, 7] -> uint8, two per byte, even index in the low nibble."""
    nibbles = q.view(torch.uint8) & 0x0F
    if nibbles.numel() % 2:
        nibbles = torch.nn.functional.pad(nibbles, (0, 1))
    pairs = nibbles.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def _unpack_int4(data: torch.Tensor, *, numel: int) -> torch.Tensor:
    """uint8 bytes -> int8 values, the inverse of `_pack_int4`."""
    nibbles = torch.stack((data & 0x0F, data >> 4), dim=1).view(-1)[:numel].to(torch.int8)
    return torch.where(nibbles >= 8, nibbles - 16, nibbles)
