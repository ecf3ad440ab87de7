"""A quantized frozen base's pieces dequantized in one native pass (native/dequant.cpp): the codes read
once, the compute dtype written once, no temporaries.

The caller (units/quantized_base.py) lays the pieces out, owns the code tables it passes in, and
checks once a process that these kernels give its torch path's bits before it uses them
([Note: native kernels, torch's bits] in native/adam.py).
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from tierzero.native.build import library

__all__ = ["NativeDequant", "SharedDecode", "native_dequant"]

_OUT_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_BLOCK = 64
"""Elements a scale (NF4's absmax, int8's scale), as dequant.cpp's `kBlock`."""
_ABSMAX_BLOCK = 256
"""Double-quantized absmax codes a scale, as dequant.cpp's `kAbsmaxBlock`."""
_CHUNK = 1 << 20
"""Elements a thread claims at a time in a shared decode: 2 MiB of bf16, a fifth of a millisecond on one
core of the dev VM, and a multiple of the kernels' 16384-element stride."""


class SharedDecode:
    """Pieces decoded by every thread that calls `help` or `finish`, a chunk at a time ([Note: a shared
    decode] in dequant.cpp). It holds the pieces, their outputs and the code tables until it is dropped."""

    __slots__ = ("_calls", "_keep", "_states")

    def __init__(self, calls: list[Callable[[int, int], int]], *, state_bytes: int, keep: tuple[torch.Tensor, ...]) -> None:
        self._calls, self._keep = calls, keep
        self._states = [ctypes.create_string_buffer(state_bytes) for _ in calls]

    def help(self) -> None:
        """Decode chunks until none is left to claim."""
        for call, state in zip(self._calls, self._states, strict=True):
            call(ctypes.addressof(state), 0)

    def finish(self) -> bool:
        """Decode chunks until none is left, then wait for the others' chunks: True where every piece was
        decoded natively; False where one is left to the caller's torch path (a bad stored scale)."""
        refused = [call(ctypes.addressof(state), 1) for call, state in zip(self._calls, self._states, strict=True)]
        return not any(refused)


class NativeDequant:
    """`tz_dequant_nf4` and `tz_dequant_int8` over torch tensors: one contiguous host piece a call."""

    __slots__ = ("_int8", "_int8_shared", "_nf4", "_nf4_shared", "_state_bytes")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._nf4, self._int8 = lib.tz_dequant_nf4, lib.tz_dequant_int8
        self._nf4_shared, self._int8_shared = lib.tz_dequant_nf4_shared, lib.tz_dequant_int8_shared
        self._nf4.argtypes = [_P, _I64, _INT, _P, _P, _P, _INT, _INT]
        self._int8.argtypes = [_P, _I64, _P, _INT, _INT]
        self._nf4_shared.argtypes = [_P, _P, _I64, _INT, _P, _P, _P, _INT, _I64, _INT]
        self._int8_shared.argtypes = [_P, _P, _I64, _P, _INT, _I64, _INT]
        self._nf4.restype = self._int8.restype = self._nf4_shared.restype = self._int8_shared.restype = _INT
        lib.tz_shared_state_bytes.restype = _I64
        self._state_bytes = int(lib.tz_shared_state_bytes())

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
        _expect(piece, _nf4_bytes(n, double_quant), n=n, what="nf4")
        assert n % 2 == 0 and code.numel() == 16 and dynamic.numel() == 256
        assert code.dtype == dynamic.dtype == torch.float32 and code.is_contiguous() and dynamic.is_contiguous()
        kind = _OUT_KINDS[out.dtype]
        return not self._nf4(piece.data_ptr(), n, int(double_quant), code.data_ptr(), dynamic.data_ptr(), out.data_ptr(), kind, threads)

    def int8(self, piece: torch.Tensor, *, out: torch.Tensor, threads: int = 1) -> bool:
        """The int8 piece's values into `out`; False, nothing written, when a stored scale is bad."""
        _expect(piece, _int8_bytes(out.numel()), n=out.numel(), what="int8")
        return not self._int8(piece.data_ptr(), out.numel(), out.data_ptr(), _OUT_KINDS[out.dtype], threads)

    def shared(
        self, pieces: list[tuple[torch.Tensor, torch.Tensor]], *, nf4: bool, double_quant: bool, code: torch.Tensor, dynamic: torch.Tensor
    ) -> SharedDecode:
        """The (piece, out) pairs' decode as `nf4` or `int8` makes it, shared by the threads that take
        part ([Note: a shared decode] in dequant.cpp). A chunk whose stored scales are bad is left
        unwritten and `finish` says False."""
        calls = []
        for piece, out in pieces:
            n, kind = out.numel(), _OUT_KINDS[out.dtype]
            if nf4:
                _expect(piece, _nf4_bytes(n, double_quant), n=n, what="nf4")
                assert n % 2 == 0
                args = (piece.data_ptr(), n, int(double_quant), code.data_ptr(), dynamic.data_ptr(), out.data_ptr(), kind, _CHUNK)
                calls.append(functools.partial(_shared_call, self._nf4_shared, args))
            else:
                _expect(piece, _int8_bytes(n), n=n, what="int8")
                calls.append(functools.partial(_shared_call, self._int8_shared, (piece.data_ptr(), n, out.data_ptr(), kind, _CHUNK)))
        keep = (code, dynamic, *(t for pair in pieces for t in pair))
        return SharedDecode(calls, state_bytes=self._state_bytes, keep=keep)


def _shared_call(kernel: Callable[..., int], args: tuple[int, ...], state: int, wait: int) -> int:
    return kernel(state, *args, wait)


def _nf4_bytes(n: int, double_quant: bool) -> int:
    """Bytes of an NF4 piece of `n` elements: the codes, then the absmax (fp32, or double-quantized)."""
    blocks = -(-n // _BLOCK)
    return n // 2 + (blocks + 4 * (-(-blocks // _ABSMAX_BLOCK) + 1) if double_quant else 4 * blocks)


def _int8_bytes(n: int) -> int:
    """Bytes of an int8 piece of `n` elements: the codes, then an fp32 scale a block."""
    return n + 4 * -(-n // _BLOCK)


def _expect(piece: torch.Tensor, nbytes: int, *, n: int, what: str) -> None:
    """The kernel reads `nbytes`: a piece of another size is the caller's bug, never read past."""
    if piece.numel() != nbytes:
        raise ValueError(f"native {what} dequantize: a piece of {piece.numel()} bytes for {n} elements, which need {nbytes}")


@functools.cache
def native_dequant() -> NativeDequant | None:
    """The kernels where the native library is built; None otherwise. Their bits are the caller's to check."""
    lib = library()
    return None if lib is None else NativeDequant(lib)
