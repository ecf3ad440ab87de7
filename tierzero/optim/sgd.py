"""SGD, with or without momentum, as a flat optimizer (re-exported by flat.py beside FlatAdam)."""

from __future__ import annotations

from collections.abc import Sequence

from tierzero.common.slices import Kind
from tierzero.optim.base import FlatOptimizer, OptimSlice
from tierzero.units.slice_layout import ParamGroup

__all__ = ["FlatSGD"]


class FlatSGD(FlatOptimizer):
    """SGD, optionally with momentum, in torch.optim.SGD's exact arithmetic."""

    __slots__ = ()

    @property
    def state_kinds(self) -> tuple[Kind, ...]:
        return (Kind.EXP_AVG,) if self.spec.momentum > 0 else ()

    def _apply(self, s: OptimSlice, *, step: int, hypers: Sequence[ParamGroup]) -> None:
        momentum = self.spec.momentum
        runs = [(0, s.param.numel(), 0)] if s.layout is None else s.layout.group_runs(s.param.numel())
        for a, b, group in runs:
            param, grad, lr, wd = s.param[a:b], s.grad[a:b], hypers[group].lr, hypers[group].weight_decay
            # torch rounds grad + wd * param once before using it; doing it in place in
            # `grad` gives the same bits without allocating a slice-sized temporary.
            d_p = grad.add_(param, alpha=wd) if wd != 0 else grad
            if momentum > 0:
                buf = s.states[Kind.EXP_AVG][a:b]
                # torch creates the buffer as a copy of the first gradient; the engine
                # hands in a zeroed slice, so step 1 overwrites it rather than decaying it.
                if step == 1:
                    buf.copy_(d_p)
                else:
                    buf.mul_(momentum).add_(d_p)
                d_p = buf
            param.add_(d_p, alpha=-lr)
