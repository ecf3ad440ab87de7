"""When no placement fits: the nearest one, what it lacks, and what would make one fit.

The fixes are never empty. The smallest budget increase of each tier that could take the state:
the bytes the lowest placement (every kind the planner chooses on its lowest tier) needs beyond
all the budgets together, and at least what that tier lacks for its own working set, plus a
unit's slices, the grain the planner moves them in; where all the budgets together would hold
it (the working sets of the splits tried are what do not fit), the nearest placement's
shortfalls. Then what shrinks the need rather than the machine: a smaller batch, activation
checkpointing, a stage that may move more off the device, more ranks to shard the state over.
`tierzero estimate` prints them under "DOES NOT FIT" and exits 1; `tierzero train` stops with
them in one line.
"""

from __future__ import annotations

from typing import Any

from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier, align_up
from tierzero.config import Config
from tierzero.placement.candidates import Candidate

__all__ = ["PlacementError", "refusal", "shortfall_text"]


class PlacementError(ValueError):
    """No placement fits the budgets; the message names the short tier, by how much, and what would fit.

    `problems`: what the nearest placement lacks, a line each; `fixes`: what would make one fit, a line each.
    """

    def __init__(self, message: str, *, problems: list[str], fixes: list[str]) -> None:
        super().__init__(message)
        self.problems, self.fixes = problems, fixes


def shortfall_text(short: dict[Tier, int]) -> str:
    return ", ".join(f"{tier.value} short by {format_size(n)}" for tier, n in short.items())


def refusal(cfg: Config, candidates: list[Candidate], budgets: Any, *, lowest: Candidate) -> PlacementError:
    """The error for `candidates`, none of which fits `budgets` (the planner's `RankBudgets`);
    `lowest`: the placement with every auto kind on its lowest tier, replayed."""
    nearest = min(candidates, key=lambda c: sum(c.short.values()))
    problems = [f"the nearest placement ({nearest.label}) has {shortfall_text(nearest.short)}"]
    fixes = _raises(cfg, budgets, lowest, nearest) + _shrinks(cfg, nearest)
    message = (
        f"offload auto: no placement fits the budgets; the nearest ({nearest.label}) has "
        f"{shortfall_text(nearest.short)}: {'; or '.join(fixes)}"
    )
    return PlacementError(message, problems=problems, fixes=fixes)


def _raises(cfg: Config, budgets: Any, lowest: Candidate, nearest: Candidate) -> list[str]:
    """The smallest increase of each tier's budget that may make a placement fit (see the module note)."""
    assert lowest.result is not None and lowest.result.plan is not None
    result = lowest.result
    device, cpu = budgets.host_needs(result)
    nvme = result.plan.home_bytes(Tier.NVME)
    room = {Tier.CPU: budgets.cpu, Tier.NVME: budgets.nvme if cfg.tiers.nvme.path is not None else None}
    if not budgets.shared_host:
        room[Tier.DEVICE] = budgets.device
    own = {Tier.DEVICE: device, Tier.CPU: cpu + (device if budgets.shared_host else 0)}
    if any(n is None for t, n in room.items() if t is not Tier.NVME):
        deficit = 0  # a memory tier without a budget holds whatever it is given
    else:
        deficit = device + cpu + nvme - sum(n or 0 for n in room.values())
    grain = max((sum(align_up(s.nbytes) for s in specs) for specs in result.plan.specs.values()), default=0)
    short = dict(nearest.short)
    if deficit > 0:
        short = {tier: max(deficit + grain, own.get(tier, 0) - (room[tier] or 0)) for tier in room}
        if cfg.tiers.nvme.path is None:
            short[Tier.NVME] = deficit + grain
    fixes = []
    for tier, n in short.items():
        n = align_up(n)
        if tier is Tier.NVME and cfg.tiers.nvme.path is None:
            fixes.append(f"set tiers.nvme.path to a disk with {format_size(n)} free to let the planner use NVMe")
        elif tier is Tier.NVME:
            fixes.append(f"point tiers.nvme.path at a disk with {format_size(n)} more free")
        elif tier is Tier.DEVICE:
            fixes.append(f"raise tiers.device.capacity by {format_size(n)} ({n} bytes): a GPU with that much more memory")
        else:
            fixes.append(f"raise tiers.cpu.capacity by {format_size(n)} ({n} bytes): a host with that much more memory")
    return fixes


def _shrinks(cfg: Config, nearest: Candidate) -> list[str]:
    """What makes the need smaller rather than the machine larger."""
    fixes = []
    batch, accumulate = cfg.train.micro_batch_size, cfg.gradient_accumulation_steps
    memory_short = bool(nearest.short.keys() & {Tier.DEVICE, Tier.CPU})
    if memory_short and batch > 1:
        fixes.append(
            f"a smaller batch: train.micro_batch_size {batch // 2} (now {batch}) with gradient_accumulation_steps "
            f"{accumulate * 2} keeps the tokens per step, with less held at once"
        )
    if memory_short and cfg.activations.checkpoint == 0:
        fixes.append("activation checkpointing: activations.checkpoint 1 recomputes each block's activations in backward")
    if cfg.zero.stage < 3:
        fixes.append(f"zero.stage 3 (now {cfg.zero.stage}) lets the planner move parameters and gradients off the device too")
    fixes.append("more ranks: at zero.stage 3 each of --world-size N ranks holds 1/N of the state")
    return fixes
