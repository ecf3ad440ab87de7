"""The placement planner's candidates: whole-kind placements, and units' slices moved into memory.

`whole_kind` lists every placement of whole kinds the stage allows; `fill` moves a placement's
slices on its lowest tier (NVMe, or host memory where it has none) up into the device's memory
and the host's, unit by unit and kind by kind, while the budgets have room, those that save most
disk time per byte first and, among those that save alike, spread over the step (`spread_order`);
those that save nothing only as far as the lowest tier's budget needs. So a split is built from
the budgets, from a placement that need not fit. The planner (placement/planner.py) replays and
ranks them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tierzero.common.sizes import format_size
from tierzero.common.slices import SliceKey, Tier, align_up
from tierzero.config import AUTO, Config
from tierzero.config.optim import per_unit
from tierzero.estimate.estimator import Bandwidth, Estimate
from tierzero.placement.prediction import Prediction
from tierzero.stages.plan import KIND_HOMES, Homes

__all__ = ["FIELDS", "MIN_STAGE", "Candidate", "fill", "spread_order", "whole_kind"]

#: The `Homes` fields and the offload keys that set them.
FIELDS = {"params": "params", "grads": "gradients", "optimizer": "optimizer"}
#: Lowest zero stage that may keep a field off the device (the optimizer's: any).
MIN_STAGE = {"params": 3, "grads": 2, "optimizer": 1}
#: Among slices that save no disk time, the order they move up in: parameters are copied up in
#: every forward and backward, optimizer states step where they live, gradients are handed over.
_NO_DISK_ORDER = {"params": 0, "optimizer": 1, "grads": 2}


@dataclass(slots=True, kw_only=True)
class Candidate:
    """A placement tried: its homes and label, then, once judged, its replay and prediction, or the
    bytes by which it is over each budget; `overrides`: the prefetcher's budgets it lowers."""

    homes: Homes
    label: str
    result: Estimate | None = None
    prediction: Prediction | None = None
    short: dict[Tier, int] = field(default_factory=dict)
    overrides: dict[str, int] = field(default_factory=dict)


def whole_kind(cfg: Config) -> list[Candidate]:
    """Every whole-kind placement of the auto kinds the stage and the config allow (nvme only with a path,
    and not for the optimizer states of a torch.optim class, which it keeps in memory), the ones that
    keep least in memory first: their replay gives the slice sizes that let the planner refuse a
    placement whose homes alone are over budget without replaying it."""
    choices: list[Iterable[Tier]] = []
    for what, key in FIELDS.items():
        configured = getattr(cfg.offload, key)
        if configured != AUTO:
            choices.append([configured])
            continue
        tiers = [Tier.DEVICE]
        if cfg.zero.stage >= MIN_STAGE[what]:
            tiers.insert(0, Tier.CPU)
            if cfg.tiers.nvme.path is not None and not (what == "optimizer" and per_unit(cfg.optimizer.type)):
                tiers.insert(0, Tier.NVME)
        choices.append(tiers)
    return [
        Candidate(
            homes=Homes(params=p, grads=g, optimizer=o), label=f"params {p.value}, grads {g.value}, optimizer {o.value}"
        )
        for p, g, o in itertools.product(*choices)
    ]


