"""Optimizers that update one flat fp32 slice of a unit in place.

The engine keeps each unit's master parameters, gradients and optimizer states as
flat 1-D fp32 slices (possibly views into larger buffers) and steps them slice by
slice, wherever they live. The update rules here are torch.optim's, bit for bit:

- Adam / AdamW call torch's fused kernels (`torch._fused_adam_` / `torch._fused_adamw_`),
  the very kernels `torch.optim.Adam(fused=True)` / `AdamW(fused=True)` run, and on CPU
  the fastest update torch offers. See [Note: vector lanes and scalar tails] (slice_layout.py) for how a
  flat slice reproduces the per-tensor bits.
- SGD replays torch.optim.SGD's default (for-loop) arithmetic with in-place tensor ops.
  torch's fused SGD kernel is not used: it is not what torch.optim.SGD runs by
  default, and its bits differ from the for-loop's.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from tierzero.common.safe_files import say_once
from tierzero.common.slices import Kind
from tierzero.native.adam import AdamSlots, NativeAdam, native_adam
from tierzero.native.moments import NativeMoments, native_moments
from tierzero.optim.base import ConvertingSlots, FlatOptimizer, OptimizerSpec, OptimizerType, OptimSlice, check_slice, each_slot
from tierzero.optim.moments import MomentFormat, StateDtype
from tierzero.optim.sgd import FlatSGD
from tierzero.optim.torch_opt import NAMED, TORCH_PREFIX, make_torch_optimizer
from tierzero.optim.windows import native_ranges, step_native, step_windows
from tierzero.units.slice_layout import ParamGroup, Piece, SliceLayout, adam_pieces, cpu_vector_width

__all__ = [
    "FlatAdam", "FlatOptimizer", "FlatSGD", "OptimSlice", "OptimizerSpec", "OptimizerType", "SliceLayout", "make_optimizer",
    "native_moments_checked",
]  # fmt: skip

log = logging.getLogger(__name__)


class FlatAdam(FlatOptimizer):
    """Adam or AdamW through torch's fused kernels.

    [Note: the converting step]
    A bf16 gradient stepped on the host used to be copied whole into an fp32 scratch slice,
    scaled there in a second pass and read a third time by the kernel: two extra passes over
    four bytes an element, and a scratch slice as large as the unit's. `step_converting` copies
    and scales `STEP_CHUNK` elements at a time into one buffer and runs the kernel on that chunk
    while it is fresh: bench step-host's host share fell from 3.46-3.50x to 3.25-3.27x of a bare
    AdamW at 100M bf16 (docs/benchmarks-journal.md, session 28). The kernel is elementwise, each tensor of its list stepped
    on its own, so cutting a run of whole vectors at a multiple of the vector width from its
    start leaves every element in the lane or the scalar tail it had ([Note: vector lanes and
    scalar tails]): the same bits as the whole slice in one call. The `cast` each chunk is
    written into is the PARAM slice's home itself where it is host memory the units compute in
    (`Stage3.cast_slice`): no slice-sized buffer to fault in, no copy of it home after. Where the
    native kernel is built (native/adam.py) each in-place run is one call that does all of it in
    a pass, with the same bits; the chunks remain the path without it.
    """

    __slots__ = ()
    converts_gradients = True

    @property
    def state_kinds(self) -> tuple[Kind, ...]:
        return (Kind.EXP_AVG, Kind.EXP_AVG_SQ)

    def _apply(self, s: OptimSlice, *, step: int, hypers: Sequence[ParamGroup]) -> None:
        if self.moments.compact:
            self._step_compact(s, grad=s.grad, scale=1.0, step=step, hypers=hypers)
            return
        by_group: dict[int, _AdamLists] = {}
        copies_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        _add_adam_slice(s, by_group, copies_back)
        self._run(by_group, copies_back, step=step, hypers=hypers, device=s.param.device)

    def step_converting(
        self,
        *,
        param: torch.Tensor,
        grad: torch.Tensor,
        scale: float,
        states: Mapping[Kind, torch.Tensor],
        step: int,
        lr: float | Sequence[float],
        layout: SliceLayout | None = None,
        cast: torch.Tensor | None = None,
    ) -> None:
        hypers = self._hypers(step, lr, layout)
        if cast is not None and (cast.numel() != param.numel() or cast.device != param.device):
            raise ValueError(f"cast must be a slice of the param's size and device, got {tuple(cast.shape)} on {cast.device}")
        checked = OptimSlice(param=param, grad=param, states=states, layout=layout)
        check_slice(checked, self.state_kinds, self.moments)
        if grad.numel() != param.numel() or grad.device != param.device or not grad.is_floating_point():
            raise ValueError(
                f"a converted gradient must be a float slice of the param's size and device, "
                f"got {grad.dtype} {tuple(grad.shape)} on {grad.device}"
            )
        if self.moments.compact:
            self._step_compact(checked, grad=grad, scale=scale, step=step, hypers=hypers, cast=cast)
            return
        full = (param, grad, states[Kind.EXP_AVG], states[Kind.EXP_AVG_SQ])
        direct, scratch, lanes = _pieces(param, layout)
        native = _native_for([param], [grad], self.spec.betas[0], cast)
        if native is not None:
            # One pass a piece: the widening, the scale and the cast inside the kernel ([Note: native kernels, torch's bits]).
            # The kernel's own width even without a layout (`lanes` 1): torch's kernel has it on each chunk, tail and all.
            for a, b, group in direct:
                native.step(
                    param[a:b], grad[a:b], full[2][a:b], full[3][a:b], step=step, lr=hypers[group].lr,
                    betas=self.spec.betas, weight_decay=hypers[group].weight_decay, eps=self.spec.eps,
                    adamw=self.spec.type is OptimizerType.ADAMW, lanes=cpu_vector_width(), scale=scale,
                    cast=None if cast is None else cast[a:b],
                )  # fmt: skip
        elif direct:
            # The meta device of a dry run reads nothing: one call a run, no cache to keep.
            chunk = STEP_CHUNK if param.device.type != "meta" else max(param.numel(), 1)
            buffer = torch.empty(min(chunk, param.numel()), dtype=torch.float32, device=param.device)
            for a, b, group in direct:
                for lo in range(a, b, chunk):
                    hi = min(lo + chunk, b)
                    g = _converted(grad[lo:hi], buffer[: hi - lo], scale)
                    lists = ([full[0][lo:hi]], [g], [full[2][lo:hi]], [full[3][lo:hi]])
                    self._run({group: lists}, [], step=step, hypers=hypers, device=param.device)
                    if cast is not None:
                        cast[lo:hi].copy_(param[lo:hi])
        if scratch:
            by_group: dict[int, _AdamLists] = {}
            copies_back: list[tuple[torch.Tensor, torch.Tensor]] = []
            _add_scratch(full, scratch, lanes, by_group, copies_back, grad_scale=scale)
            self._run(by_group, copies_back, step=step, hypers=hypers, device=param.device)
            for a, b, _ in scratch if cast is not None else ():
                cast[a:b].copy_(param[a:b])

    def step_slots(
        self,
        *,
        param: torch.Tensor,
        grads: Sequence[tuple[int, torch.Tensor, int]],
        scale: float,
        states: Mapping[Kind, torch.Tensor],
        step: int,
        lr: Sequence[float],
    ) -> None:
        """Every slot in one fused call a parameter group, as torch.optim steps a group's tensors (on a GPU
        one launch where there were one a slot), after one `_foreach_mul_` for the scale: each tensor of
        the kernel's lists is stepped as alone, so the bits are a `step` a slot's."""
        if self.moments.compact:
            super().step_slots(param=param, grads=grads, scale=scale, states=states, step=step, lr=lr)
            return
        hypers = self._hypers(step, lr, None)
        check_slice(OptimSlice(param=param, grad=param, states=states), self.state_kinds, self.moments)
        tensors = [grad for _, grad, _ in grads]
        for grad in tensors:
            if grad.dtype != torch.float32 or grad.dim() != 1 or not grad.is_contiguous() or grad.device != param.device:
                raise ValueError(f"a slot's gradient must be a contiguous 1-D float32 tensor on {param.device}, got {grad.dtype} {tuple(grad.shape)} on {grad.device}")
        if scale != 1.0 and tensors:
            torch._foreach_mul_(tensors, scale)
        by_group: dict[int, _AdamLists] = {}
        copies_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for part, grad, slot_states, layout in each_slot(grads, states):
            _add_adam_slice(OptimSlice(param=param[part], grad=grad, states=slot_states, layout=layout), by_group, copies_back)
        self._run(by_group, copies_back, step=step, hypers=hypers, device=param.device)

    def step_converting_slots(
        self,
        *,
        param: torch.Tensor,
        grads: Sequence[tuple[int, torch.Tensor, int]],
        scale: float,
        states: Mapping[Kind, torch.Tensor],
        step: int,
        lr: Sequence[float],
        cast: torch.Tensor | None = None,
    ) -> None:
        """One unit's slots as `step_converting_many` steps them."""
        self.step_converting_many([ConvertingSlots(param, grads, states, cast)], scale=scale, step=step, lr=lr)

    def step_converting_many(self, many: Sequence[ConvertingSlots], *, scale: float, step: int, lr: Sequence[float]) -> None:
        """Where the native kernel takes every slot of every unit, one call steps them all (native/adam.py
        `step_many`), with the bits of a `step_converting` a slot and the threads started once."""
        grads = [grad for unit in many for _, grad, _ in unit.grads]
        native = None if self.moments.compact or not grads else _native_for([many[0].param], grads[:1], self.spec.betas[0], many[0].cast)
        if native is None or not all(g.dtype == grads[0].dtype and g.device.type == "cpu" and g.is_contiguous() for g in grads):
            for unit in many:
                super().step_converting_slots(
                    param=unit.param, grads=unit.grads, scale=scale, states=unit.states, step=step, lr=lr, cast=unit.cast
                )  # fmt: skip
            return
        hypers = self._hypers(step, lr, None)
        slots = []
        for unit in many:
            check_slice(OptimSlice(param=unit.param, grad=unit.param, states=unit.states), self.state_kinds, self.moments)
            if unit.cast is not None and (unit.cast.numel() != unit.param.numel() or unit.cast.device != unit.param.device):
                raise ValueError(f"cast must be a slice of the param's size and device, got {tuple(unit.cast.shape)} on {unit.cast.device}")
            groups = [group for _, _, group in unit.grads]
            slots.append(AdamSlots(
                unit.param, [grad for _, grad, _ in unit.grads], [offset for offset, _, _ in unit.grads], unit.states[Kind.EXP_AVG],
                unit.states[Kind.EXP_AVG_SQ], [hypers[g].lr for g in groups], [hypers[g].weight_decay for g in groups], unit.cast,
            ))  # fmt: skip
        native.step_many(
            slots, step=step, betas=self.spec.betas, eps=self.spec.eps, adamw=self.spec.type is OptimizerType.ADAMW,
            lanes=cpu_vector_width(), scale=scale,
        )  # fmt: skip

    def _step_compact(
        self, s: OptimSlice, *, grad: torch.Tensor, scale: float, step: int, hypers: Sequence[ParamGroup],
        cast: torch.Tensor | None = None,
    ) -> None:
        """Step over bf16 or int8 moments: one native pass where its kernel is built and checked, else a
        window at a time (optim/windows.py), the same kernel on the fp32 values the stored moments decode to."""
        if s.param.device.type == "meta":
            return  # the estimate's dry run: shapes only, nothing to quantize
        takes = NativeMoments.supports(s.param, grad, beta1=self.spec.betas[0], cast=cast)
        kernel = native_moments_checked() if takes else None
        self._step_moments(s, grad=grad, scale=scale, step=step, hypers=hypers, cast=cast, kernel=kernel)

    def _step_moments(
        self, s: OptimSlice, *, grad: torch.Tensor, scale: float, step: int, hypers: Sequence[ParamGroup],
        cast: torch.Tensor | None, kernel: NativeMoments | None,
    ) -> None:
        if kernel is not None:
            direct, scratch, _ = _pieces(s.param, s.layout)
            step_native(
                kernel, self.moments, param=s.param, grad=grad, scale=scale, states=s.states, hypers=hypers, step=step,
                ranges=native_ranges(direct, scratch, cpu_vector_width()), betas=self.spec.betas, eps=self.spec.eps,
                adamw=self.spec.type is OptimizerType.ADAMW, cast=cast,
            )  # fmt: skip
            return

        def step_window(full: tuple[torch.Tensor, ...], direct: list[Piece], scratch: list[Piece]) -> None:
            by_group: dict[int, _AdamLists] = {}
            copies_back: list[tuple[torch.Tensor, torch.Tensor]] = []
            _add_pieces(full, direct, scratch, lanes, by_group, copies_back)
            self._run(by_group, copies_back, step=step, hypers=hypers, device=s.param.device)

        direct, scratch, lanes = _pieces(s.param, s.layout)
        step_windows(
            self.moments, param=s.param, grad=grad, scale=scale, states=s.states, pieces=(direct, scratch, lanes),
            step_window=step_window, cast=cast,
        )  # fmt: skip

    def _run(
        self,
        by_group: dict[int, _AdamLists],
        copies_back: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        step: int,
        hypers: Sequence[ParamGroup],
        device: torch.device,
    ) -> None:
        # torch.optim keeps the step count as a float32 tensor beside the parameter and
        # the kernel derives the bias corrections from it.
        count = torch.full((), float(step), dtype=torch.float32, device=device)
        kernel = torch._fused_adamw_ if self.spec.type is OptimizerType.ADAMW else torch._fused_adam_
        beta1, beta2 = self.spec.betas
        # One kernel per group, as torch.optim runs one per param group.
        for group, lists in sorted(by_group.items()):
            native = _native_for(lists[0], lists[1], beta1)
            if native is not None:
                for p, g, m, v in zip(*lists, strict=True):
                    native.step(
                        p, g, m, v, step=step, lr=hypers[group].lr, betas=self.spec.betas,
                        weight_decay=hypers[group].weight_decay, eps=self.spec.eps,
                        adamw=self.spec.type is OptimizerType.ADAMW, lanes=cpu_vector_width(),
                    )  # fmt: skip
                continue
            kernel(
                *lists, [], [count] * len(lists[0]), lr=hypers[group].lr, beta1=beta1, beta2=beta2,
                weight_decay=hypers[group].weight_decay, eps=self.spec.eps, amsgrad=False, maximize=False,
            )  # fmt: skip
        for dst, src in copies_back:
            dst.copy_(src)


