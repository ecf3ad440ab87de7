"""The NVMe tier measured as training uses it: `TieredStore` write-backs and fetches of real slices.

At the sweep's best settings, slices homed on NVMe are written back from host
memory and fetched to it (direct, no staging), then fetched to the device and
written back from it (through the swapper's staging buffers). fio runs between
them with the same settings, so each path has a ratio to the fio run beside it
and to fio's best figure of the whole benchmark: the issue's target is at least
90% of fio's best, for both directions between the CPU tier and NVMe.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierzero.cli.bench.fio import run_fio
from tierzero.cli.bench.workload import Direction, SliceSet, SweepPoint, fio_job, open_tier
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.common.transfer import Transfer
from tierzero.offload.base import TierStorage
from tierzero.offload.cpu import CpuTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier
from tierzero.store import TieredStore
from tierzero.swapper import Swapper

TARGET_FRACTION = 0.9
"""The issue's bar: sustained NVMe reads and writes through the swapper at 90% of fio's best."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StorePath:
    """One way bytes move through the store, e.g. nvme->cpu."""

    source: Tier
    dest: Tier

    @property
    def name(self) -> str:
        return f"{self.source.value}->{self.dest.value}"

    @property
    def direction(self) -> Direction:
        return Direction.WRITE if self.dest is Tier.NVME else Direction.READ


CPU_WRITE = StorePath(source=Tier.CPU, dest=Tier.NVME)
CPU_READ = StorePath(source=Tier.NVME, dest=Tier.CPU)
DEVICE_WRITE = StorePath(source=Tier.DEVICE, dest=Tier.NVME)
DEVICE_READ = StorePath(source=Tier.NVME, dest=Tier.DEVICE)
PATHS = (CPU_WRITE, DEVICE_WRITE, CPU_READ, DEVICE_READ)


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreParts:
    """A store and its tiers, kept in hand so that a benchmark can check their accounting."""

    store: TieredStore
    device: TierStorage
    cpu: TierStorage
    nvme: NvmeTier
    """Its `run_dir` tells where its files are."""

    def close(self) -> None:
        self.store.close()


def open_store(
    point: SweepPoint,
    *,
    path: Path,
    nvme_capacity: int,
    buffer_size: int,
    buffer_count: int,
    run_id: str,
    device_capacity: int | None = None,
    cpu_capacity: int | None = None,
    cpu_reuse_limit: int | None = None,
) -> StoreParts:
    """A store with all three tiers, the NVMe tier opened with `point`'s settings.

    `cpu_reuse_limit` None keeps the CPU tier's default (what training gets).
    """
    reuse = {} if cpu_reuse_limit is None else {"reuse_limit": cpu_reuse_limit}
    cpu = CpuTier(capacity=cpu_capacity, **reuse)
    device = DeviceTier(capacity=device_capacity)
    nvme = open_tier(point, path=path, capacity=nvme_capacity, run_id=run_id)
    swapper = Swapper(buffer_size=buffer_size, buffer_count=buffer_count, host=cpu)
    store = TieredStore(tiers={Tier.DEVICE: device, Tier.CPU: cpu, Tier.NVME: nvme}, swapper=swapper)
    return StoreParts(store=store, device=device, cpu=cpu, nvme=nvme)


@dataclass(slots=True, kw_only=True)
class PathRuns:
    path: StorePath
    gbps: list[float] = field(default_factory=list)
    fio_gbps: list[float] = field(default_factory=list)
    cold_gbps: float | None = None
    """The warm-up pass, which also pays for first touching the fetched copies' memory."""

    def to_json(self, *, fio_best: dict[str, float | None]) -> dict[str, Any]:
        median = statistics.median(self.gbps)
        best = fio_best.get(self.path.direction.value)
        beside = statistics.median(m / f for m, f in zip(self.gbps, self.fio_gbps)) if self.fio_gbps else None
        return {
            "path": self.path.name,
            "direction": self.path.direction.value,
            "GBps": median,
            "samples": self.gbps,
            "cold_GBps": self.cold_gbps,
            "fio_GBps": statistics.median(self.fio_gbps) if self.fio_gbps else None,
            "vs_fio": beside,
            "vs_fio_best": median / best if best else None,
        }


