"""The placement planner: where every slice lives when an `offload` key is auto.

Before anything is allocated, the planner replays the engine's own training step for each
candidate placement (the estimator's counting dry run, tierzero/estimate) and keeps the
one with the shortest predicted step among those that fit every tier's budget. The
candidates (tierzero/placement/candidates.py):

1. every whole-kind placement the stage allows for the kinds left to it (parameters,
   gradients, optimizer states each wholly on the device, in host memory or on NVMe; the
   kinds the config names stay where it says; a torch.optim class's optimizer states never
   on NVMe, which the config refuses: it keeps them in memory, and the replay counts them there);
2. from each of the best whole-kind placements that leave state on NVMe, the same with as
   many units' NVMe slices moved into memory as the budgets have room for, unit by unit
   and kind by kind, those that cost most disk time per byte first, by the replay's own
   count of each slice's reads and writes: stage-3 parameters (read in forward and in
   backward, written by the step) before optimizer states (read and written once);
   gradients handed to a step in backward cost nothing and stay. The device takes them
   first where it has a budget of its own (a unit whose optimizer states it holds steps
   there), then host memory. Among slices that save alike, the units are taken spread over
   the step (candidates.py: `spread_order`). The moves into host memory leave room there
   for the freed heap the engine keeps resident (`tiers.cpu.keep_freed`: up to that, and at most
   the step's transient host bytes), so that a budget the moves fill is one the process
   keeps to; a whole-kind placement fits as the store counts, as it would by hand.

A placement whose homes alone are over a budget is refused without a replay; the lowest
whole-kind placement is replayed first, and gives the slice sizes; the others are tried most in
memory first, and one that keeps no kind higher than a placement that fits is not replayed (a
kind higher up moves no more bytes, so it predicts no slower: a 7B model whose state fits the GPU
whole is replayed once, not 27 times at 3-4 s each; tests/unit/test_planner.py still checks the
plan against every whole-kind placement). The lowest placement is always a
base of splits, whether or not it fits: its slices move up as far as the memory budgets allow,
and those that save no disk time as far as the lowest tier's budget needs (candidates.py: `fill`).
So a model whose state fits no tier whole, but the three together, gets a plan.

With `machine` (`tierzero estimate --machine`) the budgets, rates and GPU are that machine's
(tierzero/estimate/machines.py), and nothing of this host is measured.

The prediction of each step is tierzero/placement/prediction.py's.

The budgets are per rank (tierzero/placement/budgets.py; a machine's figure is split among
the ranks on it); without a GPU, and without `tiers.device.capacity`, the device tier is
host memory and shares the cpu budget with the activations.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier
from tierzero.config import AUTO, Config, load_config
from tierzero.estimate.estimator import Bandwidth, Estimate, Target, estimate
from tierzero.estimate.machines import Machine
from tierzero.offload.host_heap import kept_heap_limit
from tierzero.placement.budgets import MachineBudgets, machine_budgets, target_budgets
from tierzero.placement.candidates import FIELDS, Candidate, fill, whole_kind
from tierzero.placement.compute import Compute, measure_compute
from tierzero.placement.disk import disk_rates
from tierzero.placement.prediction import Prediction, measure_copy_rate, measure_step_rate, predict
from tierzero.placement.progress import PLANNED, REPLAYED, REPLAYS
from tierzero.placement.refusal import PlacementError, refusal, shortfall_text
from tierzero.stages.plan import Homes

__all__ = ["PlacementError", "PlacementPlan", "RankBudgets", "plan_placement"]

log = logging.getLogger(__name__)

#: Whole-kind placements whose split is tried: the best this many that leave state on NVMe.
SPLIT_BASES = 4
#: How high each tier is: a placement that keeps every kind at least as high as another fits no worse.
_HEIGHT = {Tier.NVME: 0, Tier.CPU: 1, Tier.DEVICE: 2}


@dataclass(frozen=True, slots=True, kw_only=True)
class RankBudgets:
    """What one rank's tiers may hold: None where neither the config nor the machine says."""

    device: int | None
    cpu: int | None
    nvme: int | None
    shared_host: bool
    """The device tier is host memory (no GPU, no `tiers.device.capacity`): device and cpu share `cpu`,
    with the activations autograd saves."""
    sources: dict[Tier, str]
    kept_heap: int = 0
    """Free heap the process may keep resident (`tiers.cpu.keep_freed`, see [Note: freed host
    memory]): the slices the planner moves into host memory leave room for it, up to the step's
    transient host bytes (`host_needs(kept=True)`)."""

    @classmethod
    def of(
        cls, machine: MachineBudgets, cfg: Config, *, local_world_size: int = 1, cuda: bool | None = None
    ) -> RankBudgets:
        """Each tier's budget for one rank: a configured capacity as it is, a machine figure split.
        `cuda`: whether the machine has a GPU (default: whether this host has one)."""
        configured = {Tier.DEVICE: cfg.tiers.device.capacity, Tier.CPU: cfg.tiers.cpu.capacity}
        figures, sources = {}, {}
        for tier, budget in machine.by_tier().items():
            share = budget.nbytes
            if share is not None and configured.get(tier) is None and tier is not Tier.NVME and local_world_size > 1:
                share //= local_world_size
            figures[tier], sources[tier] = share, budget.source
        cuda = torch.cuda.is_available() if cuda is None else cuda
        shared = not cuda and cfg.tiers.device.capacity is None
        kept = kept_heap_limit(cfg.tiers.cpu.keep_freed)
        if kept and figures[Tier.CPU] is not None:
            sources[Tier.CPU] += f"; slices moved in leave room for {format_size(kept)} of freed heap kept"
        return cls(
            device=figures[Tier.DEVICE], cpu=figures[Tier.CPU], nvme=figures[Tier.NVME], shared_host=shared,
            sources=sources, kept_heap=kept,
        )  # fmt: skip

    def host_needs(self, result: Estimate, *, kept: bool = False) -> tuple[int, int]:
        """What `result` needs of the device and cpu budgets: each tier's counted peak, the device's with
        the activations where it is host memory; with `kept`, the cpu's with the heap kept freed
        (`kept_heap`, at most the transient host bytes: working sets and activations)."""
        device, cpu = result.tiers[Tier.DEVICE], result.tiers[Tier.CPU]
        device_need = device.need
        transient = cpu.need - cpu.home_total
        if self.shared_host:
            device_need += result.activations or 0  # autograd's saved tensors, in host memory too
            transient += device.need - device.home_total + (result.activations or 0)
        return device_need, cpu.need + (min(self.kept_heap, max(0, transient)) if kept else 0)

    def shortfalls(self, result: Estimate, *, kept: bool = False) -> dict[Tier, int]:
        """Bytes by which each tier the estimate needs is over its budget (none: it fits); with `kept`,
        the cpu's need counts the heap kept freed, as for the slices the planner moves into memory."""
        device, cpu = self.host_needs(result, kept=kept)
        # The NVMe homes' bytes, not the swap file's: a file sized to tiers.nvme.capacity says nothing of the need.
        nvme = result.nvme_file if result.plan is None else result.plan.home_bytes(Tier.NVME)
        return self._over(device=device, cpu=cpu, nvme=nvme)

    def shortfalls_of_homes(self, held: dict[Tier, int]) -> dict[Tier, int]:
        """Bytes by which homes alone (`held`, by tier) are over each budget: a lower bound of the shortfall."""
        return self._over(device=held[Tier.DEVICE], cpu=held[Tier.CPU], nvme=held[Tier.NVME])

    def _over(self, *, device: int, cpu: int, nvme: int) -> dict[Tier, int]:
        needs = {Tier.CPU: device + cpu} if self.shared_host else {Tier.DEVICE: device, Tier.CPU: cpu}
        short = {}
        for tier, need in needs.items():
            budget = self.device if tier is Tier.DEVICE else self.cpu
            if budget is not None and need > budget:
                short[tier] = need - budget
        if nvme and (self.nvme is None or nvme > self.nvme):
            short[Tier.NVME] = nvme - (self.nvme or 0)
        return short

    def memory_rooms(self, result: Estimate) -> dict[Tier, int]:
        """Bytes each memory tier may still take beyond what `result` needs with the heap kept freed, the
        device's first; where the device tier is host memory, only the cpu tier's, which holds both."""
        rooms = {}
        device, cpu = self.host_needs(result, kept=True)
        if self.device is not None and not self.shared_host:
            rooms[Tier.DEVICE] = max(0, self.device - device)
        if self.cpu is not None:
            rooms[Tier.CPU] = max(0, self.cpu - cpu - (device if self.shared_host else 0))
        return rooms


