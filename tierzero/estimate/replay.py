"""The bytes one training step makes each tier hold, replayed from the engine's own slice plan.

`plan_slices` builds the model on the meta device, cuts it with the engine's
`plan_units` and asks a store-less `Stage` for each unit's `slice_specs`, so padding
and dtypes match a real run exactly. `Replay` then walks one step's allocations in
the order the stages make them (see [Note: the replay]
Stage 3 gathers the root for the whole forward and again for the whole backward,
and keeps at most two block units gathered or gathering (the gather-ahead rule of
`Stage3._prefetch`); the PARAM shards it gathers from are fetched to the device by
`stages.param_prefetch.ParamPrefetch`, which `ParamFetches` mirrors while driving the
engine's own `tierzero.prefetch.Prefetcher` (prefetches taken to land at once, so
the budgets, not the disk, bound what is ahead: the most it can hold). The replay runs
two steps, since the prefetcher learns the order in the first. Stages 2 and 3 flatten
each unit's gradients into a full device scratch and keep `MAX_REDUCES_IN_FLIGHT`
reduce-scatters pending, or more while they fit in `zero.reduce_bucket_size`; the optimizer step is `stages.step`'s pipeline: group
j+1 read while j computes and j-1 is written, each slice fetched to the step tier
(device for device-homed states, else cpu); without clipping or fp16, stage 3 runs it
during backward, a unit pushed as soon as its gradient is reduced (`StepPipeline`). A fetch of a
slice homed elsewhere allocates a copy there; NVMe<->device moves pass through the
swapper's staging pool, whose buffers stay held once made; writes to NVMe from
unaligned host memory go through the NVMe tier's bounce blocks, also kept.
When the engine changes any of these orders, the replay must follow:
tests/unit/test_estimate.py compares it with measured peaks, placement by placement.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tierzero.estimate.mirror import ParamFetches, StepPipeline
from tierzero.prefetch import Phase
from tierzero.slices import Kind, Tier

__all__ = ["TIER_ORDER", "Replay", "UnitSlices", "plan_slices", "staging_bytes"]

TIER_ORDER = (Tier.DEVICE, Tier.CPU, Tier.NVME)


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitSlices:
    """One unit as the engine will hold it on one rank."""

    name: str
    padded_numel: int
    shard_numel: int
    specs: tuple[Any, ...]
    """The stage's `SliceSpec`s for this unit (kind, numel, dtype, home)."""

    def spec(self, kind: Kind) -> Any | None:
        return next((s for s in self.specs if s.kind is kind), None)


# ---------------------------------------------------------------- slices, from the engine


def plan_slices(cfg: Any, *, world_size: int) -> tuple[list[UnitSlices], int, Any]:
    """(units with their slices, distinct parameter count, the meta model): nothing is allocated.

    Uses the engine's `plan_units` and a real, store-less `Stage` for `slice_specs`.
    """
    from tierzero import comm as C
    from tierzero.models import build_model, count_parameters
    from tierzero.optim import make_optimizer
    from tierzero.precision import dtype_of
    from tierzero.stages import STAGES, Homes
    from tierzero.units import plan_units

    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    if cfg.zero.stage not in STAGES:
        raise ValueError(f"zero.stage is {cfg.zero.stage}, the engine runs stages 1, 2 and 3: set zero.stage to 1, 2 or 3")
    model = build_model(cfg.model, device="meta")
    units = plan_units(model, world_size=world_size, unit_classes=list(cfg.zero.unit_classes))
    offload = cfg.offload
    stage = STAGES[cfg.zero.stage](
        units=units,
        store=None,
        comm=C.CommGroup(rank=0, world_size=world_size, counter=C.CommCounter()),
        optimizer=make_optimizer(cfg.optimizer),
        param_dtype=dtype_of(cfg.precision.param_dtype),
        homes=Homes(params=offload.params, grads=offload.gradients, optimizer=offload.optimizer),
        device=torch.device("cpu"),
        overlap=bool(cfg.zero.overlap_comm),
    )
    planned = [
        UnitSlices(name=u.name, padded_numel=u.padded_numel, shard_numel=u.shard_numel, specs=tuple(stage.slice_specs(u)))
        for u in units
    ]
    return planned, count_parameters(model), model


def staging_bytes(nbytes: int, *, buffer_size: int, buffer_count: int) -> int:
    """Staging buffers one NVMe<->device move of `nbytes` makes the pool hold (it keeps up to the count in flight)."""
    return min(buffer_count, math.ceil(nbytes / buffer_size)) * buffer_size


