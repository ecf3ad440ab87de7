"""`engine.offload_states` / `engine.reload_states`: the device tier's model states moved to host memory and back.

[Note: offloaded states]
A training phase and a generation phase (or another engine) can share one device: between two
optimizer steps, `offload_states(kinds)` moves every slice of those kinds whose home is the
device tier (parameters: PARAM and hpZ's SECONDARY; gradients: GRAD; optimizer: MASTER and the
moments) to a home in the cpu tier (host memory, pinned where CUDA exists), and
`reload_states()` moves them back, bit for bit (`TieredStore.rehome`). Slices homed on cpu or
NVMe are where they belong already; what they had fetched to the device is given back. First
everything in flight lands (a step deferred into the next forward runs now, write-backs end,
the slices the prefetcher read ahead are released), and stages 1 and 2 give back the PARAM
slices they keep fetched between forwards (the home tensor itself, bound to the modules): the
modules are bound to empty tensors, and the next forward fetches the new home as the first did.

While states are offloaded, what needs them is refused in one line that says to call
`reload_states`: a backward, a step, a checkpoint need every kind; a forward without gradients
and `generate` only the parameters, so that a generation phase can run with the optimizer
states and gradients offloaded, as RLHF rollouts do. Not reloaded on their own: whoever
offloaded made room on the device for something else (another engine, a KV cache), and a
forward that quietly brought gigabytes back would take that room from under it, or fail there
with an out-of-memory error far from its cause.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.offload.base import TierCapacityError
from tierzero.stages import Stage3
from tierzero.stages.base import mark_state
from tierzero.stages.binding import bind
from tierzero.stages.plan import KIND_HOMES
from tierzero.store import TieredStore
from tierzero.units.unit import UnitState

__all__ = ["KINDS", "OffloadedStates", "offload_states", "reload_states", "require_ready"]

KINDS = ("params", "grads", "optimizer")
"""What `offload_states` moves, as DeepSpeed names them; each the kinds of slice `KIND_HOMES` gives it."""


@dataclass(frozen=True, slots=True)
class OffloadedStates:
    """The slices `offload_states` moved off the device tier, each with a home in the cpu tier until `reload_states`."""

    store: TieredStore
    kinds: tuple[str, ...]
    keys: tuple[SliceKey, ...]


def offload_states(engine: Any, kinds: Iterable[str] | None = None) -> OffloadedStates | None:
    """Move the device-homed slices of `kinds` (default all of `KINDS`) to the cpu tier ([Note: offloaded states]).

    Returns what moved, None when nothing did. Between optimizer steps only; on a cpu tier too
    small, what moved goes back and TierCapacityError says so.
    """
    chosen = _chosen(kinds)
    store = engine.store
    if not isinstance(store, TieredStore):
        raise ValueError(f"offload_states() needs an engine over a TieredStore, this one has a {type(store).__name__}")
    _settle(engine, params="params" in chosen)
    keys = [
        SliceKey(unit.name, spec.kind) for unit in engine.units for spec in engine.plan.of(unit)
        if spec.home is Tier.DEVICE and KIND_HOMES[spec.kind] in chosen
    ]  # fmt: skip
    _move(store, keys, to=Tier.CPU, back=Tier.DEVICE, fix="raise tiers.cpu.capacity, or offload fewer kinds of state")
    return OffloadedStates(store=store, kinds=chosen, keys=tuple(keys)) if keys else None


def reload_states(offloaded: OffloadedStates | None) -> None:
    """Move every slice `offloaded` holds back home to the device tier; returns what stays offloaded: nothing.

    On a device tier too full to take them all (another engine holds it), those already back go
    down again and TierCapacityError says so: the states stay offloaded, to reload later.
    """
    if offloaded is not None:
        fix = "free the device (close the other engine, or offload its states) and call engine.reload_states() again"
        _move(offloaded.store, list(offloaded.keys), to=Tier.DEVICE, back=Tier.CPU, fix=fix)


def require_ready(what: str, *, closed: bool, offloaded: OffloadedStates | None) -> None:
    """Refuse `what` (the engine's `_require_open` names it: "a forward", "step()"...) in one line, on an engine
    `closed`, or whose states it needs are `offloaded`: a forward without gradients and `generate` need the
    parameters only; the rest of training needs them all."""
    if closed:
        raise ValueError(f"{what} after engine.close(): its tiers and swap files are gone; build a new engine with tierzero.initialize")
    reads = what == "generate()" or (what == "a forward" and not torch.is_grad_enabled())
    away = [kind for kind in offloaded.kinds if kind == "params" or not reads] if offloaded is not None else []
    if away:
        raise ValueError(
            f"{what} while the engine's {', '.join(away)} states are offloaded (engine.offload_states): call engine.reload_states() first"
        )


def _chosen(kinds: Iterable[str] | None) -> tuple[str, ...]:
    if kinds is None:
        return KINDS
    chosen = (kinds,) if isinstance(kinds, str) else tuple(kinds)
    unknown = [kind for kind in chosen if kind not in KINDS]
    if unknown or not chosen:
        raise ValueError(f"offload_states kinds must be some of {', '.join(KINDS)}, got {list(chosen)}")
    return tuple(kind for kind in KINDS if kind in chosen)


def _settle(engine: Any, *, params: bool) -> None:
    """Land everything in flight and give back every fetched slice ([Note: offloaded states]); refused mid-step."""
    stage = engine.stage
    if isinstance(stage, Stage3):
        stage.settle_step()  # a step deferred into the next forward: its slices are written now
    busy = next((unit for unit in engine.units if unit.pending_uses or unit.has_grads), None)
    if busy is not None:
        why = "has a backward to come" if busy.pending_uses else "holds gradients not stepped yet"
        raise ValueError(f"offload_states() in the middle of a training step (unit {busy.name} {why}): call it after engine.step()")
    stage.finish()
    if engine.param_prefetch is not None:
        engine.param_prefetch.drop()
    if params and not stage.shards_params:
        empty = torch.empty(0, dtype=stage.param_dtype, device=stage.device)
        for unit in engine.units:
            if unit.state is UnitState.GATHERED:
                bind(unit, [empty] * len(unit.slots))
                unit.gathered = None
                engine.store.release(SliceKey(unit.name, Kind.PARAM))
                mark_state(unit, UnitState.SHARDED)


def _move(store: TieredStore, keys: list[SliceKey], *, to: Tier, back: Tier, fix: str) -> None:
    """Rehome every slice of `keys` from `back` to `to`, or none: on a full tier, those moved go `back`."""
    moved = 0
    try:
        for key in keys:
            store.rehome(key, to=to)
            moved += 1
    except TierCapacityError as exc:
        for key in reversed(keys[:moved]):
            store.rehome(key, to=back)
        what = f"{keys[moved]} ({moved} of {len(keys)} slices moved, and moved back)"
        raise TierCapacityError(exc.tier, need=exc.need, used=exc.used, capacity=exc.capacity, what=what, fix=fix) from exc