@dataclass(frozen=True, slots=True, kw_only=True)
class PlacementPlan:
    """The chosen homes, the replay and prediction behind them, and what else was weighed."""

    homes: Homes
    label: str
    estimate: Estimate
    prediction: Prediction
    budgets: RankBudgets
    disk: Bandwidth | None
    considered: tuple[tuple[str, str], ...]
    """(placement, its predicted step or why it was refused), best first."""
    units: tuple[str, ...]
    overrides: dict[str, int] = field(default_factory=dict)
    """Config keys the plan sets besides the homes: the prefetcher's budgets, lowered to fit the device."""

    def summary(self) -> dict[str, Any]:
        """The plan as data: `engine.memory_report()["planned"]` and `tierzero estimate --json`."""
        return {
            "placement": self.label,
            "homes": {what: self._spread(what) for what in FIELDS},
            "predicted_step_s": self.prediction.step_s,
            "bound": self.prediction.bound,
            "io_s": self.prediction.io_s,
            "compute_s": self.prediction.compute_s,
            "optimizer_s": self.prediction.optimizer_s,
            "copy_s": self.prediction.copy_s,
            "parts_s": self.prediction.part_seconds(),
            "nvme_read": self.estimate.nvme_read,
            "nvme_written": self.estimate.nvme_written,
            "nvme_home": self.estimate.tiers[Tier.NVME].home_total,
            "overrides": dict(self.overrides),
            "considered": [list(row) for row in self.considered],
        }

    def lines(self) -> list[str]:
        """The plan as `tierzero train` logs it and `tierzero estimate` prints it."""
        rows = [["tier", "params", "grads", "optimizer", "holds", "budget", "budget from"]]
        for tier in Tier:
            spread = {what: self._spread(what).get(tier.value, 0) for what in FIELDS}
            cells = [self._units(n) for n in spread.values()]
            held = self.estimate.tiers[tier].home_total
            budget = {Tier.DEVICE: self.budgets.device, Tier.CPU: self.budgets.cpu, Tier.NVME: self.budgets.nvme}[tier]
            shown = "-" if budget is None else format_size(budget)
            if tier is Tier.DEVICE and self.budgets.shared_host:
                shown, source = "(cpu's)", "no GPU: the device tier is host memory, within the cpu budget"
            else:
                source = self.budgets.sources[tier]
            rows.append([tier.value, *cells, format_size(held), shown, source])
        widths = [max(len(r[i]) for r in rows) for i in range(6)]
        table = ["  " + "  ".join(c.ljust(w) for c, w in zip(r[:6], widths)) + "  " + r[6] for r in rows]
        p, e = self.prediction, self.estimate
        how = "overlapped: the longest counts"
        if p.serial:
            how = "the disk beside the rest, which share the cores without a GPU"
            if p.slowdown > 1.0:
                how += ", slowed while the disk works"
        disk = "" if self.disk is None else f"; disk {self.disk.source}"
        lines = [
            f"placement (offload: auto), per rank: {self.label}",
            *table,
            f"  nvme per step: read {format_size(e.nvme_read)}, write {format_size(e.nvme_written)}{disk}",
            f"  predicted step {p.step_s:.2f} s, most of it {p.bound}: I/O {p.io_s:.2f} s, compute "
            f"{p.compute_s:.2f} s ({e.flops.source}), optimizer {p.optimizer_s:.2f} s, copies {p.copy_s:.2f} s ({how})",
            f"  by part, each its disk beside the rest: {p.by_part()}",
            f"  why: the shortest predicted step of {len(self.considered)} placements that fit or were tried:",
        ]
        if self.overrides:
            lowered = ", ".join(f"{key} {format_size(n)}" for key, n in self.overrides.items())
            lines.insert(-1, f"  the prefetcher's budgets lowered to fit the device: {lowered}")
        return lines + [f"    {label}: {why}" for label, why in self.considered[:6]]

    def _spread(self, what: str) -> dict[str, int]:
        """Units whose `what` lives on each tier: tier name -> count."""
        counts: dict[str, int] = {}
        for unit in self.units:
            tier = self.homes.units.get((unit, what), getattr(self.homes, what))
            counts[tier.value] = counts.get(tier.value, 0) + 1
        return counts

    def _units(self, n: int) -> str:
        total = len(self.units)
        return "-" if n == 0 else ("all" if n == total else f"{n} of {total} units")


