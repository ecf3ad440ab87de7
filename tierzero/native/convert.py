"""The gradients' landing in one native pass (native/convert.cpp), where no norm is summed as it goes.

`torch.add(g, 0.0, out=shard)` (a fresh landing: zeros plus the gradient, [Note: stale
gradients] in stages/grads/landing.py) is a single pass in torch too, but its bf16 loop runs
well below memory speed on the host: 27 ms of a 100M bf16 step on the 2-core dev VM. (A
landing that sums the norm as it writes is native/squares.py's.) This gives the same bits
([Note: native kernels, torch's bits] in native/adam.py), checked against torch on a probe
before the first use, and declines what it is not built for (other dtypes, strided views,
other devices): the caller then runs torch's op.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from tierzero.common.safe_files import say_once
from tierzero.native.build import library

__all__ = ["plus_zero_into"]

log = logging.getLogger(__name__)

_CALL = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]


def plus_zero_into(src: torch.Tensor, out: torch.Tensor) -> bool:
    """`out = src + 0.0` natively where it can (same dtype, bf16 or fp32, contiguous host tensors of
    one size); False: nothing done, the caller runs torch's `add`."""
    if src.dtype != out.dtype or src.dtype not in (torch.bfloat16, torch.float32) or not _takes(src, out):
        return False
    lib = _checked()
    if lib is None:
        return False
    fn = lib.tz_plus_zero_bf16 if src.dtype == torch.bfloat16 else lib.tz_plus_zero_f32
    fn(src.data_ptr(), out.data_ptr(), src.numel(), torch.get_num_threads())
    return True


def _takes(src: torch.Tensor, out: torch.Tensor) -> bool:
    return (
        src.device.type == "cpu" and out.device.type == "cpu" and src.numel() == out.numel()
        and src.is_contiguous() and out.is_contiguous()
    )  # fmt: skip


@functools.cache
def _checked() -> ctypes.CDLL | None:
    """The library, once its conversions gave torch's bits on a probe of every kind of value."""
    lib = library()
    if lib is None:
        return None
    for fn in (lib.tz_plus_zero_bf16, lib.tz_plus_zero_f32):
        fn.argtypes, fn.restype = _CALL, None
    words = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16)  # every bf16 value
    bf16 = words.view(torch.bfloat16)
    f32 = (torch.randint(-(1 << 31), (1 << 31) - 1, (1 << 16,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
           .to(torch.int32).view(torch.float32))  # fmt: skip
    f32[:4] = torch.tensor([-0.0, 0.0, float("inf"), float("nan")])
    checks = (
        (lib.tz_plus_zero_bf16, bf16, torch.empty_like(bf16), torch.add(bf16, 0.0)),
        (lib.tz_plus_zero_f32, f32, torch.empty_like(f32), torch.add(f32, 0.0)),
    )
    for fn, src, out, want in checks:
        fn(src.data_ptr(), out.data_ptr(), src.numel(), 1)
        if not torch.equal(out.view(torch.uint8), want.view(torch.uint8)):
            say_once(log, f"tierzero: the native {fn.__name__} differs from torch's bits; the landing runs torch's ops")
            return None
    return lib
