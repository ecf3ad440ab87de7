"""Adam and AdamW in one native pass over host memory, with the gradient's conversion, the clip's
scale and the compute copy's cast folded in.

[Note: native kernels, torch's bits]
On the host the step's elementwise work around torch's fused Adam was several passes over
memory: the gradient widened from bf16 into an fp32 buffer, multiplied by the clip coefficient,
read by the kernel, and the new parameters read again for their bf16 copy. `tz_adam`
(native/adam.cpp) reads each element once and writes it once. Its arithmetic is torch's fused
CPU kernel's, operation for operation, including where that kernel's build rounds once in a
fused multiply-add: in its SIMD lanes the first moment's lerp and `c2 * g * g + beta2 * v`;
in its scalar tail the lerp and `beta2 * v + c2 * g * g` ([Note: vector lanes and scalar
tails] in units/slice_layout.py says where the tail starts). A clipped gradient is multiplied
by its scale in fp32 first, as the `mul_` it replaces did. So a step gives the same bits with or
without the library, and `torch.optim.AdamW(fused=True)`'s.

That sameness is checked, not assumed: before the first use `native_adam()` steps a probe of
every variant (Adam and AdamW, fp32 and bf16 gradients, scaled or not, cast or not, lanes and
tail) through both kernels, and any bit apart turns the library off for the process, said once
in the log. Another torch build that contracts its kernel elsewhere then costs speed, never bits.
"""

from __future__ import annotations

import ctypes
import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierzero.common.safe_files import say_once
from tierzero.native.build import library

__all__ = ["AdamSlots", "NativeAdam", "native_adam", "takes_host_step"]

log = logging.getLogger(__name__)