def plan_placement(
    cfg: Config,
    *,
    world_size: int = 1,
    local_world_size: int = 1,
    budgets: MachineBudgets | None = None,
    disk: Bandwidth | None = None,
    flops: Bandwidth | None = None,
    copy_rate: float | None = None,
    step_rate: float | None = None,
    machine: Machine | None = None,
) -> PlacementPlan:
    """Choose every slice's home for `cfg`'s auto kinds; raises PlacementError when none fits.

    `budgets` default to the machine's (`machine_budgets`), `disk` to the rates remembered or
    probed for `tiers.nvme.path`, `flops` to the rate one of the model's blocks trains at, alone
    and beside the disk (`measure_compute`; a given rate is taken as the step's), `copy_rate`
    (bytes/s between the device and host tiers) and `step_rate` (elements/s of the optimizer's
    kernel) to short measurements. With `machine`, each defaults to that machine's figure instead,
    and the step is replayed and predicted as on its GPU: nothing of this host is measured.
    """
    target = None
    if machine is not None:
        target = Target(gpu_memory=machine.gpu_memory or 0, disk_free=machine.disk_free or 0)
        budgets = budgets or target_budgets(cfg.tiers, machine)
        disk, flops = disk or machine.disk(), flops or machine.flops(cfg.precision.param_dtype)
        copy_rate, step_rate = copy_rate or machine.copy_rate, step_rate or machine.host_step_rate
    cuda = torch.cuda.is_available() if machine is None else True
    rank_budgets = RankBudgets.of(
        budgets or machine_budgets(cfg.tiers), cfg, local_world_size=local_world_size, cuda=cuda
    )
    free = load_config(cfg, overrides={"tiers.device.capacity": None, "tiers.cpu.capacity": None})
    if disk is None and cfg.tiers.nvme.path is not None:
        rates = disk_rates(cfg.tiers.nvme.path, cfg.tiers.nvme)
        disk = Bandwidth(read=rates.read, write=rates.write, source=rates.source)
    compute = Compute(flops=flops) if flops is not None else measure_compute(cfg)
    flops = compute.flops
    copy_rate = copy_rate or measure_copy_rate()
    step_rate = step_rate or measure_step_rate(cfg)
    # With a GPU, the units whose optimizer states the plan keeps on the device step there.
    device_step_rate = None
    if machine is not None:
        device_step_rate = machine.device_step_rate
    elif cuda:
        device_step_rate = measure_step_rate(cfg, device="cuda")

    specs: dict[str, Any] = {}
    states: dict[str, int] = {}  # a torch.optim class's states by unit, held where its optimizer home is
    replays = 0

    def replay(homes: Homes, overrides: dict[str, int]) -> Estimate:
        nonlocal replays
        replays += 1
        replayed = load_config(free, overrides=overrides) if overrides else free
        return estimate(
            replayed, world_size=world_size, local_world_size=local_world_size, disk=disk, flops=flops,
            suggest=False, homes=homes, target=target,
        )  # fmt: skip

    def judge(candidate: Candidate, *, kept: bool = False) -> Candidate:
        # Homes alone over a budget: refused without a replay (the working set only adds to them).
        # `kept`: a split's cpu need counts the heap kept freed (a whole-kind placement fits as the store counts).
        homes_short = rank_budgets.shortfalls_of_homes(_home_bytes(specs, states, candidate.homes)) if specs else {}
        if homes_short:
            candidate.short = homes_short
            return candidate
        began = time.perf_counter()
        result = replay(candidate.homes, {})
        assert result.plan is not None
        specs.update(result.plan.specs)
        states.update({unit: held.nbytes for unit, held in result.optimizer_states.items()})
        short = rank_budgets.shortfalls(result, kept=kept)
        for lowered in _lowered_prefetch(cfg, result, short, shared_host=rank_budgets.shared_host):
            again = replay(candidate.homes, lowered)
            if not rank_budgets.shortfalls(again, kept=kept):
                result, short, candidate.overrides = again, {}, lowered
                break
        candidate.result, candidate.short = result, short
        candidate.prediction = predict(
            result, copy_rate=copy_rate, step_rate=step_rate, cuda=cuda, slowdown=compute.slowdown,
            forward_share=compute.forward_share, device_step_rate=device_step_rate,
        )  # fmt: skip
        verdict = shortfall_text(short) if short else f"{candidate.prediction.step_s:.2f} s predicted"
        log.info(
            "replay %d, %.1f s: %s: %s", replays, time.perf_counter() - began, candidate.label, verdict, extra={REPLAYS: replays}
        )
        return candidate

    def judge_split(candidate: Candidate) -> Candidate:
        # Slices moved into host memory leave the kept heap room there; those moved into a GPU need not.
        return judge(candidate, kept=Tier.CPU in candidate.homes.units.values())

    lowest, *higher = whole_kind(cfg)
    log.info("replaying the step for each candidate placement", extra={PLANNED: 1 + len(higher)})
    began = time.perf_counter()
    whole = [judge(lowest)]
    for candidate in reversed(higher):  # most in memory first: what they dominate is not replayed
        if not any(not c.short and c.result is not None and _dominates(c.homes, candidate.homes) for c in whole):
            whole.append(judge(candidate))
    fitting = sorted((c for c in whole if not c.short), key=_rank)
    bases = [c for c in fitting if c.result is not None and c.result.nvme_file and c is not lowest][: SPLIT_BASES - 1]
    auto = {what for what, key in FIELDS.items() if getattr(cfg.offload, key) == AUTO}
    splits = [
        split for base in [lowest, *bases]
        for split in fill(
            base, rank_budgets.memory_rooms(base.result), judge_split, disk=disk, auto=auto,
            over=max(base.short.get(Tier.NVME, 0), base.short.get(Tier.CPU, 0) if not base.result.nvme_file else 0),
        )
    ]  # fmt: skip
    ranked = sorted((c for c in whole + splits if not c.short), key=_rank)
    log.info(
        "%d replays of %d placements in %.1f s", replays, len(whole) + len(splits), time.perf_counter() - began,
        extra={REPLAYED: replays},
    )
    if not ranked:
        raise refusal(cfg, whole + splits, rank_budgets, lowest=lowest)
    best = ranked[0]
    assert best.result is not None and best.prediction is not None
    considered = [(c.label, f"{_rank(c)[0]:.2f} s predicted") for c in ranked]
    considered += [(c.label, "over budget: " + shortfall_text(c.short)) for c in whole + splits if c.short]
    return PlacementPlan(
        homes=best.homes, label=best.label, estimate=best.result, prediction=best.prediction, budgets=rank_budgets,
        disk=disk, considered=tuple(considered), units=tuple(best.result.plan.specs), overrides=best.overrides,
    )  # fmt: skip