def fill(
    base: Candidate,
    rooms: dict[Tier, int],
    judge: Callable[[Candidate], Candidate],
    *,
    disk: Bandwidth | None,
    auto: set[str],
    over: int = 0,
) -> list[Candidate]:
    """`base` with the slices of the `auto` kinds (a kind the config places stays where it says) on
    its lowest tier (NVMe where it holds any, else host memory) moved up within `rooms` (the bytes
    each memory tier's budget has beyond what `base` needs), unit by unit and kind by kind, those
    whose disk time per byte (the replay's reads and writes of them at the disk's rates) is
    highest first, and among those alike in `spread_order`; each to the first tier of `rooms` with
    room for it: the device's first, where a unit's optimizer states step and its parameters
    compute without a copy. Slices that cost no disk time (gradients handed to a step in
    backward, any slice in host memory) move only until `over` bytes have: what the lowest tier
    is over its budget by in `base`. Shrunk by what `judge`'s replay finds over budget, up to
    three times."""
    assert base.result is not None and base.result.plan is not None
    groups, source = _groups(base.result, disk=disk, auto=auto)
    spread = spread_order(list(dict.fromkeys(unit for unit, _ in groups)))
    # Seconds per byte to 4 significant digits: slices of one kind then tie (their alignment
    # alone moves the last digits), and `spread` orders them.
    ranked = sorted(
        groups,
        key=lambda k: (-float(f"{groups[k][0] / groups[k][1]:.4g}"), _NO_DISK_ORDER[k[1]], spread[k[0]]),
    )
    above = (Tier.DEVICE, Tier.CPU) if source is Tier.NVME else (Tier.DEVICE,)
    rooms = {tier: room for tier, room in rooms.items() if room > 0 and tier in above}
    tried: list[Candidate] = []
    for _ in range(3):
        taken: dict[tuple[str, str], Tier] = {}
        used = dict.fromkeys(rooms, 0)
        for key in ranked:
            saves, size = groups[key][0], int(groups[key][1])
            if saves <= 0 and sum(used.values()) >= over:
                break
            tier = next((t for t in rooms if used[t] + size <= rooms[t]), None)
            if tier is not None:
                taken[key], used[tier] = tier, used[tier] + size
        if not taken:
            break
        homes = dataclasses.replace(base.homes, units=taken)
        candidate = judge(Candidate(homes=homes, label=f"{base.label}; {_moved_text(taken, used)}"))
        tried.append(candidate)
        if not candidate.short or sum(used.values()) < over:  # short of room: less would not fit either
            break
        for tier in rooms:
            if tier in candidate.short:
                rooms[tier] = used[tier] - candidate.short[tier] - used[tier] // 100
    return tried


def _groups(result: Estimate, *, disk: Bandwidth | None, auto: set[str]) -> tuple[dict[tuple[str, str], list[float]], Tier]:
    """The slices `fill` may move, by (unit, kind field): [disk seconds they cost, aligned bytes, with the
    states a torch.optim class keeps beside the unit's shard where they are on that tier]; and the tier
    they are on, the lowest that holds any."""
    assert result.plan is not None
    movable = [(unit, spec) for unit, specs in result.plan.specs.items() for spec in specs if KIND_HOMES[spec.kind] in auto]
    source = Tier.NVME if any(spec.home is Tier.NVME for _, spec in movable) else Tier.CPU
    groups: dict[tuple[str, str], list[float]] = {}
    for unit, spec in movable:
        if spec.home is source:
            read, written = result.nvme_by_slice.get(SliceKey(unit, spec.kind), (0, 0))
            group = groups.setdefault((unit, KIND_HOMES[spec.kind]), [0.0, 0.0])
            group[0] += 0.0 if disk is None else read / disk.read + written / disk.write
            group[1] += align_up(spec.nbytes)
    if "optimizer" in auto:
        for unit, held in result.optimizer_states.items():
            if held.tier is source and held.nbytes:  # a torch.optim class's states move with the unit's optimizer home
                groups.setdefault((unit, "optimizer"), [0.0, 0.0])[1] += held.nbytes
    return groups, source


def _moved_text(taken: dict[tuple[str, str], Tier], used: dict[Tier, int]) -> str:
    """E.g. '35 unit slices of optimizer in cpu (5.1 GiB)', a clause per tier that took some."""
    clauses = []
    for tier, nbytes in used.items():
        keys = [key for key, to in taken.items() if to is tier]
        if keys:
            moved = ", ".join(sorted({what for _, what in keys}))
            clauses.append(f"{len(keys)} unit slices of {moved} in {tier.value} ({format_size(nbytes)})")
    return "; ".join(clauses)


def spread_order(units: list[str]) -> dict[str, int]:
    """A rank for each of `units` (in the step's order) such that the first n of any count are spread
    evenly over the order: 0, 1/2, 1/4, 3/4, 1/8... of the way. Among slices that save as much disk
    time per byte, the planner moves them in this order, so the units whose states stay in memory
    come between those read from disk: the step pipeline reads the next ones while they compute,
    rather than the disk idling through a run of them at one end of the backward."""
    n = len(units)
    bits = max(1, (n - 1).bit_length())
    rank: dict[str, int] = {}
    for j in range(1 << bits if n else 0):
        position = int(f"{j:0{bits}b}"[::-1], 2) * n >> bits  # bit-reversed j, scaled to the units
        rank.setdefault(units[position], len(rank))
    return rank