_ARGTYPES = (
    [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    + [ctypes.c_int64, ctypes.c_int64, ctypes.c_int] + [ctypes.c_double] * 6 + [ctypes.c_int]
)  # fmt: skip


def takes_host_step(param: torch.Tensor, grad: torch.Tensor, *, beta1: float, cast: torch.Tensor | None = None) -> bool:
    """Whether the native Adam kernels take these tensors: host fp32 parameters, an fp32 or bf16 gradient,
    a bf16 cast, all contiguous, and a lerp weight `1 - beta1` under 0.5 (torch's other lerp form is not built)."""
    host = (param, grad) + (() if cast is None else (cast,))
    return (
        all(t.device.type == "cpu" and t.is_contiguous() for t in host) and param.dtype == torch.float32
        and grad.dtype in (torch.float32, torch.bfloat16) and (cast is None or cast.dtype == torch.bfloat16)
        and abs(1 - beta1) < 0.5
    )  # fmt: skip


_MANY_ARGTYPES = (
    [ctypes.c_void_p] * 5 + [ctypes.c_int64] + [ctypes.c_void_p] * 4 + [ctypes.c_int, ctypes.c_float, ctypes.c_int]
    + [ctypes.c_double] * 4 + [ctypes.c_int]
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class AdamSlots:
    """One parameter slice's slots for `NativeAdam.step_many`: slot i is `param[offsets[i]:offsets[i] + n]`
    (and the same range of the moments and the cast), n the elements of its own gradient `grads[i]`, stepped
    at learning rate `lrs[i]` and weight decay `weight_decays[i]`."""

    param: torch.Tensor
    grads: Sequence[torch.Tensor]
    offsets: Sequence[int]
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    lrs: Sequence[float]
    weight_decays: Sequence[float]
    cast: torch.Tensor | None = None


class NativeAdam:
    """`tz_adam` over torch tensors: one contiguous host slice a call, or many slices' slots in one (`step_many`)."""

    __slots__ = ("_fn", "_many_fn")

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._fn = lib.tz_adam
        self._fn.argtypes = _ARGTYPES
        self._fn.restype = None
        self._many_fn = lib.tz_adam_many
        self._many_fn.argtypes = _MANY_ARGTYPES
        self._many_fn.restype = None

    supports = staticmethod(takes_host_step)

    def step(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        step: int,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        eps: float,
        adamw: bool,
        lanes: int,
        scale: float = 1.0,
        cast: torch.Tensor | None = None,
    ) -> None:
        """One step of `param` in place, as torch's fused kernel steps it as one tensor of its list
        (vector lanes of width `lanes`, then the scalar tail); `cast` gets the new values in bf16."""
        n = param.numel()
        _check_beside(n, grad, exp_avg, exp_avg_sq, cast)
        self._fn(
            param.data_ptr(), grad.data_ptr(), int(grad.dtype == torch.bfloat16), scale, exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(), None if cast is None else cast.data_ptr(), n, n - n % lanes, int(adamw), lr,
            betas[0], betas[1], weight_decay, eps, float(step), torch.get_num_threads(),
        )  # fmt: skip

    def step_slots(
        self,
        param: torch.Tensor,
        grads: Sequence[torch.Tensor],
        offsets: Sequence[int],
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        *,
        step: int,
        lrs: Sequence[float],
        weight_decays: Sequence[float],
        betas: tuple[float, float],
        eps: float,
        adamw: bool,
        lanes: int,
        scale: float = 1.0,
        cast: torch.Tensor | None = None,
    ) -> None:
        """`step` of each slot `param[offsets[i]:offsets[i] + grads[i].numel()]` with its own gradient `grads[i]`,
        learning rate and weight decay, in one call: the bits of a `step` a slot, the threads started once."""
        slots = AdamSlots(param, grads, offsets, exp_avg, exp_avg_sq, lrs, weight_decays, cast)
        self.step_many([slots], step=step, betas=betas, eps=eps, adamw=adamw, lanes=lanes, scale=scale)

    def step_many(
        self,
        many: Sequence[AdamSlots],
        *,
        step: int,
        betas: tuple[float, float],
        eps: float,
        adamw: bool,
        lanes: int,
        scale: float = 1.0,
    ) -> None:
        """The slots of every slice of `many` in one call (a step's units at once): the bits of a `step` a
        slot, the threads started once. Every gradient is of one dtype."""
        params: list[int] = []
        moments: tuple[list[int], list[int]] = ([], [])
        casts: list[int | None] = []
        grads: list[torch.Tensor] = []
        lrs: list[float] = []
        decays: list[float] = []
        for slots in many:
            n = slots.param.numel()
            if not (len(slots.grads) == len(slots.offsets) == len(slots.lrs) == len(slots.weight_decays)):
                raise ValueError(
                    f"native Adam: {len(slots.grads)} gradients, {len(slots.offsets)} offsets, {len(slots.lrs)} rates, "
                    f"{len(slots.weight_decays)} decays"
                )  # fmt: skip
            _check_beside(n, None, slots.exp_avg, slots.exp_avg_sq, slots.cast)
            if not takes_host_step(slots.param, slots.param, beta1=betas[0], cast=slots.cast):
                raise ValueError("native Adam: a parameter must be contiguous host fp32, its cast contiguous host bf16")
            for offset, grad in zip(slots.offsets, slots.grads, strict=True):
                if offset < 0 or offset + grad.numel() > n:
                    raise ValueError(f"native Adam: a slot of {grad.numel()} elements at {offset} outside a parameter of {n}")
                params.append(slots.param.data_ptr() + 4 * offset)
                moments[0].append(slots.exp_avg.data_ptr() + 4 * offset)
                moments[1].append(slots.exp_avg_sq.data_ptr() + 4 * offset)
                casts.append(None if slots.cast is None else slots.cast.data_ptr() + 2 * offset)
            grads += slots.grads
            lrs += slots.lrs
            decays += slots.weight_decays
        dtypes = {grad.dtype for grad in grads}
        if len(dtypes) > 1:
            raise ValueError(f"native Adam: the slots' gradients must share one dtype, got {sorted(map(str, dtypes))}")
        count, numels = len(grads), [grad.numel() for grad in grads]
        pointers = ctypes.c_void_p * count
        self._many_fn(
            pointers(*params), pointers(*moments[0]), pointers(*moments[1]), pointers(*casts),
            pointers(*(grad.data_ptr() for grad in grads)), count, (ctypes.c_int64 * count)(*numels),
            (ctypes.c_int64 * count)(*(k - k % lanes for k in numels)), (ctypes.c_double * count)(*lrs),
            (ctypes.c_double * count)(*decays), int(torch.bfloat16 in dtypes), scale, int(adamw), betas[0], betas[1],
            eps, float(step), torch.get_num_threads(),
        )  # fmt: skip


def _check_beside(
    n: int, grad: torch.Tensor | None, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor, cast: torch.Tensor | None
) -> None:
    """Raise unless the tensors stepped beside a parameter of `n` elements have its size, the moments in host fp32."""
    for t in (exp_avg, exp_avg_sq) + tuple(t for t in (grad, cast) if t is not None):
        if t.numel() != n:
            raise ValueError(f"native Adam: a tensor of {t.numel()} elements beside a parameter of {n}")
    for t in (exp_avg, exp_avg_sq):
        if t.dtype != torch.float32 or not t.is_contiguous() or t.device.type != "cpu":
            raise ValueError(f"native Adam: moments must be contiguous host fp32, got {t.dtype} on {t.device}")


@functools.cache
def native_adam(lanes: int) -> NativeAdam | None:
    """The native kernel where it is built and gives torch's bits at vector width `lanes`; else None."""
    lib = library()
    if lib is None:
        return None
    native = NativeAdam(lib)
    for adamw, bf16, scale, cast in itertools.product((True, False), (False, True), (1.0, 0.37), (False, True)):
        if not _same_bits(native, lanes, adamw=adamw, bf16=bf16, scale=scale, cast=cast):
            say_once(
                log,
                "tierzero: the native Adam kernel's bits differ from this torch's fused kernel "
                f"(adamw={adamw}, bf16 gradient={bf16}, scale={scale}, cast={cast}); the step runs torch's kernel",
            )
            return None
    return native


def _same_bits(native: NativeAdam, lanes: int, *, adamw: bool, bf16: bool, scale: float, cast: bool) -> bool:
    """Three steps of a probe (whole vectors and a tail) through both kernels, compared bit for bit."""
    gen = torch.Generator().manual_seed(20261205)
    n = 64 * lanes + lanes - 1
    p, m = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2
    v = torch.rand(n, generator=gen) * 1e-4
    ours, theirs = [p.clone(), m.clone(), v.clone()], [p, m, v]
    hypers = {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-8}
    for step in (1, 2, 3):
        grad = torch.randn(n, generator=gen).to(torch.bfloat16 if bf16 else torch.float32)
        wide = grad.to(torch.float32, copy=True).mul_(scale)
        kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
        kernel(
            [theirs[0]], [wide], [theirs[1]], [theirs[2]], [], [torch.tensor(float(step))], beta1=0.9, beta2=0.999,
            amsgrad=False, maximize=False, **hypers,
        )  # fmt: skip
        out = torch.empty(n, dtype=torch.bfloat16) if cast else None
        native.step(
            ours[0], grad, ours[1], ours[2], step=step, betas=(0.9, 0.999), adamw=adamw, lanes=lanes, scale=scale,
            cast=out, **hypers,
        )  # fmt: skip
        if not all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ours, theirs, strict=True)):
            return False
        if out is not None and not torch.equal(out.view(torch.int16), theirs[0].to(torch.bfloat16).view(torch.int16)):
            return False
    return _same_slot_bits(native, lanes, adamw=adamw, bf16=bf16, scale=scale, cast=cast)


