"""Optimizers that update one flat fp32 slice of a unit in place.

The engine keeps each unit's master parameters, gradients and optimizer states as
flat 1-D fp32 slices (possibly views into larger buffers) and steps them slice by
slice, wherever they live. The update rules here are torch.optim's, bit for bit:

- Adam / AdamW call torch's fused kernels (`torch._fused_adam_` / `torch._fused_adamw_`),
  the very kernels `torch.optim.Adam(fused=True)` / `AdamW(fused=True)` run, and on CPU
  the fastest update torch offers. See [Note: vector lanes and scalar tails] for how a
  flat slice reproduces the per-tensor bits.
- SGD replays torch.optim.SGD's default (for-loop) arithmetic with in-place tensor ops.
  torch's fused SGD kernel is not used: it is not what torch.optim.SGD runs by
  default, and its bits differ from the for-loop's.
"""

from __future__ import annotations

import enum
import functools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierzero.slices import Kind

# [Note: vector lanes and scalar tails]
# torch's CPU fused Adam runs each tensor of its list through SIMD vectors, except the
# last `numel % width` elements, which go through a scalar loop that the compiler
# contracts into FMAs: those elements round differently (measured: about a quarter of
# random inputs differ in the last bit). So torch.optim's bits depend on where each
# parameter tensor ends. Given the unit's tensor boundaries (`SliceLayout`), `FlatAdam`
# cuts a slice into views so that every element takes the path it takes under
# torch.optim: runs of whole vectors counted from a tensor's start run in place, each
# tensor's tail runs as a view of its own (shorter than a vector, so all scalar), and
# the few elements that a slice cut separates from their vector go through a
# vector-sized scratch buffer. Vector lanes are independent, so an element's position
# inside a vector does not change its bits. The width must be the kernel's own: a
# multiple would be wrong where a slice cut falls inside a tensor's last vectors.
# CUDA kernels treat every element alike and need none of this.


