"""Adam over compact moments (bf16, int8), a window of whole blocks at a time ([Note: compact moments]).

Each window of the slice has its moments decoded to fp32, is stepped by the same fused
kernel on the same fp32 values as fp32 moments would be, and is encoded back before the
next window is read: the temporaries are a few windows of fp32, never the slice's.

A window's edges are the moments' block boundaries, not the slice's vector boundaries, so
the pieces `adam_pieces` cut the slice into are cut again at each edge, keeping every
element on the path it had ([Note: vector lanes and scalar tails]): the whole vectors of
a piece inside the window run in place, the few elements an edge separates from the rest
of their vector run in a vector-sized scratch (the vector path: lanes are independent), and
a tensor's scalar tail stays a view shorter than a vector (the scalar path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from tierzero.common.slices import Kind
from tierzero.optim.moments import SIGNED, MomentFormat
from tierzero.units.slice_layout import Piece

__all__ = ["WINDOW", "WindowStep", "step_windows", "window_pieces"]

WINDOW = 1 << 22
"""Elements stepped per window: `STEP_CHUNK`'s, and a multiple of every block and vector width."""

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
    numel, window = param.numel(), WINDOW
    direct, scratch, lanes = pieces
    assert window % fmt.align == 0 and window % lanes == 0, (window, fmt.align, lanes)
    # One fp32 buffer per moment for every window: a fresh one a window would cost its page faults again.
    buffers = {kind: torch.empty(min(window, numel), dtype=torch.float32, device=param.device) for kind in SIGNED}
    for lo in range(0, numel, window):
        hi = min(lo + window, numel)
        g = grad[lo:hi]
        if g.dtype != torch.float32 or scale != 1.0:
            g = g.float() if scale == 1.0 else g.to(torch.float32, copy=True).mul_(scale)
        moments = {
            kind: fmt.decode(states[kind], numel=numel, lo=lo, hi=hi, signed=SIGNED[kind], out=buffers[kind][: hi - lo])
            for kind in SIGNED
        }
        inside, apart = window_pieces(direct, scratch, lanes, lo, hi)
        step_window((param[lo:hi], g, moments[Kind.EXP_AVG], moments[Kind.EXP_AVG_SQ]), inside, apart)
        for kind, values in moments.items():
            _encode(fmt, values, states[kind], numel=numel, lo=lo, kind=kind)
        if cast is not None:
            cast[lo:hi].copy_(param[lo:hi])


def _encode(fmt: MomentFormat, values: torch.Tensor, stored: torch.Tensor, *, numel: int, lo: int, kind: Kind) -> None:
    try:
        fmt.encode(values, stored, numel=numel, lo=lo, signed=SIGNED[kind])
    except ValueError as exc:
        if "finite" not in str(exc):
            raise
        bad = int((~torch.isfinite(values)).sum())
        raise ValueError(
            f"optimizer.state_dtype {fmt.dtype.value}: {bad} of the {kind.value} values of elements {lo}-{lo + values.numel()} "
            "are inf or NaN after the step and cannot be quantized: the gradient was not finite (set gradient_clipping, "
            "lower optimizer.lr, or train with optimizer.state_dtype: fp32 to see where it came from)"
        ) from None