STEP_CHUNK = 1 << 22
"""Elements `step_converting` converts at a time (16 MiB of fp32): the fastest of 2^18 to 2^23 on
the session-28 host; smaller chunks pay the kernel's cost per call (its threads' start-up) more
often than they gain from the cache."""


def _native_for(
    params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], beta1: float, cast: torch.Tensor | None = None
) -> NativeAdam | None:
    """The native kernel where it is built and checked and takes every (param, grad) pair ([Note: native
    kernels, torch's bits] in native/adam.py); None: torch's kernel steps them."""
    takes = (NativeAdam.supports(p, g, beta1=beta1, cast=cast) for p, g in zip(params, grads, strict=True))
    if not params or not all(takes):
        return None
    return native_adam(cpu_vector_width())


@functools.cache
def native_moments_checked() -> NativeMoments | None:
    """The native kernel for compact moments where it is built and gives the window path's bits on a
    probe of every variant ([Note: one pass over compact moments] in native/moments.py); else None."""
    kernel = native_moments()
    if kernel is None:
        return None
    for dtype, adamw, (grad_dtype, scale, cast) in itertools.product((StateDtype.INT8, StateDtype.BF16), (True, False), _PROBES):
        if not _same_moment_bits(kernel, dtype, adamw=adamw, grad_dtype=grad_dtype, scale=scale, cast=cast):
            say_once(
                log,
                "tierzero: the native kernel for compact moments gives other bits than the torch path "
                f"(state_dtype {dtype.value}, adamw={adamw}, {grad_dtype} gradient, scale={scale}, cast={cast}); "
                "the step runs the torch path",
            )
            return None
    return kernel