class OptimizerType(enum.Enum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"


@dataclass(kw_only=True, slots=True, frozen=True)
class OptimizerSpec:
    """Hyper-parameters of one optimizer, validated once."""

    type: OptimizerType
    lr: float
    """Default learning rate; `step` takes the current one (schedules live in the engine)."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2)."""
    eps: float = 1e-8
    """Adam's denominator epsilon."""
    weight_decay: float = 0.0
    """Decoupled for AdamW, added to the gradient (L2) for Adam and SGD, as in torch.optim."""
    momentum: float = 0.0
    """SGD momentum (dampening 0, no Nesterov); 0 keeps no state."""

    def __post_init__(self) -> None:
        if not self.lr >= 0.0:
            raise ValueError(f"optimizer.lr must be >= 0, got {self.lr}: set a non-negative learning rate")
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(
                f"optimizer.betas must be two numbers in [0, 1), got {self.betas!r}: use e.g. [0.9, 0.999]"
            )
        if not self.eps >= 0.0:
            raise ValueError(f"optimizer.eps must be >= 0, got {self.eps}: use e.g. 1e-8")
        if not self.weight_decay >= 0.0:
            raise ValueError(f"optimizer.weight_decay must be >= 0, got {self.weight_decay}: use 0 to turn it off")
        if not self.momentum >= 0.0:
            raise ValueError(f"optimizer.momentum must be >= 0, got {self.momentum}: use 0 to turn it off")


@dataclass(kw_only=True, slots=True, frozen=True)
class SliceLayout:
    """Where a slice sits in its unit, and where the unit's original tensors start.

    With it, Adam on the slice gives the bits torch.optim gives the original tensors
    (see [Note: vector lanes and scalar tails]); without it, the bits torch.optim gives
    one flat parameter.
    """

    offset: int
    """First element of the slice, counted in the unit's flat buffer."""
    tensor_offsets: tuple[int, ...]
    """Start of each original tensor in the flat buffer, then the end of the last one.
    Elements past the end (padding) count as one more tensor."""

    def __post_init__(self) -> None:
        offsets = self.tensor_offsets
        if self.offset < 0 or not offsets or any(b < a for a, b in zip(offsets, offsets[1:], strict=False)):
            raise ValueError(
                f"slice layout needs offset >= 0 and non-decreasing tensor offsets, "
                f"got offset {self.offset}, tensor_offsets {offsets}: build it with SliceLayout.of(numels, offset=...)"
            )

    @classmethod
    def of(cls, numels: Sequence[int], *, offset: int = 0) -> SliceLayout:
        """The layout of a unit flattened from tensors of `numels`, seen from a slice at `offset`."""
        bounds = [0]
        for n in numels:
            bounds.append(bounds[-1] + n)
        return cls(offset=offset, tensor_offsets=tuple(bounds))


@dataclass(slots=True)
class OptimSlice:
    """One slice to step: the fp32 master parameters, their gradient and the optimizer states."""

    param: torch.Tensor
    grad: torch.Tensor
    states: Mapping[Kind, torch.Tensor]
    layout: SliceLayout | None = None


class FlatOptimizer(ABC):
    """Steps flat fp32 slices in place; holds hyper-parameters only, never state.

    States are the caller's: `new_states` makes zeroed ones, the engine places them in
    whichever tier the config says and hands them back to `step`.
    """

    __slots__ = ("spec",)
    state_kinds: tuple[Kind, ...]

    def __init__(self, spec: OptimizerSpec) -> None:
        self.spec = spec

    def new_states(self, numel: int, *, device: torch.device | str = "cpu") -> dict[Kind, torch.Tensor]:
        """Zeroed fp32 states for a slice of `numel` elements, as a fresh optimizer starts."""
        return {kind: torch.zeros(numel, dtype=torch.float32, device=device) for kind in self.state_kinds}

    def step(
        self,
        *,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: Mapping[Kind, torch.Tensor],
        step: int,
        lr: float,
        layout: SliceLayout | None = None,
    ) -> None:
        """Apply update number `step` (1 for the first) with learning rate `lr` to one slice.

        `grad` may be overwritten: SGD with weight decay uses it as scratch (the engine
        zeroes gradients after a step anyway). Adam and AdamW leave it untouched.
        """
        if step < 1:
            raise ValueError(f"optimizer step numbers start at 1, got {step}: pass the 1-based count of updates")
        one = OptimSlice(param=param, grad=grad, states=states, layout=layout)
        _check_slice(one, self.state_kinds)
        self._apply([one], step=step, lr=float(lr))

    @abstractmethod
    def _apply(self, slices: Sequence[OptimSlice], *, step: int, lr: float) -> None:
        """Step checked slices: Adam launches one fused kernel over all of them."""


class FlatAdam(FlatOptimizer):
    """Adam or AdamW through torch's fused kernels."""

    __slots__ = ()
    state_kinds = (Kind.EXP_AVG, Kind.EXP_AVG_SQ)

    def _apply(self, slices: Sequence[OptimSlice], *, step: int, lr: float) -> None:
        lists: _AdamLists = ([], [], [], [])
        copies_back: list[tuple[torch.Tensor, torch.Tensor]] = []
        for s in slices:
            _add_adam_slice(s, lists, copies_back)
        # torch.optim keeps the step count as a float32 tensor beside the parameter and
        # the kernel derives the bias corrections from it; one 0-d tensor per device.
        steps: dict[torch.device, torch.Tensor] = {}
        for p in lists[0]:
            if p.device not in steps:
                steps[p.device] = torch.full((), float(step), dtype=torch.float32, device=p.device)
        kernel = torch._fused_adamw_ if self.spec.type is OptimizerType.ADAMW else torch._fused_adam_
        beta1, beta2 = self.spec.betas
        kernel(
            *lists,
            [],
            [steps[p.device] for p in lists[0]],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=self.spec.weight_decay,
            eps=self.spec.eps,
            amsgrad=False,
            maximize=False,
        )
        for dst, src in copies_back:
            dst.copy_(src)


#: The fused kernel's tensor lists: params, grads, exp_avgs, exp_avg_sqs.
_AdamLists = tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]


