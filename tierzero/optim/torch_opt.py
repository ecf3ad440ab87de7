"""torch.optim classes as the engine's optimizer: `optimizer.type: torch:<module.Class>`, `lion`, `adafactor`.

[Note: a torch.optim class per unit]
The fused AdamW of flat.py keeps its states as store slices (EXP_AVG, EXP_AVG_SQ) that may
live on any tier. A torch.optim class keeps whatever state it likes, as tensors of its own,
so here its states live in memory, beside the shard they step (refused with the states on
NVMe, tierzero/config/schema.py). Each unit gets one instance on each rank, built at the
unit's first step over one `nn.Parameter` per piece of an original tensor in the rank's
shard: the tensor's own shape where the shard holds it whole (always at one rank), else the
flat piece. Each step the pieces become views of the fp32 master shard (`.data`) with views
of its gradient as `.grad`, each group's lr and weight decay are set as a schedule sets
them on param groups, and `step()` runs: the instance updates the master in place, as it
would update the model's parameters. Elementwise rules (Adam, RAdam, Lion, ...) give the
bits of the class on the whole model at any world size; rules over a whole tensor
(Adafactor's factored second moment and its RMS-relative step) give them wherever a shard
holds whole tensors, and treat a cut tensor's pieces as tensors of their own (1-D, so not
factored). The padding of a unit is not stepped: its parameters and gradients are zero.

A checkpoint keeps each instance's `state_dict()` in one file per rank (`state_dict` here,
keyed by unit): the states are the class's own, of any kind and shape, so they do not fit
the store's per-unit slices, and a per-rank file keeps them exactly (torch.save). They
resume at the same world size only, the pieces being the rank's.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tierzero.optim.base import FlatOptimizer, OptimizerSpec, OptimizerType, OptimSlice
from tierzero.units.slice_layout import ParamGroup
from tierzero.units.unit import Unit

__all__ = ["NAMED", "TORCH_PREFIX", "Lion", "TorchOptimizer", "make_torch_optimizer", "resolve_class", "unit_pieces"]

TORCH_PREFIX = "torch:"


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms", Algorithm 2).

    update = sign(beta1 * m + (1 - beta1) * g); p -= lr * (update + wd * p) (decoupled, as
    p * (1 - lr * wd) first); m = beta2 * m + (1 - beta2) * g. One state, `exp_avg`, zero at
    the start. torch 2.13 has no Lion of its own."""

    def __init__(
        self, params: Any, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0
    ) -> None:
        if not lr >= 0.0 or not all(0.0 <= b < 1.0 for b in betas) or len(betas) != 2 or not weight_decay >= 0.0:
            raise ValueError(f"Lion takes lr >= 0, two betas in [0, 1) and weight_decay >= 0, got {lr}, {betas}, {weight_decay}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                exp_avg = state["exp_avg"]
                update = exp_avg.mul(beta1).add_(p.grad, alpha=1 - beta1).sign_()
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-group["lr"])
                exp_avg.mul_(beta2).add_(p.grad, alpha=1 - beta2)
        return loss


NAMED: dict[str, type[torch.optim.Optimizer]] = {"lion": Lion, "adafactor": torch.optim.Adafactor}
"""`optimizer.type` names stepped through a torch.optim class: Lion here, Adafactor torch's own."""


def resolve_class(name: str) -> type[torch.optim.Optimizer]:
    """The class `optimizer.type` names (`lion`, `adafactor` or `torch:<module.Class>`), refused in one line."""
    if name.lower() in NAMED:
        return NAMED[name.lower()]
    path = name[len(TORCH_PREFIX) :]
    module_name, _, class_name = path.rpartition(".")
    fix = "give a torch.optim.Optimizer subclass as torch:<module.Class>, e.g. torch:torch.optim.RAdam"
    if not module_name or not class_name:
        raise ValueError(f"optimizer.type {name!r} names no class: {fix}")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"optimizer.type {name!r} cannot be imported ({type(exc).__name__}: {exc}): {fix}") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"optimizer.type {name!r} is {cls!r}, not a torch.optim.Optimizer subclass: {fix}")
    return cls


@dataclass(frozen=True, slots=True)
class _Piece:
    """One original tensor's part of a unit's shard: shard-relative [start, end), its group and shape."""

    start: int
    end: int
    group: int
    shape: tuple[int, ...]


def unit_pieces(unit: Unit, *, rank: int) -> list[_Piece]:
    """The parameters `rank`'s instance for `unit` steps: a piece per original tensor in its shard, of
    the tensor's own shape where the shard holds it whole, else flat (tierzero/optim/unit_states.py
    counts their states)."""
    start, end = unit.shard_range(rank)
    pieces = []
    for slot in unit.slots:
        a, b = max(slot.offset, start), min(slot.offset + slot.numel, end)
        if a < b:
            shape = tuple(slot.shape) if b - a == slot.numel else (b - a,)
            pieces.append(_Piece(a - start, b - start, slot.group, shape))
    return pieces


@dataclass(slots=True)
class _UnitInstance:
    """One unit's torch.optim instance and the parameters it steps, one per `_Piece`."""

    pieces: list[_Piece]
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer | None
    """None where this rank's shard of the unit is padding only."""