_PROBES = ((torch.float32, 1.0, False), (torch.bfloat16, 0.37, True), (torch.float32, 2.5, True), (torch.bfloat16, 1.0, False))
"""(gradient dtype, clip scale, cast) of the probes."""
_PROBE_NUMELS = (37, 2100, 7, 1023, 4096, 255, 1)
"""The probe's tensors: tails of many lengths, tensors across blocks, a slice cut inside the first's vectors."""


def _same_moment_bits(kernel: NativeMoments, dtype: StateDtype, *, adamw: bool, grad_dtype: torch.dtype, scale: float, cast: bool) -> bool:
    """Three steps of a probe slice, two groups, a zero block and padding, through both paths, compared bit for bit."""
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW if adamw else OptimizerType.ADAM, lr=1e-3, state_dtype=dtype))
    layout = SliceLayout.of(_PROBE_NUMELS, offset=3, groups=(0, 1, 0, 1, 0, 1, 0))
    n = sum(_PROBE_NUMELS) - 3 + 21
    hypers = (ParamGroup(lr=1e-3, weight_decay=0.1), ParamGroup(lr=3e-3, weight_decay=0.0))
    gen = torch.Generator().manual_seed(20261206)
    start = torch.randn(n, generator=gen)
    runs = [(start.clone(), opt.new_states(n), torch.zeros(n, dtype=torch.bfloat16) if cast else None) for _ in range(2)]
    for step in (1, 2, 3):
        grad = (torch.randn(n, generator=gen) * 0.1).to(grad_dtype)
        grad[2048:4096] = 0  # a block whose moments stay zero: absmax 0
        for (param, states, out), use in zip(runs, (None, kernel), strict=True):
            s = OptimSlice(param=param, grad=grad, states=states, layout=layout)
            opt._step_moments(s, grad=grad, scale=scale, step=step, hypers=hypers, cast=out, kernel=use)
    (p0, s0, c0), (p1, s1, c1) = runs
    same = [torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in ((p0, p1), *((s0[k], s1[k]) for k in s0))]
    return all(same) and (c0 is None or torch.equal(c0.view(torch.int16), c1.view(torch.int16)))


