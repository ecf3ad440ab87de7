"""The bytes of the states a torch.optim class keeps per unit (`optimizer.type` lion, adafactor, torch:<class>).

`tierzero estimate`, the placement planner and `engine.memory_report()` count them here, and only here.

[Note: counting a class's states]
A torch.optim class keeps its states as tensors of its own, in memory beside the shard it steps
([Note: a torch.optim class per unit] in torch_opt.py), not as store slices: the slice plan has
none of them. Their size is the class's, and its kwargs': two fp32 moments for Adam, AdamW,
RAdam, NAdam and Adamax (8 B an element, a third with amsgrad) and a 4-byte `step` tensor per
parameter; one moment for Lion and for SGD with momentum (4 B), none for plain SGD; Adafactor's
second moment factored into a row and a column for a tensor of two or more dimensions (the
product of its other dimensions times rows + columns, in fp32), full for a 1-D one and for a
piece a shard cuts (flat). Rather than a table of classes, which a keyword or a new class would
leave wrong, every class is counted alike: built with the run's kwargs on one probe parameter
per rank (number of dimensions) the pieces have, stepped once on the host, and each tensor of a
probe's state read against the probe's shape. The probe's dimensions are distinct primes (past
four, the leading ones are 2), so that a state's dimension names the one of the parameter's it
follows: a state shaped as the parameter, or holding as many elements, scales with the
parameter's elements; one that keeps some dimensions and has 1 in the others (Adafactor's row
and column) with those it keeps; one sized by dimensions (a square of one) with theirs; a 0-d
one (`step`) is constant. That is exact for every class whose states are shaped by the
parameter's dimensions, which covers torch.optim's, Lion and Adafactor (the tests compare the
count with the states of a real instance after a step). It is an estimate in two cases: a state
whose shape follows none of the parameter's dimensions is counted at its bytes per element of
the probe, times the piece's elements; and a state a class makes only after its first step is
not counted. Each rank's pieces differ where a shard cuts a tensor: the estimate counts rank 0's.
All of a unit's states count in the memory its step runs in, though on a GPU torch keeps Adam's
`step` on the host (unless capturable): 4 bytes a tensor in the wrong column.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tierzero.common.slices import Tier
from tierzero.optim.base import FlatOptimizer
from tierzero.optim.torch_opt import TorchOptimizer, unit_pieces
from tierzero.units.unit import Unit

__all__ = ["HeldStates", "StateRule", "held_states", "probe_shape", "states_by_tier", "unit_state_bytes"]

_PRIMES = (5, 7, 11, 13)
"""The probe's dimensions: the last ones of a parameter of any rank (those before the last four are 2)."""


def probe_shape(rank: int) -> tuple[int, ...]:
    """The probe parameter of `rank` dimensions: distinct primes, so that a size names its dimension."""
    return (2,) * max(0, rank - len(_PRIMES)) + _PRIMES[: min(rank, len(_PRIMES))]


def _follows(state: tuple[int, ...], param: tuple[int, ...]) -> tuple[int, ...] | None:
    """The parameter's dimensions whose sizes the state's element count is the product of (one twice for
    its square); None where its shape follows none of them."""
    if len(state) == len(param) and all(s in (p, 1) for s, p in zip(state, param, strict=True)):
        return tuple(d for d, (s, p) in enumerate(zip(state, param, strict=True)) if s == p)
    if math.prod(state) == math.prod(param):
        return tuple(range(len(param)))
    unique = {p: d for d, p in enumerate(param) if param.count(p) == 1}
    if all(s == 1 or s in unique for s in state):
        return tuple(unique[s] for s in state if s != 1)
    return None


@dataclass(frozen=True, slots=True)
class _StateTensor:
    """One tensor of a probe's state, as a parameter's shape sizes it."""

    itemsize: int
    follows: tuple[int, ...] | None
    """The parameter dimensions its elements are the product of; None: none fits (`per_element` counts it)."""
    per_element: float
    """Its bytes per element of the probe parameter."""

    def nbytes(self, shape: tuple[int, ...]) -> int:
        if self.follows is None:
            return math.ceil(self.per_element * math.prod(shape))
        return self.itemsize * math.prod(shape[d] for d in self.follows)