@dataclass(slots=True, kw_only=True)
class StoreBench:
    """Times the four paths at one sweep point, alternating with fio; verifies every read."""

    store: TieredStore
    point: SweepPoint
    data: SliceSet
    fio_path: Path
    fio: str | None
    on_step: Callable[[], None]
    runs: dict[str, PathRuns] = field(default_factory=dict)
    warming: bool = False

    def __post_init__(self) -> None:
        self.runs = {p.name: PathRuns(path=p) for p in PATHS}
        for i, src in enumerate(self.data.sources):
            self.store.register(self._key(i), numel=src.numel(), dtype=torch.uint8, home=Tier.NVME)

    @staticmethod
    def steps_per_repeat(*, fio: bool) -> int:
        return len(PATHS) + 1 + (2 if fio else 0)

    @staticmethod
    def warm_up_steps() -> int:
        return len(PATHS) + 1

    def warm_up(self) -> None:
        """One pass of every path, reported apart as `cold_GBps`: the figures that follow are
        sustained ones, as in training, where the CPU tier hands back memory it already touched."""
        self.warming = True
        try:
            self.data.next_pass()
            self._cpu_write()
            self._cpu_read()
            self._device_round_trip()
            self.on_step()
        finally:
            self.warming = False

    def repeat(self, *, fio_first: bool) -> None:
        """One pass of every path; fio runs before each cpu path or after it, alternating by repeat."""
        self.data.next_pass()
        for direction, step in ((Direction.WRITE, self._cpu_write), (Direction.READ, self._cpu_read)):
            if fio_first:
                self._fio(direction)
            step()
            if not fio_first:
                self._fio(direction)
        self._device_round_trip()
        self.on_step()

    def _cpu_write(self) -> None:
        self._time(CPU_WRITE, lambda i, key: self.store.write_back(key, self.data.sources[i]))

    def _cpu_read(self) -> None:
        fetched = self._time(CPU_READ, lambda i, key: self.store.fetch(key, to=Tier.CPU))
        self.data.verify(what=f"the store ({CPU_READ.name})", targets=fetched)
        self._release_all()

    def _device_round_trip(self) -> None:
        """nvme->device, new stamps on the device copies, device->nvme; then read back to cpu, untimed."""
        on_device = self._time(DEVICE_READ, lambda i, key: self.store.fetch(key, to=Tier.DEVICE))
        self.data.verify(what=f"the store ({DEVICE_READ.name})", targets=on_device)
        self.data.next_pass()
        for i, copy in enumerate(on_device):
            self.data.restamp(i, copy.view(torch.uint8))
        self._time(DEVICE_WRITE, lambda i, key: self.store.write_back(key))
        self._release_all()
        back = [self.store.fetch(self._key(i), to=Tier.CPU).wait() for i in range(len(self.data.sources))]
        self.data.verify(what=f"the store ({DEVICE_WRITE.name}, read back)", targets=back)
        self._release_all()

    def close(self) -> None:
        for i in range(len(self.data.sources)):
            self.store.unregister(self._key(i))

    def to_json(self, *, fio_best: dict[str, float | None]) -> dict[str, Any]:
        """`fio_best`: fio's best median GB/s of the whole benchmark by direction ("read", "write")."""
        s = self.point.setting
        stats = self.store.swapper.stats()
        paths = [runs.to_json(fio_best=fio_best) for runs in self.runs.values()]
        return {
            "settings": {"block_size": s.block_size, "queue_depth": s.queue_depth, "threads": s.threads, "backend": self.point.backend},
            "paths": paths,
            "staging": {"buffer_size": stats.buffer_size, "buffer_count": stats.buffer_count, "peak_held": stats.peak_held},
            "fio_best_GBps": fio_best,
            "target": target_json(paths),
        }

    def fio_medians(self) -> dict[str, float]:
        """fio's median GB/s beside this benchmark, by direction."""
        return {
            runs.path.direction.value: statistics.median(runs.fio_gbps) for runs in self.runs.values() if runs.fio_gbps
        }

    def _key(self, i: int) -> SliceKey:
        return SliceKey(unit=f"bench.{i}", kind=Kind.MASTER)

    def _time(self, path: StorePath, start: Callable[[int, SliceKey], Transfer]) -> list[torch.Tensor]:
        """Starts the transfer of every slice, waits for all; records GB/s; returns their values."""
        begin = time.perf_counter()
        transfers = [start(i, self._key(i)) for i in range(len(self.data.sources))]
        values = [t.wait() for t in transfers]
        gbps = self.data.nbytes / (time.perf_counter() - begin) / 1e9
        if self.warming:
            self.runs[path.name].cold_gbps = gbps
        else:
            self.runs[path.name].gbps.append(gbps)
        self.on_step()
        return values

    def _fio(self, direction: Direction) -> None:
        if self.fio is None:
            return
        job = fio_job(self.fio_path, self.point.setting, direction, self.data.nbytes)
        gbps = run_fio(job, executable=self.fio).gbps
        for runs in self.runs.values():
            if runs.path.direction is direction:
                runs.fio_gbps.append(gbps)
        self.on_step()

    def _release_all(self) -> None:
        for i in range(len(self.data.sources)):
            self.store.release(self._key(i))


def target_json(paths: list[dict[str, Any]]) -> dict[str, Any]:
    """Whether cpu<->nvme through the store reaches 90% of fio's best, read and write."""
    ratios = {p["direction"]: p["vs_fio_best"] for p in paths if p["path"] in (CPU_READ.name, CPU_WRITE.name)}
    known = [r for r in ratios.values() if r is not None]
    return {
        "fraction": TARGET_FRACTION,
        "read_vs_fio_best": ratios.get("read"),
        "write_vs_fio_best": ratios.get("write"),
        "met": bool(known) and len(known) == len(ratios) and min(known) >= TARGET_FRACTION,
    }


def through_store_lines(section: dict[str, Any]) -> list[str]:
    lines = ["through the store (TieredStore + Swapper, real slices):"]
    for p in section["paths"]:
        beside = "-" if p["vs_fio"] is None else f"{p['vs_fio']:.0%}"
        best = "-" if p["vs_fio_best"] is None else f"{p['vs_fio_best']:.0%}"
        cold = "-" if p["cold_GBps"] is None else f"{p['cold_GBps']:.2f}"
        lines.append(
            f"  {p['path']:<13} {p['GBps']:6.2f} GB/s   vs fio beside it {beside:>5}   vs fio best {best:>5}"
            f"   (warm-up pass {cold} GB/s)"
        )
    target = section["target"]
    if target["read_vs_fio_best"] is None:
        lines.append("  target (90% of fio's best): not checked, fio did not run")
    else:
        verdict = "met" if target["met"] else "NOT met"
        lines.append(
            f"  target (90% of fio's best) {verdict}: read {target['read_vs_fio_best']:.0%}, "
            f"write {target['write_vs_fio_best']:.0%}"
        )
    return lines
