"""Adam over compact moments (bf16, int8), a window of whole blocks at a time ([Note: compact moments]).

Each window of the slice has its moments decoded to fp32, is stepped by the same fused
kernel on the same fp32 values as fp32 moments would be, and is encoded back before the
next window is read: the temporaries are a few windows of fp32, never the slice's.

[Note: stepping in the cache]
An int8 window costs about twenty passes over its elements (two dequantizes, the fused
kernel, two quantizes: tierzero/units/code_tables.py) against the one pass of fp32 moments.
On the host a window is `WINDOW` elements, 512 KiB of fp32 a buffer, so the passes after the
first read of the codes and the grad work on data a core's L2 (2 MiB on the dev VM) or the
nearest cache still holds, and every buffer (`MomentWindows`) is allocated once a slice and
reused window after window, never faulted in again. The window is the fastest of 2^14 to
2^22 on the dev VM, 4M elements (/tmp/q8b/windows_sweep.py): 2^17 26.6 ms at one thread,
2^16 29.9, 2^14 41.8 (smaller windows pay torch's ~1.5 us a call, about 60 calls a window,
more often), 2^20 32.6, 2^22 48.9 (larger ones spill the cache).

The windows run with one intra-op thread (`one_thread`, [Note: one core for a loop of short ops]
in common/threads.py), as a unit's base is decoded: each of a window's ops is
too short to gain from a second core (4M elements: 25.0 ms at two threads, 27.5 at one, on an
idle dev VM), and when that core is busy (the swapper's threads, other processes) every op
waits for it to join: 4M int8 moments took 178-594 ms at two threads against 31-35 at one
while a busy loop held the other core, bf16 moments 109 against 10 (/tmp/q8b/threads_under_load.py).
A 2B all-NVMe step with int8 moments (configs/oversized.yaml, the swapper's 8 threads beside it)
took 35-50 s at two threads, 22.6-26.5 at one (/tmp/q8b/pair2b.py).

A window's edges are the moments' block boundaries, not the slice's vector boundaries, so
the pieces `adam_pieces` cut the slice into are cut again at each edge, keeping every
element on the path it had ([Note: vector lanes and scalar tails]): the whole vectors of
a piece inside the window run in place, the few elements an edge separates from the rest
of their vector run in a vector-sized scratch (the vector path: lanes are independent), and
a tensor's scalar tail stays a view shorter than a vector (the scalar path).

Where the native kernel is built and gives these bits (`step_native`, [Note: one pass over
compact moments] in native/moments.py), a slice is one call instead, a block at a time: the
windows, their pieces and their passes remain the path without it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from tierzero.common.slices import Kind
from tierzero.common.threads import one_thread
from tierzero.native.moments import NativeMoments, StoredMoment
from tierzero.optim.moments import SIGNED, MomentFormat, MomentWindows, StateDtype
from tierzero.units.blockwise import dynamic_table
from tierzero.units.slice_layout import ParamGroup, Piece

__all__ = ["DEVICE_WINDOW", "WINDOW", "WindowStep", "native_ranges", "step_native", "step_windows", "window_pieces"]

WINDOW = 1 << 17
"""Elements stepped per window on the host: 64 blocks of int8 moments, whose passes (decode, the
kernel, encode) then stay in a core's cache ([Note: stepping in the cache]); a multiple of every
block and vector width."""
DEVICE_WINDOW = 1 << 22
"""Elements stepped per window elsewhere: `STEP_CHUNK`'s, few kernel launches a slice."""

#: Steps one window: (param, fp32 grad, exp_avg, exp_avg_sq) views of it, its in-place and scratch pieces.
WindowStep = Callable[[tuple[torch.Tensor, ...], list[Piece], list[Piece]], None]