def _add_adam_slice(
    s: OptimSlice, lists: _AdamLists, copies_back: list[tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """Append the views of one slice to the kernel's lists ([Note: vector lanes and scalar tails])."""
    full = (s.param, s.grad, s.states[Kind.EXP_AVG], s.states[Kind.EXP_AVG_SQ])
    if s.layout is None or s.param.device.type != "cpu":
        for dst, t in zip(lists, full, strict=True):
            dst.append(t)
        return
    lanes = cpu_vector_width()
    direct, scratch = _adam_pieces(s.param.numel(), s.layout, lanes)
    for a, b in direct:
        for dst, t in zip(lists, full, strict=True):
            dst.append(t[a:b])
    for a, b in scratch:
        for i, (dst, t) in enumerate(zip(lists, full, strict=True)):
            buf = torch.zeros(lanes, dtype=t.dtype, device=t.device)
            buf[: b - a] = t[a:b]
            dst.append(buf)
            if i != 1:  # the gradient is only read
                copies_back.append((t[a:b], buf[: b - a]))


@functools.cache
def cpu_vector_width() -> int:
    """fp32 elements per vector in the fused CPU Adam kernel this process dispatches to.

    Measured, not read off `torch.backends.cpu.get_cpu_capability()`: on some AVX-512
    CPUs (seen on an AMD EPYC with torch 2.13) the kernel runs 8-wide vectors. One call
    steps 47 elements whose vector and scalar results differ; the scalar tail starts
    after the last whole vector, at 47 - 47 % width. tests/unit/test_optim.py checks the
    answer against the kernel with other inputs.
    """
    g = torch.Generator().manual_seed(20261201)
    n = 1024
    p, grad, m = (torch.randn(n, generator=g) for _ in range(3))
    v = torch.rand(n, generator=g)
    vector = _probe_adamw([p], [grad], [m], [v])
    # A list of one-element tensors: each is all tail, so every element takes the scalar path.
    scalar = _probe_adamw(*(list(t.split(1)) for t in (p, grad, m, v)))
    pick = (vector != scalar).any(0).nonzero().flatten()[:47]
    if len(pick) < 47:
        return 16 if torch.backends.cpu.get_cpu_capability() == "AVX512" else 8
    out = _probe_adamw([p[pick]], [grad[pick]], [m[pick]], [v[pick]])
    tail = int((out != scalar[:, pick]).any(0).nonzero().max()) + 1
    return next(width for width in (4, 8, 16, 32, 64) if 47 - 47 % width == tail)


def _probe_adamw(*lists: list[torch.Tensor]) -> torch.Tensor:
    """One fused AdamW call on copies of (params, grads, exp_avgs, exp_avg_sqs): the stepped
    params, exp_avgs and exp_avg_sqs, each list's tensors end to end, as three rows."""
    params, grads, avgs, sqs = ([t.clone() for t in ts] for ts in lists)
    steps = [torch.tensor(3.0) for _ in params]
    torch._fused_adamw_(
        params, grads, avgs, sqs, [], steps,
        lr=1e-2, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
    )  # fmt: skip
    return torch.stack([torch.cat(params), torch.cat(avgs), torch.cat(sqs)])


def _adam_pieces(
    numel: int, layout: SliceLayout, lanes: int
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Slice-relative ranges to step in place, and ranges to step in a lane-sized scratch.

    Every element lands where torch.optim's per-tensor call would put it: in a vector
    lane or in its tensor's scalar tail ([Note: vector lanes and scalar tails]).
    """
    lo, hi = layout.offset, layout.offset + numel
    bounds = sorted({min(lo, layout.tensor_offsets[0]), *layout.tensor_offsets, max(hi, layout.tensor_offsets[-1])})
    direct: list[tuple[int, int]] = []
    scratch: list[tuple[int, int]] = []

    def run_in_place(a: int, b: int) -> None:
        # A view whose length is a whole number of vectors may take more elements
        # behind it: they keep the path they would have had alone.
        if direct and direct[-1][1] == a and (direct[-1][1] - direct[-1][0]) % lanes == 0:
            direct[-1] = (direct[-1][0], b)
        else:
            direct.append((a, b))

    for start, end in zip(bounds, bounds[1:], strict=False):
        a, b = max(start, lo), min(end, hi)
        if a >= b:
            continue
        tail = end - (end - start) % lanes
        vector_end = min(b, tail)
        if vector_end > a:
            whole = a + (vector_end - a) // lanes * lanes
            if whole > a:
                run_in_place(a - lo, whole - lo)
            if vector_end > whole:
                scratch.append((whole - lo, vector_end - lo))
        if b > max(a, tail):
            run_in_place(max(a, tail) - lo, b - lo)
    return direct, scratch


class FlatSGD(FlatOptimizer):
    """SGD, optionally with momentum, in torch.optim.SGD's exact arithmetic."""

    __slots__ = ()

    @property
    def state_kinds(self) -> tuple[Kind, ...]:  # type: ignore[override]
        return (Kind.EXP_AVG,) if self.spec.momentum > 0 else ()

    def _apply(self, slices: Sequence[OptimSlice], *, step: int, lr: float) -> None:
        wd, momentum = self.spec.weight_decay, self.spec.momentum
        for s in slices:
            # torch rounds grad + wd * param once before using it; doing it in place in
            # `grad` gives the same bits without allocating a slice-sized temporary.
            d_p = s.grad.add_(s.param, alpha=wd) if wd != 0 else s.grad
            if momentum > 0:
                buf = s.states[Kind.EXP_AVG]
                # torch creates the buffer as a copy of the first gradient; the engine
                # hands in a zeroed slice, so step 1 overwrites it rather than decaying it.
                if step == 1:
                    buf.copy_(d_p)
                else:
                    buf.mul_(momentum).add_(d_p)
                d_p = buf
            s.param.add_(d_p, alpha=-lr)


def _check_slice(s: OptimSlice, kinds: tuple[Kind, ...]) -> None:
    tensors = {"param": s.param, "grad": s.grad} | {k.value: s.states[k] for k in kinds if k in s.states}
    missing = [k.value for k in kinds if k not in s.states]
    if missing:
        raise ValueError(f"optimizer step needs states {[k.value for k in kinds]}, missing {missing}")
    numel = s.param.numel()
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.dim() != 1 or not t.is_contiguous():
            raise ValueError(
                f"optimizer {name} slice must be a contiguous 1-D float32 tensor, "
                f"got dtype {t.dtype}, shape {tuple(t.shape)}: step the fp32 master slice"
            )
        if t.numel() != numel or t.device != s.param.device:
            raise ValueError(
                f"optimizer {name} slice has {t.numel()} elements on {t.device}, "
                f"param has {numel} on {s.param.device}: pass slices of the same range"
            )


def make_optimizer(opt_cfg: Any) -> FlatOptimizer:
    """The flat optimizer for `cfg.optimizer` (attributes .type .lr .betas .eps .weight_decay .momentum)."""
    try:
        kind = OptimizerType(str(opt_cfg.type).lower())
    except ValueError:
        choices = ", ".join(t.value for t in OptimizerType)
        raise ValueError(f"optimizer.type must be one of {choices}, got {opt_cfg.type!r}") from None
    spec = OptimizerSpec(
        type=kind,
        lr=float(opt_cfg.lr),
        betas=tuple(float(b) for b in opt_cfg.betas),  # type: ignore[arg-type]
        eps=float(opt_cfg.eps),
        weight_decay=float(opt_cfg.weight_decay),
        momentum=float(opt_cfg.momentum),
    )
    return FlatSGD(spec) if kind is OptimizerType.SGD else FlatAdam(spec)
