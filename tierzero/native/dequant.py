"""A quantized frozen base's pieces dequantized in one native pass (native/dequant.cpp): the codes read
once, the compute dtype written once, no temporaries.

The caller (units/quantized_base.py) lays the pieces out, owns the code tables it passes in, and
checks once a process that these kernels give its torch path's bits before it uses them
([Note: native kernels, torch's bits] in native/adam.py).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from tierzero.native.build import library

__all__ = ["NativeDequant", "native_dequant"]

_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_BLOCK = 64
"""Elements a scale (NF4's absmax, int8's scale), as dequant.cpp's `kBlock`."""
_ABSMAX_BLOCK = 256
"""Double-quantized absmax codes a scale, as dequant.cpp's `kAbsmaxBlock`."""


class NativeDequant:
    """`tz_dequant_nf4` and `tz_dequant_int8` over torch tensors: one contiguous host piece a call."""

    __slots__ = ("_int8", "_nf4")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._nf4, self._int8 = lib.tz_dequant_nf4, lib.tz_dequant_int8
        self._nf4.argtypes = [_P, _I64, _INT, _P, _P, _P, _INT, _INT]
        self._int8.argtypes = [_P, _I64, _P, _INT, _INT]
        self._nf4.restype = self._int8.restype = _INT

    @staticmethod
    def supports(piece: torch.Tensor, out: torch.Tensor) -> bool:
        """Whether these kernels take a piece: uint8 bytes and an fp32, bf16 or fp16 output, contiguous, on the host."""
        return (
            piece.device.type == "cpu" and piece.dtype == torch.uint8 and piece.is_contiguous()
            and out.device.type == "cpu" and out.dtype in _OUT_KINDS and out.is_contiguous()
        )  # fmt: skip

    def nf4(
        self, piece: torch.Tensor, *, out: torch.Tensor, double_quant: bool, code: torch.Tensor, dynamic: torch.Tensor, threads: int = 1
    ) -> bool:
        """The NF4 piece's `out.numel()` values (an even count) into `out`. False where the piece is left to
        the caller's torch path: a stored scale not finite and >= 0 (nothing written), or a double-quantized
        absmax rebuilt out of fp32's range. `code`: NF4's 16 fp32 values; `dynamic`: the signed dynamic
        code's 256 (double quantization's absmax)."""
        n = out.numel()
        blocks = -(-n // _BLOCK)
        scales = blocks + 4 * (-(-blocks // _ABSMAX_BLOCK) + 1) if double_quant else 4 * blocks
        _expect(piece, n // 2 + scales, n=n, what="nf4")
        assert n % 2 == 0 and code.numel() == 16 and dynamic.numel() == 256
        assert code.dtype == dynamic.dtype == torch.float32 and code.is_contiguous() and dynamic.is_contiguous()
        kind = _OUT_KINDS[out.dtype]
        return not self._nf4(piece.data_ptr(), n, int(double_quant), code.data_ptr(), dynamic.data_ptr(), out.data_ptr(), kind, threads)

    def int8(self, piece: torch.Tensor, *, out: torch.Tensor, threads: int = 1) -> bool:
        """The int8 piece's values into `out`; False, nothing written, when a stored scale is bad."""
        _expect(piece, out.numel() + 4 * -(-out.numel() // _BLOCK), n=out.numel(), what="int8")
        return not self._int8(piece.data_ptr(), out.numel(), out.data_ptr(), _OUT_KINDS[out.dtype], threads)


def _expect(piece: torch.Tensor, nbytes: int, *, n: int, what: str) -> None:
    """The kernel reads `nbytes`: a piece of another size is the caller's bug, never read past."""
    if piece.numel() != nbytes:
        raise ValueError(f"native {what} dequantize: a piece of {piece.numel()} bytes for {n} elements, which need {nbytes}")


@functools.cache
def native_dequant() -> NativeDequant | None:
    """The kernels where the native library is built; None otherwise. Their bits are the caller's to check."""
    lib = library()
    return None if lib is None else NativeDequant(lib)