def _lowered_prefetch(
    cfg: Config, result: Estimate, short: dict[Tier, int], *, shared_host: bool
) -> list[dict[str, int]]:
    """The prefetcher's budgets to try when the device is short (the host, where the device is host
    memory) and the parameters it keeps fetched exceed the shortfall: lowered by it, then by half
    and a quarter of what is left (a lower budget frees less than it gives up: other copies
    share the peak). None when that cannot help."""
    over = short.get(Tier.CPU, 0) if shared_host else short.get(Tier.DEVICE, 0)
    fetched = result.tiers[Tier.DEVICE].working.get("fetched", 0)
    if not over or Tier.NVME in short or fetched <= over:
        return []
    first = min(cfg.prefetch.max_live_bytes, fetched - over)
    return [
        {"prefetch.max_live_bytes": live, "prefetch.bytes": min(cfg.prefetch.bytes, live)}
        for live in (first, first // 2, first // 4)
        if live > 0
    ]


def _home_bytes(specs: dict[str, Any], states: dict[str, int], homes: Homes) -> dict[Tier, int]:
    """Bytes each tier's homes hold under `homes`, from a replay's slice sizes and a torch.optim class's
    `states` by unit (the same for every placement), those in the memory of the unit's optimizer home."""
    held = dict.fromkeys(Tier, 0)
    for unit, unit_specs in specs.items():
        for spec in unit_specs:
            held[homes.of(unit, spec.kind)] += spec.nbytes
    for unit, nbytes in states.items():
        held[homes.tier(unit, "optimizer")] += nbytes
    return held


def _rank(candidate: Candidate) -> tuple[float, float, int, int]:
    """Shortest predicted step first; on a tie, fewest copies between the device and host tiers,
    then the least state on NVMe, then in host memory: the highest tiers that do as well."""
    assert candidate.prediction is not None and candidate.result is not None
    homes = candidate.result.tiers
    lower = [homes[tier].home_total if tier in homes else 0 for tier in (Tier.NVME, Tier.CPU)]
    return candidate.prediction.step_s, candidate.prediction.copy_s, lower[0], lower[1]


def _dominates(high: Homes, low: Homes) -> bool:
    """Whether `high` keeps every kind on a tier at least as high as `low` does (whole kinds only)."""
    return all(_HEIGHT[getattr(high, what)] >= _HEIGHT[getattr(low, what)] for what in FIELDS)
