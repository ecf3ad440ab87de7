"""`tierzero estimate`: what a config will hold in each tier, and how fast a step can be, before anything is allocated.

Per rank: the bytes of each kind of state in each tier, the peak each tier's ledger
will reach (homes plus gathered units, scratch, fetched copies, staging: the engine's
own step, run on the meta device by tierzero/estimate/dry_run.py), the NVMe bytes read and
written per step, and step-time floors from the disk bandwidth (`bench nvme` results,
or a stated assumption) and from 6 x parameters x tokens FLOPs at a stated or measured
rate. A config that does not fit says which tier and by how much, and which change
would make it fit, each candidate estimated the same way. The table and the command
are in tierzero/cli/estimate.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tierzero.common.sizes import format_size
from tierzero.common.slices import MODEL_STATE_KINDS, Kind, SliceKey, Tier, align_up
from tierzero.config import load_config
from tierzero.estimate.counting import Traffic
from tierzero.estimate.dry_run import dry_run
from tierzero.offload.disk.files import free_space as _free_space
from tierzero.optim.unit_states import HeldStates
from tierzero.stages.plan import Homes, SlicePlan
from tierzero.units.precision import dtype_of

__all__ = ["Bandwidth", "Estimate", "Target", "TierEstimate", "estimate"]


@dataclass(frozen=True, slots=True)
class Bandwidth:
    """A rate and where it came from (a bench file, a measurement, or a stated assumption)."""

    read: float
    """Bytes per second (for FLOPs: FLOP per second)."""
    write: float
    source: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """The machine an estimate is for when it is not this one (`tierzero estimate --machine`): a GPU
    of `gpu_memory` bytes, whatever this host has, and `disk_free` bytes free at tiers.nvme.path."""

    gpu_memory: int
    disk_free: int


@dataclass(slots=True, kw_only=True)
class TierEstimate:
    """Bytes one tier holds per rank: homes by kind, and the peak of everything the store counts."""

    tier: Tier
    capacity: int | None
    homes: dict[Kind, int] = field(default_factory=lambda: dict.fromkeys(MODEL_STATE_KINDS, 0))
    working: dict[str, int] = field(default_factory=dict)
    """Peak transient bytes by use: gathered (stage-3 full units), scratch (gradients, step), fetched
    (copies of slices homed elsewhere), staging (the swapper's pool), bounce (the NVMe tier's), cache
    (tiers.nvme.cache's entries); and, not transient but in no kind's column, optimizer_states
    (`optimizer_states`, shown beside the rest)."""
    optimizer_states: int = 0
    """Bytes of the states a torch.optim class (optimizer.type lion, adafactor, torch:<class>) keeps in this
    tier's memory beside the units' shards ([Note: counting a class's states]): no store slice holds them,
    so `homes` has none of them; `home_total` and `peak` count them."""
    peak: int = 0
    """The store ledger's peak for this tier (`engine.memory_report()["tiers"][tier]["peak"]`), plus
    `optimizer_states` (from the first step on, they are held throughout)."""
    uncounted: int = 0
    """Bytes in `peak` that do not count against the capacity (the NVMe tier's bounce blocks)."""
    disk_need: int = 0
    """Bytes of files this tier preallocates (the NVMe tier's swap file)."""
    disk_free: int | None = None
    """Free bytes on the disk that holds them; None when unknown or not on a disk."""

    @property
    def home_total(self) -> int:
        return sum(self.homes.values()) + self.optimizer_states

    @property
    def need(self) -> int:
        """What the capacity must allow."""
        return self.peak - self.uncounted

    @property
    def fits(self) -> bool:
        on_disk = self.disk_free is None or self.disk_need <= self.disk_free
        return on_disk and (self.capacity is None or self.need <= self.capacity)


@dataclass(slots=True, kw_only=True)
class Estimate:
    """Everything `tierzero estimate` says about one config at one world size."""

    stage: int
    world_size: int
    parameters: int
    units: int
    tokens_per_step: int
    """Tokens one rank trains on per optimizer step."""
    tiers: dict[Tier, TierEstimate]
    nvme_read: int
    """NVMe bytes read per optimizer step, per rank, once the prefetcher follows the learned order."""
    nvme_read_first: int
    """NVMe bytes read in the first step, which learns the unit order (parameters read on demand)."""
    nvme_written: int
    """NVMe bytes written per optimizer step, per rank."""
    nvme_written_first: int
    """NVMe bytes written in the first step (with the step in the next forward, only its first units')."""
    memory_copied: int
    """Bytes copied between the device and cpu tiers per optimizer step, per rank; without a GPU
    also into gathered buffers, and the gradients' landing in their slices (host memory traffic)."""
    nvme_by_slice: dict[SliceKey, tuple[int, int]]
    """NVMe bytes (read, written) per optimizer step, by slice."""
    nvme_written_setup: int
    """NVMe bytes written by set-up: each slice's first value, but those tiers.nvme.cache keeps."""
    steps: int
    """Steps the dry run took; the per-step figures are the last one's (past 2: the cache settled)."""
    local_world_size: int
    """Ranks per node of the layout the collectives' bytes are split by (world_size: one node)."""
    comm: dict[str, dict[str, dict[str, int]]]
    """Bytes a rank sends per step: group -> collective -> "intra" (inside its node) and "inter" (across),
    as `engine.comm_report(per_group=True)` counts them."""
    nvme_file: int
    """Bytes of this rank's preallocated swap file."""
    nvme_free: int | None
    disk: Bandwidth | None
    flops: Bandwidth
    activations: int | None
    """Rough bytes of saved activations (built-in models only), host or device."""
    cuda: bool = False
    """Whether the step runs on a GPU (this host's, or the `Target`'s)."""
    plan: SlicePlan | None = None
    """Each unit's slices and their homes, as the engine registers them."""
    optimizer_states: dict[str, HeldStates] = field(default_factory=dict)
    """What a torch.optim class keeps beside each trained unit's shard, by unit (empty for adamw, adam, sgd)."""
    phases: dict[str, Traffic] = field(default_factory=dict)
    """What a later step moved and stepped in each of its parts ("forward", "backward", "step")."""
    problems: list[str] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)

    @property
    def io_floor_s(self) -> float:
        if self.disk is None:
            return 0.0
        # One disk serves both directions, so reads and writes add up.
        return self.nvme_read / self.disk.read + self.nvme_written / self.disk.write

    @property
    def compute_floor_s(self) -> float:
        return 6.0 * self.parameters * self.tokens_per_step / self.flops.read

    @property
    def step_floor_s(self) -> float:
        """At best I/O hides entirely behind compute or the other way round."""
        return max(self.io_floor_s, self.compute_floor_s)

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def host_bytes(self) -> int:
        """Host memory the store holds per rank; without CUDA the device tier is host memory too."""
        host = self.tiers[Tier.CPU].peak
        return host if self.cuda else host + self.tiers[Tier.DEVICE].peak


# ---------------------------------------------------------------- the estimate


def estimate(
    cfg: Any,
    *,
    world_size: int = 1,
    local_world_size: int | None = None,
    disk: Bandwidth | None = None,
    flops: Bandwidth | None = None,
    suggest: bool = True,
    homes: Homes | None = None,
    target: Target | None = None,
) -> Estimate:
    """Per-rank bytes per tier, NVMe traffic and step-time floors of `cfg`; nothing is allocated.

    `disk` is the NVMe bandwidth (default: the stated `ASSUMED_DISK`), `flops` the compute
    rate (default: `assumed_flops`). With `suggest`, a config that does not fit gets the
    placement or capacity changes that would make it fit, each estimated the same way.
    `homes` places the slices (the planner's candidates); default: the config's `offload`.
    `local_world_size`: ranks per node, which splits the collectives' bytes (default: one node).
    `target`: the machine it is for, with a GPU, when not this one: nothing of this host is read.
    """
    cuda = torch.cuda.is_available() if target is None else True
    run = dry_run(cfg, world_size=world_size, local_world_size=local_world_size, homes=homes, cuda=cuda)
    tiers = {tier: TierEstimate(tier=tier, capacity=_capacity(cfg, tier, target)) for tier in Tier}
    for spec in run.plan.all():
        homes = tiers[spec.home].homes  # SECONDARY (hpZ) joins the model states only where there is one
        homes[spec.kind] = homes.get(spec.kind, 0) + spec.nbytes
    for held in run.optimizer_states.values():
        tiers[held.tier].optimizer_states += held.nbytes  # never NVMe: the dry run refuses it
    for tier, est in tiers.items():
        est.working = {use: n for use, n in run.working[tier].items() if use != "home" and n}
        if est.optimizer_states:
            est.working["optimizer_states"] = est.optimizer_states
        est.peak = run.peak[tier] + est.optimizer_states if tier is not Tier.NVME else est.home_total
        est.uncounted = run.bounce if tier is Tier.CPU else 0
    nvme_file = run.plan.home_bytes(Tier.NVME)
    if cfg.tiers.nvme.capacity is not None and nvme_file:
        nvme_file = cfg.tiers.nvme.capacity
    uses_nvme = nvme_file > 0
    nvme = tiers[Tier.NVME]
    nvme.capacity = cfg.tiers.nvme.capacity
    free = _free_space(cfg.tiers.nvme.path) if target is None else target.disk_free
    nvme.disk_need, nvme.disk_free = nvme_file, free if uses_nvme else None
    train = cfg.train
    result = Estimate(
        stage=cfg.zero.stage,
        world_size=world_size,
        parameters=run.parameters,
        units=len(run.plan.specs),
        tokens_per_step=train.micro_batch_size * train.seq_len * cfg.gradient_accumulation_steps,
        tiers=tiers,
        nvme_read=run.nvme_read,
        nvme_read_first=run.nvme_read_first,
        nvme_written=run.nvme_written,
        nvme_written_first=run.nvme_written_first,
        memory_copied=run.memory_copied,
        nvme_by_slice=run.nvme_by_slice,
        nvme_written_setup=run.nvme_written_setup,
        steps=run.steps,
        local_world_size=local_world_size or world_size,
        comm=run.comm,
        nvme_file=nvme_file,
        nvme_free=nvme.disk_free,
        disk=(disk or ASSUMED_DISK) if uses_nvme else None,
        flops=flops or assumed_flops(cfg.precision.param_dtype),
        activations=_activation_bytes(cfg, run.model),
        cuda=cuda,
        plan=run.plan,
        phases=run.phases,
        optimizer_states=dict(run.optimizer_states),
    )
    _check_fit(result, cfg)
    if suggest and not result.fits:
        result.fixes = _fixes(cfg, result, world_size=world_size, target=target)
    return result


#: This machine's fio best medians (docs: /work/shared/MACHINE.md), used when no `bench nvme` results are given.
ASSUMED_DISK = Bandwidth(read=3.0e9, write=3.9e9, source="assumed 3.0 GB/s read, 3.9 GB/s write (no bench nvme results)")


def assumed_flops(param_dtype: str) -> Bandwidth:
    """The stated compute rate: a 2-core AVX-512 CPU's matmul rate, 185 GFLOP/s fp32, 400 bf16/fp16."""
    rate = 185e9 if param_dtype == "fp32" else 400e9
    return Bandwidth(read=rate, write=rate, source=f"assumed {rate / 1e9:.0f} GFLOP/s ({param_dtype} matmul, 2-core CPU)")


#: Windows `measure_flops` times, keeping the fastest.
_WINDOWS = 5


def measure_flops(param_dtype: str, *, seconds: float = 1.0) -> Bandwidth:
    """Time square matmuls in the compute dtype on the compute device for about `seconds`, the
    best of `_WINDOWS` windows: other work on the machine only ever slows a window down, and on a
    shared 2-core VM a 0.3 s measurement of three windows read 79 to 136 GFLOP/s in one hour's
    runs (127 to 147 alone). The placement planner times one of a built-in model's blocks
    instead (tierzero.placement.compute)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    side = 4096 if device.type == "cuda" else 1024
    dtype = dtype_of(param_dtype)
    a, b = (torch.randn(side, side, device=device).to(dtype) for _ in range(2))
    (a @ b).sum().item()  # warm-up
    rate = 0.0
    for _ in range(_WINDOWS):
        runs, began = 0, time.perf_counter()
        while time.perf_counter() - began < seconds / _WINDOWS:
            c = a @ b
            runs += 1
        c.sum().item()
        rate = max(rate, 2.0 * side**3 * runs / (time.perf_counter() - began))
    source = f"measured {rate / 1e9:.0f} GFLOP/s ({param_dtype} {side}x{side} @ {side}x{side} matmul, {device.type})"
    return Bandwidth(read=rate, write=rate, source=source)


def _capacity(cfg: Any, tier: Tier, target: Target | None) -> int | None:
    if tier is Tier.DEVICE:
        capacity = cfg.tiers.device.capacity
        if capacity is None and target is not None:
            capacity = target.gpu_memory
        elif capacity is None and torch.cuda.is_available():
            capacity = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return capacity
    return cfg.tiers.cpu.capacity if tier is Tier.CPU else cfg.tiers.nvme.capacity


def _activation_bytes(cfg: Any, model: Any) -> int | None:
    """Saved activations of one micro-batch for the built-in GPT/Llama (Korthikanti et al.'s per-layer count)."""
    spec = getattr(model, "spec", None)
    if spec is None:
        return None
    b, s, d = cfg.train.micro_batch_size, cfg.train.seq_len, spec.d_model
    itemsize = 4 if cfg.precision.param_dtype == "fp32" else 2
    # Per layer: about 34 bytes x b s d at 2-byte activations (flash-style attention saves no s x s scores).
    per_layer = 17 * b * s * d * itemsize + 2 * b * s * spec.d_ff * itemsize
    logits = 3 * b * s * spec.vocab_size * 4  # logits, their fp32 copy and its gradient
    return spec.n_layer * per_layer + logits


# ---------------------------------------------------------------- fit and fixes


def _check_fit(result: Estimate, cfg: Any) -> None:
    for tier in (Tier.DEVICE, Tier.CPU):
        est = result.tiers[tier]
        if not est.fits:
            assert est.capacity is not None
            result.problems.append(
                f"{tier.value} tier needs {format_size(est.need)} per rank at peak, tiers.{tier.value}.capacity is "
                f"{format_size(est.capacity)}"
            )
    nvme = result.tiers[Tier.NVME]
    if nvme.capacity is not None and nvme.home_total > nvme.capacity:
        result.problems.append(
            f"nvme tier needs {format_size(nvme.home_total)} per rank, tiers.nvme.capacity is {format_size(nvme.capacity)}"
        )
    if result.nvme_free is not None and result.nvme_file > result.nvme_free:
        result.problems.append(
            f"nvme tier needs {format_size(result.nvme_file)} at {cfg.tiers.nvme.path} for this rank's swap file, "
            f"{format_size(result.nvme_free)} free"
        )


#: Placement changes tried, in order, when a config does not fit: (overrides, what to tell the user).
_MOVES: tuple[tuple[dict[str, Any], str], ...] = (
    ({"offload.optimizer": "cpu"}, "move optimizer states to cpu (offload.optimizer: cpu)"),
    ({"offload.gradients": "cpu"}, "move gradients to cpu (offload.gradients: cpu)"),
    ({"offload.optimizer": "nvme"}, "move optimizer states to nvme (offload.optimizer: nvme)"),
    ({"offload.gradients": "nvme"}, "move gradients to nvme (offload.gradients: nvme)"),
    ({"zero.stage": 3, "offload.params": "cpu"}, "shard and offload parameters (zero.stage: 3, offload.params: cpu)"),
    ({"zero.stage": 3, "offload.params": "nvme"}, "shard parameters to nvme (zero.stage: 3, offload.params: nvme)"),
)


def _fixes(cfg: Any, result: Estimate, *, world_size: int, target: Target | None) -> list[str]:
    """One line per change that would make `cfg` fit: a placement move that fits, else raising a capacity."""
    fixes: list[str] = []
    short = [t for t in (Tier.DEVICE, Tier.CPU) if not result.tiers[t].fits]
    if short == [Tier.CPU] and (fix := _smaller_cache(cfg, result, world_size=world_size, target=target)):
        fixes.append(fix)
    for overrides, what in _MOVES:
        if any(_current(cfg, key) == value for key, value in overrides.items() if key.startswith("offload")):
            continue
        try:
            moved = estimate(
                load_config(cfg, overrides=overrides), world_size=world_size, disk=result.disk, suggest=False, target=target
            )
        except ValueError:
            continue  # a placement the config does not allow with this stage
        if short and all(moved.tiers[t].need < result.tiers[t].need for t in short) and moved.fits:
            drops = ", ".join(
                f"{t.value} need drops from {format_size(result.tiers[t].need)} to {format_size(moved.tiers[t].need)}"
                for t in short
            )
            fixes.append(f"{what}: {drops}")
    for tier in short:
        need = result.tiers[tier].need
        fixes.append(f"raise tiers.{tier.value}.capacity to {format_size(need)} ({need} bytes)")
    nvme = result.tiers[Tier.NVME]
    if nvme.capacity is not None and nvme.home_total > nvme.capacity:
        fixes.append(f"raise tiers.nvme.capacity to {format_size(align_up(nvme.home_total))} (or leave it null)")
    if result.nvme_free is not None and result.nvme_file > result.nvme_free:
        fixes.append(
            f"point tiers.nvme.path at a disk with {format_size(result.nvme_file)} free, or move state to cpu"
        )
    return fixes


def _smaller_cache(cfg: Any, result: Estimate, *, world_size: int, target: Target | None) -> str | None:
    """Keep fewer bytes in tiers.nvme.cache by what the cpu tier lacks, where that is enough."""
    cpu = result.tiers[Tier.CPU]
    cached = cpu.working.get("cache", 0)  # the budget's bytes the slices filled, at most the budget
    if not cached:
        return None
    assert cpu.capacity is not None
    smaller = max(0, cached - (cpu.need - cpu.capacity))
    cfg = load_config(cfg, overrides={"tiers.nvme.cache": smaller})
    moved = estimate(cfg, world_size=world_size, disk=result.disk, suggest=False, target=target)
    if not moved.fits:
        return None
    return (
        f"lower tiers.nvme.cache to {format_size(smaller)} ({smaller} bytes): cpu need drops from "
        f"{format_size(cpu.need)} to {format_size(moved.tiers[Tier.CPU].need)}"
    )


def _current(cfg: Any, key: str) -> Any:
    section, name = key.split(".")
    value = getattr(getattr(cfg, section), name)
    return value.value if isinstance(value, Tier) else value
