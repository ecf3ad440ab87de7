"""The flat optimizer's contract: hyper-parameters, one slice to step, and the base every optimizer here extends.

Kept apart from flat.py so that optimizers built on torch.optim classes (torch_opt.py) and the
fused ones (flat.py) share it without importing each other.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from tierzero.common.slices import Kind
from tierzero.optim.moments import MomentFormat, StateDtype
from tierzero.units.slice_layout import ParamGroup, SliceLayout
from tierzero.units.unit import Unit

__all__ = ["ConvertingSlots", "FlatOptimizer", "OptimSlice", "OptimizerSpec", "OptimizerType", "check_slice"]


class OptimizerType(enum.Enum):
    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"
    TORCH = "torch"
    """A torch.optim class, stepped unit by unit (torch_opt.py)."""


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
    state_dtype: StateDtype = StateDtype.FP32
    """How Adam's moments are stored ([Note: compact moments] in moments.py); SGD's momentum is fp32."""

    def __post_init__(self) -> None:
        if self.type is OptimizerType.SGD and self.state_dtype is not StateDtype.FP32:
            raise ValueError(
                f"optimizer.state_dtype {self.state_dtype.value} stores Adam's moments, and optimizer.type sgd keeps "
                "its momentum in fp32: set optimizer.state_dtype: fp32, or optimizer.type: adamw"
            )
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


@dataclass(frozen=True, slots=True)
class ConvertingSlots:
    """One unit's slice for `FlatOptimizer.step_converting_many`: its fp32 parameters, its slots as (offset,
    gradient, group), its states and the slice its new parameters are cast into (or None)."""

    param: torch.Tensor
    grads: Sequence[tuple[int, torch.Tensor, int]]
    states: Mapping[Kind, torch.Tensor]
    cast: torch.Tensor | None = None


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

    __slots__ = ("groups", "spec")

    def __init__(self, spec: OptimizerSpec, groups: Sequence[ParamGroup] = ()) -> None:
        self.spec = spec
        self.groups = tuple(groups) or (ParamGroup(lr=spec.lr, weight_decay=spec.weight_decay),)
        """Group 0 first: the optimizer's own lr and weight decay unless `groups` says otherwise."""

    def group_lrs(self, factor: float) -> tuple[float, ...]:
        """Each group's learning rate under a schedule's multiplier: base lr x factor, as `LambdaLR` computes it."""
        return tuple(group.lr * factor for group in self.groups)

    @property
    @abstractmethod
    def state_kinds(self) -> tuple[Kind, ...]:
        """The kinds of state this optimizer keeps per slice (none for plain SGD)."""

    @property
    def moments(self) -> MomentFormat:
        """How the states are stored: `spec.state_dtype`'s format."""
        return MomentFormat(self.spec.state_dtype)

    def new_states(self, numel: int, *, device: torch.device | str = "cpu") -> dict[Kind, torch.Tensor]:
        """Zeroed states for a slice of `numel` elements, as a fresh optimizer starts (stored as `moments` says)."""
        return {kind: self.moments.zeros(numel, signed=kind is Kind.EXP_AVG, device=device) for kind in self.state_kinds}

    def step(
        self,
        *,
        param: torch.Tensor,
        grad: torch.Tensor,
        states: Mapping[Kind, torch.Tensor],
        step: int,
        lr: float | Sequence[float],
        layout: SliceLayout | None = None,
    ) -> None:
        """Apply update number `step` (1 for the first) to one slice.

        `lr` is one learning rate for every element, with `spec.weight_decay`, or one rate
        per group of `self.groups` (each with its group's weight decay), the layout saying
        which tensor is in which group. `grad` may be overwritten: SGD with weight decay
        uses it as scratch (the engine zeroes gradients after a step anyway). Adam and
        AdamW leave it untouched.
        """
        one = OptimSlice(param=param, grad=grad, states=states, layout=layout)
        check_slice(one, self.state_kinds, self.moments)
        self._apply(one, step=step, hypers=self._hypers(step, lr, layout))

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
        """`step` of each (offset, gradient, group) of `grads` as a slice of its own, each fp32 gradient scaled
        in place by `scale` first: a unit's parameter slots, each gradient one of autograd's tensors ([Note:
        gradient pieces] in stages/grads/pieces.py)."""
        for part, grad, slot_states, layout in each_slot(grads, states):
            if scale != 1.0:
                grad.mul_(scale)
            self.step(param=param[part], grad=grad, states=slot_states, step=step, lr=lr, layout=layout)

    converts_gradients = False
    """Whether `step_converting` runs on the host: a gradient of any dtype, converted and scaled on the way in."""

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
        """`step` with `grad` (any float dtype, left as it is) copied to fp32 and multiplied by `scale`
        as its gradient: the same bits, without an fp32 copy of the whole gradient (optimizers with
        `converts_gradients`; see [Note: the converting step]). `cast`: a slice of the compute dtype
        that receives the new parameters, each chunk as soon as it is stepped."""
        raise NotImplementedError(f"{type(self).__name__} steps fp32 gradients only: pass one to `step`")

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
        """`step_converting` of each (offset, gradient, group) of `grads` as a slice of its own: a unit's
        parameter slots, each gradient one of autograd's tensors ([Note: gradient pieces] in stages/grads/pieces.py)."""
        for part, grad, slot_states, layout in each_slot(grads, states):
            self.step_converting(
                param=param[part], grad=grad, scale=scale, states=slot_states, step=step, lr=lr, layout=layout,
                cast=None if cast is None else cast[part],
            )  # fmt: skip

    def step_converting_many(self, many: Sequence[ConvertingSlots], *, scale: float, step: int, lr: Sequence[float]) -> None:
        """`step_converting_slots` of each unit's slice in `many`: a step's units at once, where an optimizer
        can step them in one pass (FlatAdam's native kernel); here one unit after the other."""
        for unit in many:
            self.step_converting_slots(
                param=unit.param, grads=unit.grads, scale=scale, states=unit.states, step=step, lr=lr, cast=unit.cast
            )  # fmt: skip

    def _hypers(self, step: int, lr: float | Sequence[float], layout: SliceLayout | None) -> list[ParamGroup]:
        if step < 1:
            raise ValueError(f"optimizer step numbers start at 1, got {step}: pass the 1-based count of updates")
        if isinstance(lr, (int, float)):
            if layout is not None and any(layout.tensor_groups):
                raise ValueError("the slice layout names parameter groups: pass one learning rate per group")
            return [ParamGroup(lr=float(lr), weight_decay=self.spec.weight_decay)]
        if len(lr) != len(self.groups):
            raise ValueError(f"the optimizer has {len(self.groups)} parameter groups, got {len(lr)} learning rates")
        return [ParamGroup(lr=float(rate), weight_decay=g.weight_decay) for rate, g in zip(lr, self.groups)]

    @abstractmethod
    def _apply(self, s: OptimSlice, *, step: int, hypers: Sequence[ParamGroup]) -> None:
        """Step a checked slice, each group of its tensors with its own (lr, weight decay)."""

    per_unit = False
    """Whether the states are the optimizer's own, per unit (torch_opt.py), not the store's slices: then
    `for_unit` gives what steps a unit."""

    def for_unit(self, unit: Unit, *, rank: int, master: torch.Tensor) -> FlatOptimizer:
        """What steps `unit`'s shard (`master`, this rank's fp32 slice): this optimizer itself, whose
        states are the store's; an optimizer keeping states per unit returns the unit's own."""
        return self


def each_slot(
    grads: Sequence[tuple[int, torch.Tensor, int]], states: Mapping[Kind, torch.Tensor]
) -> Iterator[tuple[slice, torch.Tensor, dict[Kind, torch.Tensor], SliceLayout]]:
    """For each (offset, gradient, group) of a unit's slots: its part of the unit's slice, its gradient, its
    part of each state, and its layout, one tensor of its own in its group."""
    for offset, grad, group in grads:
        part = slice(offset, offset + grad.numel())
        yield part, grad, {kind: state[part] for kind, state in states.items()}, SliceLayout.of([grad.numel()], groups=[group])


def check_slice(s: OptimSlice, kinds: tuple[Kind, ...], moments: MomentFormat) -> None:
    missing = [k.value for k in kinds if k not in s.states]
    if missing:
        raise ValueError(f"optimizer step needs states {[k.value for k in kinds]}, missing {missing}")
    numel = s.param.numel()
    tensors = {"param": s.param, "grad": s.grad}
    for kind in kinds:
        if moments.compact:
            moments.check(kind.value, s.states[kind], numel, s.param.device)
        else:
            tensors[kind.value] = s.states[kind]
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