# ---------------------------------------------------------------- the replay


class Replay:
    """Bytes per tier, now and at peak, through the steps replayed: see the module note."""

    def __init__(self, cfg: Any, units: list[UnitSlices], *, world_size: int) -> None:
        from tierzero.precision import dtype_of

        self.cfg, self.units, self.world_size = cfg, units, world_size
        self.itemsize = dtype_of(cfg.precision.param_dtype).itemsize
        self.now: Counter[Tier] = Counter()
        self.peak: Counter[Tier] = Counter()
        self.working: dict[Tier, Counter[str]] = {t: Counter() for t in TIER_ORDER}
        self._use_now: dict[Tier, Counter[str]] = {t: Counter() for t in TIER_ORDER}
        self.read = self.written = 0
        self.staging = 0
        self._batching, self._staged = False, 0
        self.mixed = cfg.precision.param_dtype != "fp32"
        self.step_tier = Tier.DEVICE if cfg.offload.optimizer is Tier.DEVICE else Tier.CPU
        self.params = ParamFetches(self, units)
        # Engine._steps_in_backward: stage 3 steps each unit in backward when no step-wide
        # decision (clipping's global norm, fp16's overflow check) waits for all gradients.
        self.in_backward = (
            cfg.zero.stage == 3 and cfg.gradient_clipping <= 0 and cfg.precision.param_dtype != "fp16"
        )
        self._backward_step: StepPipeline | None = None

    # -- book-keeping

    def alloc(self, tier: Tier, nbytes: int, use: str) -> None:
        self.now[tier] += nbytes
        self._use_now[tier][use] += nbytes
        self.peak[tier] = max(self.peak[tier], self.now[tier])
        self.working[tier][use] = max(self.working[tier][use], self._use_now[tier][use])

    def free(self, tier: Tier, nbytes: int, use: str) -> None:
        self.now[tier] -= nbytes
        self._use_now[tier][use] -= nbytes

    def _move(self, spec: Any, other: Tier) -> None:
        """One transfer between the slice's home and `other`: NVMe<->device passes through the staging pool.

        Only with a GPU: without one the device tier is host memory the NVMe tier reads directly.
        """
        if spec.home is not Tier.NVME or other is not Tier.DEVICE or not torch.cuda.is_available():
            return
        # Transfers started together (a batch of prefetches) share the pool; it keeps what it made.
        self._staged = spec.nbytes + (self._staged if self._batching else 0)
        swap = self.cfg.swapper
        need = staging_bytes(self._staged, buffer_size=swap.buffer_size, buffer_count=swap.buffer_count)
        if need > self.staging:
            self.alloc(Tier.CPU, need - self.staging, "staging")
            self.staging = need

    @contextmanager
    def together(self) -> Iterator[None]:
        """Transfers started in this block run at the same time."""
        self._batching, self._staged = True, 0
        try:
            yield
        finally:
            self._batching, self._staged = False, 0

    def fetch(self, spec: Any | None, *, to: Tier = Tier.DEVICE) -> None:
        """`store.fetch(key, to=...)`: a copy in `to` unless the home is there."""
        if spec is None or spec.home is to:
            return
        self.alloc(to, spec.nbytes, "fetched")
        if spec.home is Tier.NVME:
            self.read += spec.nbytes
        self._move(spec, to)

    def write_back(self, spec: Any | None, *, src: Tier = Tier.DEVICE) -> None:
        if spec is not None and spec.home is not src:
            self.written += spec.nbytes if spec.home is Tier.NVME else 0
            self._move(spec, src)

    def release(self, spec: Any | None, *, to: Tier = Tier.DEVICE) -> None:
        if spec is not None and spec.home is not to:
            self.free(to, spec.nbytes, "fetched")

    def touch(self, spec: Any | None, *, write: bool) -> None:
        """`Stage.slice(unit, kind, write=...)`: fetched to the device around work that allocates nothing else."""
        self.fetch(spec)
        if write:
            self.write_back(spec)
        self.release(spec)

    # -- the phases

    def homes(self) -> None:
        """What the engine holds once set up: every memory-homed slice, and the pools its first writes made."""
        for unit in self.units:
            for spec in unit.specs:
                if spec.home is not Tier.NVME:
                    self.alloc(spec.home, spec.nbytes, "home")
        self.alloc(Tier.CPU, self._bounce_bytes(), "bounce")
        if torch.cuda.is_available():
            # Stage.register writes each first value from device memory: NVMe homes go through staging.
            for unit in self.units:
                for spec in unit.specs:
                    self._move(spec, Tier.DEVICE)

    def _bounce_bytes(self) -> int:
        """The NVMe tier's bounce blocks: one per chunk written from unaligned host memory, at most queue_depth, kept.

        Such writes are each slice's first (Stage.register, from a host tensor; on CUDA it
        is staged instead) and, in mixed-precision stage 3 stepped on the host, `publish`'s
        new compute-dtype shard, of which two units' can be in flight at once.
        """
        nvme = self.cfg.tiers.nvme
        slices = [s for u in self.units for s in u.specs if s.home is Tier.NVME]
        if not slices:
            return 0
        chunks = 0 if torch.cuda.is_available() else max(math.ceil(s.nbytes / nvme.block_size) for s in slices)
        params = [u.spec(Kind.PARAM) for u in self.units]
        if self.cfg.zero.stage == 3 and self.mixed and self.step_tier is Tier.CPU and params[0].home is Tier.NVME:
            chunks = max(chunks, 2 * max(math.ceil(p.nbytes / nvme.block_size) for p in params))
        return min(nvme.queue_depth, chunks) * nvme.block_size

    def step(self) -> None:
        """One optimizer step: forward and backward of each micro-step, then the step pipeline."""
        from tierzero.units import ROOT

        blocks = [u for u in self.units if u.name != ROOT]
        root = next((u for u in self.units if u.name == ROOT), None)
        micro_steps = self.cfg.gradient_accumulation_steps
        for micro in range(micro_steps):
            if self.cfg.zero.stage == 3:
                self._forward3(blocks, root)
                self._backward3(blocks, root, last=micro + 1 == micro_steps)
            else:
                self._backward12(list(reversed(blocks)) + ([root] if root else []))
        self._optimizer_step()

    def _gathered(self, unit: UnitSlices) -> int:
        return unit.padded_numel * self.itemsize

    def _start_gather(self, unit: UnitSlices, phase: Phase) -> None:
        self.alloc(Tier.DEVICE, self._gathered(unit), "gathered")
        self.params.acquire(unit.name, phase)

    def _forward3(self, blocks: list[UnitSlices], root: UnitSlices | None) -> None:
        order = ([root] if root else []) + blocks
        self.params.begin_step()
        self._start_gather(order[0], Phase.FORWARD)
        for i, unit in enumerate(order):
            self.params.done_with(unit.name)  # unshard: the gather has read the shard
            if i + 1 < len(order):
                self._start_gather(order[i + 1], Phase.FORWARD)  # Stage3._prefetch: the next unit
            if unit is not root:
                self.free(Tier.DEVICE, self._gathered(unit), "gathered")
        if root is not None:
            self.free(Tier.DEVICE, self._gathered(root), "gathered")

    def _backward3(self, blocks: list[UnitSlices], root: UnitSlices | None, *, last: bool) -> None:
        pending: list[UnitSlices] = []
        self._backward_step = StepPipeline(self) if last and self.in_backward else None
        if root is not None:
            self._start_gather(root, Phase.BACKWARD)
            self.params.done_with(root.name)
        backward = list(reversed(blocks))
        if backward:
            self._start_gather(backward[0], Phase.BACKWARD)
        for i, unit in enumerate(backward):
            self.params.done_with(unit.name)
            # The unit's pre-backward starts the next unit's gather before its own gradients are reduced.
            if i + 1 < len(backward):
                self._start_gather(backward[i + 1], Phase.BACKWARD)
            self._reduce(unit, pending)
            self.free(Tier.DEVICE, self._gathered(unit), "gathered")
        if root is not None:
            self._reduce(root, pending)
            self.free(Tier.DEVICE, self._gathered(root), "gathered")
        while pending:
            self._finish_reduce(pending.pop(0))
        if self._backward_step is not None:
            self._backward_step.flush()
            self._backward_step = None
        self.params.end_step()

    def _backward12(self, units: list[UnitSlices]) -> None:
        pending: list[UnitSlices] = []
        for unit in units:
            if self.cfg.zero.stage == 2:
                self._reduce(unit, pending)
            else:
                self.touch(unit.spec(Kind.GRAD), write=True)
                if self.world_size > 1:
                    self.alloc(Tier.DEVICE, unit.shard_numel * self.itemsize, "scratch")
        while pending:
            self._finish_reduce(pending.pop(0))
        if self.cfg.zero.stage == 1 and self.world_size > 1:
            for unit in units:
                self.free(Tier.DEVICE, unit.shard_numel * self.itemsize, "scratch")

    def _reduce(self, unit: UnitSlices, pending: list[UnitSlices]) -> None:
        """`Stage.reduce_grads`: added in place at world size 1; else a full gradient scratch and the reduce-scatter."""
        from tierzero.stages.base import MAX_REDUCES_IN_FLIGHT

        if self.world_size == 1:
            self.touch(unit.spec(Kind.GRAD), write=True)  # each gradient added in place
            self._grad_complete(unit)
            return
        self.alloc(Tier.DEVICE, unit.padded_numel * self.itemsize, "scratch")
        self.alloc(Tier.DEVICE, unit.shard_numel * self.itemsize, "scratch")
        pending.append(unit)
        bucket = self.cfg.zero.reduce_bucket_size
        while len(pending) > MAX_REDUCES_IN_FLIGHT and sum(u.padded_numel for u in pending) * self.itemsize > bucket:
            self._finish_reduce(pending.pop(0))

    def _finish_reduce(self, unit: UnitSlices) -> None:
        self.touch(unit.spec(Kind.GRAD), write=True)
        self.free(Tier.DEVICE, (unit.padded_numel + unit.shard_numel) * self.itemsize, "scratch")
        self._grad_complete(unit)

    def _grad_complete(self, unit: UnitSlices) -> None:
        """`Stage._grad_complete`: in a backward step, the unit's step starts now."""
        if self._backward_step is not None:
            self._backward_step.push(unit)

    def _optimizer_step(self) -> None:
        if self.in_backward:
            return  # every unit stepped during the backward
        if self.cfg.gradient_clipping > 0 or self.cfg.precision.param_dtype == "fp16":
            for unit in self.units:
                self.touch(unit.spec(Kind.GRAD), write=False)  # the global norm reads each GRAD slice
        # stages.step.run_step: the next forward's first units step first (stage 3).
        first = self.params.policy.first_units() if self.cfg.zero.stage == 3 else []
        head = [unit for name in first for unit in self.units if unit.name == name]
        pipeline = StepPipeline(self)
        for unit in head + [unit for unit in self.units if unit not in head]:
            pipeline.push(unit)
        pipeline.flush()

    def group(self, unit: UnitSlices) -> list[tuple[Any, Tier]]:
        """`stages.step.slice_group`: (slice, tier it is fetched to) for one unit's step."""
        tier = self.step_tier
        grad = unit.spec(Kind.GRAD)
        group = [(grad, tier if grad.home is Tier.NVME else grad.home)]
        if self.mixed:
            group.append((unit.spec(Kind.MASTER), tier))
        elif self.cfg.zero.stage == 3:
            group.append((unit.spec(Kind.PARAM), tier))
        group += [(s, tier) for s in unit.specs if s.kind not in (Kind.PARAM, Kind.GRAD, Kind.MASTER)]
        return group

    def read_group(self, group: list[tuple[Any, Tier]]) -> list[tuple[Any, Tier]]:
        for spec, tier in group:
            self.fetch(spec, to=tier)
        return group

    def drop_group(self, group: list[tuple[Any, Tier]]) -> None:
        for spec, tier in group:
            self.write_back(spec, src=tier)
            self.release(spec, to=tier)

    def compute(self, unit: UnitSlices) -> None:
        """`stages.step._step_unit`: fp32 gradient scratch unless the GRAD slice is fp32 in the
        step tier's memory, and an fp32 master copy in stages 1-2 off the device."""
        tier, shard = self.step_tier, unit.shard_numel * 4
        grads = self.cfg.offload.gradients
        grad_tier = tier if grads is Tier.NVME else grads
        in_place = not self.mixed and (grad_tier is tier or not torch.cuda.is_available())
        master_copy = not self.mixed and self.cfg.zero.stage < 3 and tier is not Tier.DEVICE
        scratch = (0 if in_place else shard) + (shard if master_copy else 0)
        if scratch:
            self.alloc(tier, scratch, "scratch")
            self.free(tier, scratch, "scratch")
        if self.mixed and self.cfg.zero.stage == 3:
            self.write_back(unit.spec(Kind.PARAM), src=tier)  # publish: the new compute-dtype shard, home