def _ceil_to(x: int, start: int, lanes: int) -> int:
    return start + -(-(x - start) // lanes) * lanes


def _floor_to(x: int, start: int, lanes: int) -> int:
    return start + (x - start) // lanes * lanes


def window_pieces(
    direct: Sequence[Piece], scratch: Sequence[Piece], lanes: int, lo: int, hi: int
) -> tuple[list[Piece], list[Piece]]:
    """The pieces of the elements [lo, hi), window-relative, each on the path it has in the whole slice."""
    inside: list[Piece] = []
    apart: list[Piece] = []

    def add(out: list[Piece], a: int, b: int, group: int) -> None:
        if a < b:
            out.append((a - lo, b - lo, group))

    for a, b, group in direct:
        tail = a + (b - a) // lanes * lanes  # [a, tail) runs as whole vectors, [tail, b) as scalars
        s, e = max(a, lo), min(tail, hi)
        if s < e:
            first, last = _ceil_to(s, a, lanes), _floor_to(e, a, lanes)
            add(apart, s, min(first, e), group)
            add(inside, first, last, group)
            add(apart, max(first, last), e, group)
        add(inside, max(tail, lo), min(b, hi), group)
    for a, b, group in scratch:
        add(apart, max(a, lo), min(b, hi), group)
    return inside, apart


def step_windows(
    fmt: MomentFormat,
    *,
    param: torch.Tensor,
    grad: torch.Tensor,
    scale: float,
    states: Mapping[Kind, torch.Tensor],
    pieces: tuple[list[Piece], list[Piece], int],
    step_window: WindowStep,
    cast: torch.Tensor | None = None,
) -> None:
    """Step `param` window by window (`WINDOW` elements): `grad` (any float dtype) copied to fp32 and
    scaled, the moments decoded, `step_window` run, the moments encoded; `cast` receives each window's
    new parameters."""
    window = WINDOW if param.device.type == "cpu" else DEVICE_WINDOW
    with one_thread(param.device):
        numel = param.numel()
        direct, apart, lanes = pieces
        assert window % fmt.align == 0 and window % lanes == 0, (window, fmt.align, lanes)
        # Every buffer once a slice, reused window after window ([Note: stepping in the cache]).
        moments = fmt.windows(states, numel=numel, window=window, device=param.device)
        converts = grad.dtype != torch.float32 or scale != 1.0
        converted = torch.empty(min(window, numel) if converts else 0, dtype=torch.float32, device=param.device)
        for lo in range(0, numel, window):
            hi = min(lo + window, numel)
            g = _converted(grad[lo:hi], converted[: hi - lo], scale) if converts else grad[lo:hi]
            m, v = moments.decode(Kind.EXP_AVG, lo, hi), moments.decode(Kind.EXP_AVG_SQ, lo, hi)
            step_window((param[lo:hi], g, m, v), *window_pieces(direct, apart, lanes, lo, hi))
            for kind, values in ((Kind.EXP_AVG, m), (Kind.EXP_AVG_SQ, v)):
                _encode(moments, kind, values, lo=lo, fmt=fmt)
            if cast is not None:
                cast[lo:hi].copy_(param[lo:hi])


def _converted(grad: torch.Tensor, out: torch.Tensor, scale: float) -> torch.Tensor:
    """`grad` in fp32 times `scale`, in `out`: the bits of `grad.float() * scale`, rounded once each."""
    out.copy_(grad)
    return out.mul_(scale) if scale != 1.0 else out


def native_ranges(direct: Sequence[Piece], scratch: Sequence[Piece], lanes: int) -> torch.Tensor:
    """The native kernel's ranges (start, end, vector_end, group), in order: a run in place is in torch's
    lanes up to its last whole vector of `lanes` (its tail after), a scratch piece all in lanes."""
    rows = [(a, b, a + (b - a) // lanes * lanes, g) for a, b, g in direct] + [(a, b, b, g) for a, b, g in scratch]
    return torch.tensor(sorted(rows), dtype=torch.int64).reshape(-1, 4)


def step_native(
    kernel: NativeMoments,
    fmt: MomentFormat,
    *,
    param: torch.Tensor,
    grad: torch.Tensor,
    scale: float,
    states: Mapping[Kind, torch.Tensor],
    ranges: torch.Tensor,
    hypers: Sequence[ParamGroup],
    step: int,
    betas: tuple[float, float],
    eps: float,
    adamw: bool,
    cast: torch.Tensor | None = None,
) -> None:
    """`step_windows`' step and bits in one native call over the slice; inf or NaN int8 moments refused in its words."""
    numel, int8 = param.numel(), fmt.dtype is StateDtype.INT8
    moments = [_stored(fmt, states[kind], numel=numel, signed=SIGNED[kind]) if int8 else StoredMoment(states[kind]) for kind in SIGNED]
    bad = kernel.step(
        param, grad, *moments, ranges=ranges, lrs=[h.lr for h in hypers], weight_decays=[h.weight_decay for h in hypers],
        step=step, betas=betas, eps=eps, adamw=adamw, block=fmt.block, window=WINDOW, scale=scale, cast=cast,
    )  # fmt: skip
    if bad is not None:
        window, column = divmod(int(bad.view(-1).nonzero()[0]), 2)  # the first the torch path would meet
        lo = window * WINDOW
        raise _not_finite(fmt, list(SIGNED)[column], int(bad[window, column]), lo=lo, hi=min(lo + WINDOW, numel))


def _stored(fmt: MomentFormat, stored: torch.Tensor, *, numel: int, signed: bool) -> StoredMoment:
    absmax, codes = fmt.split(stored, numel)
    table = dynamic_table(signed=signed, device=stored.device)
    return StoredMoment(codes, absmax=absmax, values=table.values, offsets=table.offsets)


def _encode(moments: MomentWindows, kind: Kind, values: torch.Tensor, *, lo: int, fmt: MomentFormat) -> None:
    try:
        moments.encode(kind, values, lo)
    except ValueError as exc:
        if "finite" not in str(exc):
            raise
        raise _not_finite(fmt, kind, int((~torch.isfinite(values)).sum()), lo=lo, hi=lo + values.numel()) from None


def _not_finite(fmt: MomentFormat, kind: Kind, bad: int, *, lo: int, hi: int) -> ValueError:
    return ValueError(
        f"optimizer.state_dtype {fmt.dtype.value}: {bad} of the {kind.value} values of elements {lo}-{hi} "
        "are inf or NaN after the step and cannot be quantized: the gradient was not finite (set gradient_clipping, "
        "lower optimizer.lr, or train with optimizer.state_dtype: fp32 to see where it came from)"
    )