def _same_slot_bits(native: NativeAdam, lanes: int, *, adamw: bool, bf16: bool, scale: float, cast: bool) -> bool:
    """Two slots with tails of their own through `step_slots` and torch's kernel over the two tensors, bit for bit."""
    gen = torch.Generator().manual_seed(20261206)
    sizes = (3 * lanes + 1, 5 * lanes + lanes - 1)
    n = sum(sizes)
    p, m, v = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2, torch.rand(n, generator=gen) * 1e-4
    ours = [p.clone(), m.clone(), v.clone()]
    grads = [torch.randn(k, generator=gen).to(torch.bfloat16 if bf16 else torch.float32) for k in sizes]
    wide = [g.to(torch.float32, copy=True).mul_(scale) for g in grads]
    split = [t.split(sizes) for t in (p, m, v)]
    kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    kernel(
        list(split[0]), wide, list(split[1]), list(split[2]), [], [torch.tensor(2.0)] * 2, lr=1e-3, beta1=0.9,
        beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
    )  # fmt: skip
    out = torch.empty(n, dtype=torch.bfloat16) if cast else None
    native.step_slots(
        ours[0], grads, [0, sizes[0]], ours[1], ours[2], step=2, lrs=[1e-3] * 2, weight_decays=[0.1] * 2,
        betas=(0.9, 0.999), eps=1e-8, adamw=adamw, lanes=lanes, scale=scale, cast=out,
    )  # fmt: skip
    if not all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(ours, (p, m, v), strict=True)):
        return False
    return out is None or torch.equal(out.view(torch.int16), p.to(torch.bfloat16).view(torch.int16))