@dataclass(frozen=True, slots=True)
class StateRule:
    """The bytes a class's states take for a parameter of any shape of the ranks probed
    ([Note: counting a class's states])."""

    by_rank: Mapping[int, tuple[_StateTensor, ...]]

    def nbytes(self, shape: tuple[int, ...]) -> int:
        """Bytes of the states of one parameter (a piece) of `shape`."""
        return sum(tensor.nbytes(shape) for tensor in self.by_rank[len(shape)])

    @classmethod
    def probe(
        cls, optimizer_cls: type[torch.optim.Optimizer], *, ranks: Iterable[int], hypers: Mapping[str, float],
        kwargs: Mapping[str, Any],
    ) -> StateRule:  # fmt: skip
        """Build `optimizer_cls` with `hypers` (lr, weight decay) and `kwargs` on a probe parameter of each
        of `ranks`, with a gradient of no zero element, step it once on the host and read its states."""
        shapes = {rank: probe_shape(rank) for rank in sorted(set(ranks))}
        params = {rank: torch.nn.Parameter(torch.ones(shape)) for rank, shape in shapes.items()}
        for param in params.values():
            n = param.numel()
            param.grad = torch.arange(1, n + 1, dtype=torch.float32).div_(n).view(param.shape)
        try:
            instance = optimizer_cls([{"params": list(params.values()), **hypers}], **kwargs)
            instance.step()
        except Exception as exc:  # a class of the user's: any failure is its, said in one line
            raise ValueError(
                f"optimizer.type {optimizer_cls.__module__}.{optimizer_cls.__name__} failed one step on a probe "
                f"parameter, taken to count its states ({type(exc).__name__}: {exc}): pick a class whose step() "
                "needs no closure and takes dense fp32 gradients".replace("\n", " ")
            ) from None
        by_rank = {}
        for rank, param in params.items():
            state = [v for v in instance.state[param].values() if isinstance(v, torch.Tensor)]
            by_rank[rank] = tuple(
                _StateTensor(
                    itemsize=t.element_size(), follows=_follows(tuple(t.shape), shapes[rank]),
                    per_element=t.nbytes / param.numel(),
                )  # fmt: skip
                for t in state
            )
        return cls(by_rank=by_rank)


def unit_state_bytes(optimizer: FlatOptimizer, units: Iterable[Unit], *, rank: int) -> dict[str, int]:
    """Bytes of the states `optimizer` keeps beside each trained unit's shard on `rank`, by unit name, as
    its instance holds them after a step: a torch.optim class's, counted by `StateRule`. Empty for the
    engine's own optimizers, whose states are the store's slices (the slice plan counts them)."""
    if not isinstance(optimizer, TorchOptimizer):
        return {}
    shapes = {unit.name: [piece.shape for piece in unit_pieces(unit, rank=rank)] for unit in units if unit.trainable}
    ranks = {len(shape) for pieces in shapes.values() for shape in pieces}
    if not ranks:
        return dict.fromkeys(shapes, 0)
    hypers = optimizer.hypers_of(optimizer.groups[0])
    rule = StateRule.probe(optimizer.cls, ranks=ranks, hypers=hypers, kwargs=optimizer.kwargs)
    return {name: sum(rule.nbytes(shape) for shape in pieces) for name, pieces in shapes.items()}


class OptimizerHomes(Protocol):
    """Where each unit's optimizer states live: a `Homes` (tierzero/stages/plan.py)."""

    def tier(self, unit: str, what: str) -> Tier: ...


@dataclass(frozen=True, slots=True)
class HeldStates:
    """A unit's states as a torch.optim class keeps them: their bytes, and the memory they are in."""

    tier: Tier
    nbytes: int


def held_states(optimizer: FlatOptimizer, units: Iterable[Unit], *, rank: int, homes: OptimizerHomes) -> dict[str, HeldStates]:
    """`unit_state_bytes`, each in the memory of its unit's optimizer home (the device's, or the host's),
    where the unit's master steps and the instance makes its states. A home on NVMe is refused, as the
    config refuses `offload.optimizer: nvme` with these classes: nothing would hold their states there."""
    held = {}
    for name, nbytes in unit_state_bytes(optimizer, units, rank=rank).items():
        tier = homes.tier(name, "optimizer")
        if tier is Tier.NVME:
            assert isinstance(optimizer, TorchOptimizer)
            raise ValueError(
                f"offload.optimizer places {name}'s optimizer states on nvme, but {optimizer.cls.__name__} "
                "(optimizer.type lion, adafactor or torch:<class>) keeps them as torch tensors in memory: set "
                "offload.optimizer to cpu or device (or auto, which plans them there), or optimizer.type to adamw"
            )
        held[name] = HeldStates(tier=tier, nbytes=nbytes)
    return held


def states_by_tier(optimizer: FlatOptimizer, units: Iterable[Unit], *, rank: int, homes: OptimizerHomes) -> dict[str, int]:
    """`held_states` summed by tier name (`engine.memory_report()["optimizer_states"]`): empty for the
    engine's own optimizers."""
    totals: dict[str, int] = {}
    for held in held_states(optimizer, units, rank=rank, homes=homes).values():
        totals[held.tier.value] = totals.get(held.tier.value, 0) + held.nbytes
    return totals
