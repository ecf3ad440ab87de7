"""Adam over compact moments (int8 block-wise codes, or bf16) in one native pass a block (native/moments.cpp).

[Note: one pass over compact moments]
The torch path steps int8 moments a window at a time in about twenty passes over each element
(optim/windows.py, [Note: stepping in the cache]): two dequantizes, the fused kernel, two
quantizes, each a chain of short ops; per element the host step cost 6.9x fp32 moments' fused
kernel. `tz_adam_moments` does a block of `MOMENT_BLOCK` elements at a time, in registers and
a core's L1: the codes decoded, the gradient widened and scaled, the step (native/adam_math.h,
torch's fused arithmetic, lanes and tail), the new absmax and nearest codes, the bf16 cast. It
follows the torch path's arithmetic element for element, so the bits are the same; that is
checked, not assumed: the optimizer runs a probe through both before it uses this one
(`native_moments_checked` in optim/flat.py).

The caller hands in what it owns: the code tables (units/code_tables.py), and the slice's
ranges, each with its group and the element where torch's scalar tail starts
([Note: vector lanes and scalar tails] in units/slice_layout.py). int8 moments that come out inf or
NaN are left as they were and counted per window, for the caller to refuse with the torch
path's words. The slice is then not as the torch path leaves it (that path stops at the first
such window; this one steps every block): the run stops at that error either way.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierzero.native.adam import takes_host_step
from tierzero.native.build import library

__all__ = ["NativeMoments", "StoredMoment", "native_moments"]

_P, _I64, _INT, _F, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float, ctypes.c_double
_ARGTYPES = (
    [_P, _P, _INT, _F, _P, _I64, _INT, _I64] + [_P] * 8 + [_P, _I64, _P, _P, _I64, _INT] + [_D] * 4 + [_I64, _P, _INT]
)  # fmt: skip
_CODES, _CELLS = 256, 1 << 15


@dataclass(frozen=True, slots=True)
class StoredMoment:
    """One moment of a slice as stored: bf16 values, or int8 codes with their absmax and code tables."""

    stored: torch.Tensor
    """bf16, or uint8 codes: one an element."""
    absmax: torch.Tensor | None = None
    """int8: fp32, one per block."""
    values: torch.Tensor | None = None
    """int8: the code's 256 fp32 values."""
    offsets: torch.Tensor | None = None
    """int8: int32 per cell of a ratio's bits (units/code_tables.py, [Note: code tables])."""


class NativeMoments:
    """`tz_adam_moments` over torch tensors: one contiguous host slice a call."""

    __slots__ = ("_fn",)

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.tz_adam_moments
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = _I64

    supports = staticmethod(takes_host_step)

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: StoredMoment,
        exp_avg_sq: StoredMoment,
        *,
        ranges: torch.Tensor,
        lrs: Sequence[float],
        weight_decays: Sequence[float],
        step: int,
        betas: tuple[float, float],
        eps: float,
        adamw: bool,
        block: int,
        window: int,
        scale: float = 1.0,
        cast: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One step of `param` in place and of its moments, `block` elements at a time; `ranges` (int64,
        rows of start, end, vector_end, group, in order) says each element's group and path.

        None, or for int8 moments with inf or NaN values (left as they were): per `window` elements, the
        count of such exp_avg values and of exp_avg_sq's, as an int64 tensor of shape (windows, 2)."""
        n = param.numel()
        int8 = exp_avg.absmax is not None
        for t in (grad,) + (() if cast is None else (cast,)):
            if t.numel() != n:
                raise ValueError(f"native moments: a tensor of {t.numel()} elements beside a parameter of {n}")
        for moment in (exp_avg, exp_avg_sq):
            _check_moment(moment, n, int8=int8, block=block)
        _check_ranges(ranges, n, groups=len(lrs))
        if len(weight_decays) != len(lrs) or block < 1 or window < block or window % block:
            raise ValueError(f"native moments: {len(lrs)} lrs, {len(weight_decays)} weight decays, block {block}, window {window}")
        hypers = torch.tensor([list(lrs), list(weight_decays)], dtype=torch.float64)
        bad = torch.zeros((-(-n // window) if int8 else 0, 2), dtype=torch.int64)
        total = self._fn(
            param.data_ptr(), grad.data_ptr(), int(grad.dtype == torch.bfloat16), scale, _ptr(cast), n, int(int8), block,
            *_pointers(exp_avg), *_pointers(exp_avg_sq), ranges.data_ptr(), ranges.shape[0], hypers[0].data_ptr(),
            hypers[1].data_ptr(), len(lrs), int(adamw), betas[0], betas[1], eps, float(step), window, bad.data_ptr(),
            torch.get_num_threads(),
        )  # fmt: skip
        return bad if total else None


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _pointers(moment: StoredMoment) -> tuple[int | None, ...]:
    return tuple(_ptr(t) for t in (moment.stored, moment.absmax, moment.values, moment.offsets))


def _check_moment(moment: StoredMoment, n: int, *, int8: bool, block: int) -> None:
    want = {"stored": (torch.uint8 if int8 else torch.bfloat16, n)}
    if int8:
        want |= {"absmax": (torch.float32, -(-n // block)), "values": (torch.float32, _CODES), "offsets": (torch.int32, _CELLS)}
    for name in ("stored", "absmax", "values", "offsets"):
        t = getattr(moment, name)
        if name not in want:
            if t is not None:
                raise ValueError(f"native moments: a bf16 moment takes no {name}")
            continue
        dtype, numel = want[name]
        if t is None or t.dtype != dtype or t.numel() != numel or not t.is_contiguous() or t.device.type != "cpu":
            got = "None" if t is None else f"{t.dtype} of {t.numel()} on {t.device}"
            raise ValueError(f"native moments: {name} must be contiguous host {dtype} of {numel} elements, got {got}")


def _check_ranges(ranges: torch.Tensor, n: int, *, groups: int) -> None:
    """Ranges inside [0, n), in order, apart, each with a group that has hyper-parameters."""
    if ranges.dtype != torch.int64 or ranges.dim() != 2 or ranges.shape[1] != 4 or not ranges.is_contiguous():
        raise ValueError(f"native moments: ranges must be contiguous int64 rows of 4, got {ranges.dtype} {tuple(ranges.shape)}")
    if not ranges.numel():
        return
    start, end, vector_end, group = ranges.unbind(1)
    ordered = bool((start[1:] >= end[:-1]).all()) and bool((start <= end).all()) and int(start[0]) >= 0 and int(end[-1]) <= n
    inside = bool(((vector_end >= start) & (vector_end <= end) & (group >= 0) & (group < groups)).all())
    if not ordered or not inside:
        raise ValueError(f"native moments: ranges must lie in order inside [0, {n}) with groups below {groups}, got {ranges.tolist()}")


@functools.cache
def native_moments() -> NativeMoments | None:
    """The kernel where the library is built (its bits are the caller's to check); else None."""
    lib = library()
    return None if lib is None else NativeMoments(lib)