def _converted(grad: torch.Tensor, out: torch.Tensor, scale: float) -> torch.Tensor:
    """`grad` in fp32 times `scale`, in `out`: the copy and the multiply the whole-slice path makes."""
    out.copy_(grad)
    if scale != 1.0:
        out.mul_(scale)
    return out


#: The fused kernel's tensor lists: params, grads, exp_avgs, exp_avg_sqs.
_AdamLists = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def _pieces(param: torch.Tensor, layout: SliceLayout | None) -> tuple[list[Piece], list[Piece], int]:
    """(runs stepped in place, runs stepped in lane-sized scratch, the vector width) of a slice."""
    if layout is None:
        return [(0, param.numel(), 0)], [], 1
    if param.device.type != "cpu":
        # Other kernels treat every element alike: one view per run of a group.
        return layout.group_runs(param.numel()), [], 1
    lanes = cpu_vector_width()
    direct, scratch = adam_pieces(param.numel(), layout, lanes)
    return direct, scratch, lanes


def _add_adam_slice(
    s: OptimSlice, by_group: dict[int, _AdamLists], copies_back: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Append the views of one slice to each group's kernel lists ([Note: vector lanes and scalar tails])."""
    full = (s.param, s.grad, s.states[Kind.EXP_AVG], s.states[Kind.EXP_AVG_SQ])
    _add_pieces(full, *_pieces(s.param, s.layout), by_group, copies_back)


def _add_pieces(
    full: tuple[torch.Tensor, ...],
    direct: Sequence[Piece],
    scratch: Sequence[Piece],
    lanes: int,
    by_group: dict[int, _AdamLists],
    copies_back: list[tuple[torch.Tensor, torch.Tensor]],
) -> None:
    """Views of the runs stepped in place, and lane-sized scratch for the others, appended to each group's lists."""
    for a, b, group in direct:
        for dst, t in zip(by_group.setdefault(group, ([], [], [], [])), full, strict=True):
            dst.append(t[a:b])
    _add_scratch(full, scratch, lanes, by_group, copies_back)


def _add_scratch(
    full: tuple[torch.Tensor, ...],
    scratch: Sequence[Piece],
    lanes: int,
    by_group: dict[int, _AdamLists],
    copies_back: list[tuple[torch.Tensor, torch.Tensor]],
    *,
    grad_scale: float = 1.0,
) -> None:
    """Each scratch run in a lane-sized buffer of its own, copied back after the kernel (the gradient,
    `full[1]`, only read: converted to fp32 and scaled by `grad_scale` on the way in)."""
    for a, b, group in scratch:
        for i, (dst, t) in enumerate(zip(by_group.setdefault(group, ([], [], [], [])), full, strict=True)):
            buf = torch.zeros(lanes, dtype=torch.float32, device=t.device)
            buf[: b - a] = t[a:b]
            dst.append(buf)
            if i != 1:
                copies_back.append((t[a:b], buf[: b - a]))
            elif grad_scale != 1.0:
                buf[: b - a].mul_(grad_scale)


def make_optimizer(opt_cfg: Any, groups: Sequence[ParamGroup] = ()) -> FlatOptimizer:
    """The flat optimizer for `cfg.optimizer` (attributes .type .lr .betas .eps .weight_decay .momentum, and
    .state_dtype, fp32 where absent), with parameter `groups` (default: one, the optimizer's own lr and weight decay)."""
    if str(opt_cfg.type).lower() in NAMED or str(opt_cfg.type).startswith(TORCH_PREFIX):
        return make_torch_optimizer(opt_cfg, groups)
    try:
        kind = OptimizerType(str(opt_cfg.type).lower())
    except ValueError:
        choices = ", ".join(t.value for t in OptimizerType if t is not OptimizerType.TORCH)
        raise ValueError(f"optimizer.type must be one of {choices}, got {opt_cfg.type!r}") from None
    spec = OptimizerSpec(
        type=kind,
        lr=float(opt_cfg.lr),
        betas=(float(opt_cfg.betas[0]), float(opt_cfg.betas[1])),
        eps=float(opt_cfg.eps),
        weight_decay=float(opt_cfg.weight_decay),
        momentum=float(opt_cfg.momentum),
        state_dtype=MomentFormat.of(getattr(opt_cfg, "state_dtype", "fp32")).dtype,
    )
    return FlatSGD(spec, groups) if kind is OptimizerType.SGD else FlatAdam(spec, groups)