class TorchOptimizer(FlatOptimizer):
    """A torch.optim class, one instance per unit ([Note: a torch.optim class per unit])."""

    __slots__ = ("cls", "decays", "kwargs", "pending", "units")
    per_unit = True

    def __init__(
        self, spec: OptimizerSpec, groups: Sequence[ParamGroup] = (), *, cls: type[torch.optim.Optimizer],
        kwargs: Mapping[str, Any],
    ) -> None:  # fmt: skip
        super().__init__(spec, groups)
        self.cls = cls
        self.kwargs = dict(kwargs)
        self.decays = "weight_decay" in inspect.signature(cls.__init__).parameters
        """Whether the class takes a weight decay, which the engine's groups then set."""
        self.units: dict[str, _UnitInstance] = {}
        self.pending: dict[str, dict[str, Any]] = {}
        """State dicts loaded from a checkpoint for units not stepped since."""

    @property
    def state_kinds(self) -> tuple:
        return ()

    def for_unit(self, unit: Unit, *, rank: int, master: torch.Tensor) -> FlatOptimizer:
        instance = self.units.get(unit.name) or self._build(unit, rank=rank, master=master)
        return _UnitStep(self, instance, master)

    def _apply(self, s: OptimSlice, *, step: int, hypers: Sequence[ParamGroup]) -> None:
        raise ValueError(f"{self.cls.__name__} keeps states per unit: step it through for_unit(unit, ...)")

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Each unit's instance's `state_dict()`, by unit name (those loaded and not stepped since included)."""
        return self.pending | {name: u.optimizer.state_dict() for name, u in self.units.items() if u.optimizer is not None}

    def load_state_dict(self, states: Mapping[str, dict[str, Any]]) -> None:
        """Take `state_dict()`'s output: each unit's instance loads its own at the unit's next step."""
        self.units.clear()
        self.pending = dict(states)

    def _build(self, unit: Unit, *, rank: int, master: torch.Tensor) -> _UnitInstance:
        pieces = unit_pieces(unit, rank=rank)
        params = [torch.nn.Parameter(master.new_empty(0)) for _ in pieces]  # each step makes them views of its master
        by_group: dict[int, list[torch.nn.Parameter]] = {}
        for piece, param in zip(pieces, params, strict=True):
            by_group.setdefault(piece.group, []).append(param)
        param_groups = [{"params": ps, **self.hypers_of(self.groups[g])} for g, ps in sorted(by_group.items())]
        optimizer = self.cls(param_groups, **self.kwargs) if param_groups else None
        if optimizer is not None and unit.name in self.pending:
            optimizer.load_state_dict(self.pending.pop(unit.name))
        self.units[unit.name] = instance = _UnitInstance(pieces=pieces, params=params, optimizer=optimizer)
        return instance

    def hypers_of(self, group: ParamGroup) -> dict[str, float]:
        """A torch param group's lr and weight decay (where the class takes one) for the engine's `group`."""
        return {"lr": group.lr, "weight_decay": group.weight_decay} if self.decays else {"lr": group.lr}


class _UnitStep(FlatOptimizer):
    """Steps one unit's instance over the master shard it was handed (or one slot's range of it)."""

    __slots__ = ("instance", "master", "owner")

    def __init__(self, owner: TorchOptimizer, instance: _UnitInstance, master: torch.Tensor) -> None:
        super().__init__(owner.spec, owner.groups)
        self.owner, self.instance, self.master = owner, instance, master

    @property
    def state_kinds(self) -> tuple:
        return ()

    def _apply(self, s: OptimSlice, *, step: int, hypers: Sequence[ParamGroup]) -> None:
        if self.instance.optimizer is None or s.param.device.type == "meta":
            return  # padding only, or the estimate's dry run (shapes only: a class may read values, e.g. .item())
        # The slice is the master shard, or one slot's range of it (gradient pieces, stages/grads/pieces.py).
        offset = (s.param.data_ptr() - self.master.data_ptr()) // s.param.element_size()
        assert 0 <= offset and offset + s.param.numel() <= self.master.numel(), "a slice of another shard"
        inside = [
            (piece, param) for piece, param in zip(self.instance.pieces, self.instance.params, strict=True)
            if offset <= piece.start and piece.end <= offset + s.param.numel()
        ]  # fmt: skip
        for piece, param in inside:
            param.data = s.param[piece.start - offset : piece.end - offset].view(piece.shape)
            param.grad = s.grad[piece.start - offset : piece.end - offset].view(piece.shape)
        groups = sorted({piece.group for piece in self.instance.pieces})
        for torch_group, g in zip(self.instance.optimizer.param_groups, groups, strict=True):
            torch_group.update(self.owner.hypers_of(hypers[g]))
        try:
            self.instance.optimizer.step()
        finally:
            for _, param in inside:
                # Hold no view of this step's master or gradient: either may be scratch the store frees.
                param.grad = None
                param.data = param.data.new_empty(0)


def make_torch_optimizer(opt_cfg: Any, groups: Sequence[ParamGroup] = ()) -> TorchOptimizer:
    """The optimizer for `optimizer.type` lion, adafactor or torch:<class>, with `optimizer.kwargs`,
    its kwargs tried once on a stand-in parameter so that a bad one is refused before training."""
    cls = resolve_class(str(opt_cfg.type))
    kwargs = dict(getattr(opt_cfg, "kwargs", None) or {})
    owned = sorted(set(kwargs) & {"params", "lr", "weight_decay"})
    if owned:
        raise ValueError(
            f"optimizer.kwargs sets {', '.join(owned)}, which the engine passes itself: set optimizer.lr and "
            "optimizer.weight_decay instead (the parameters are the units' shards)"
        )
    try:
        cls([torch.nn.Parameter(torch.zeros(2, 2))], lr=float(opt_cfg.lr), **kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"optimizer.kwargs {kwargs} are refused by {cls.__name__}: {exc}".replace("\n", " ")) from None
    spec = OptimizerSpec(type=OptimizerType.TORCH, lr=float(opt_cfg.lr), weight_decay=float(opt_cfg.weight_decay))
    return TorchOptimizer(spec, groups, cls=cls, kwargs=kwargs)
