"""Tier budgets from the machine: what each tier may hold when the config gives no capacity.

An explicit `tiers.<tier>.capacity` always wins. Otherwise the device tier takes the GPU's
free memory, the cpu tier the memory this process may still take (psutil's available
memory, or the headroom under a cgroup limit where that is less), and the nvme tier the
free space at `tiers.nvme.path`; the memory tiers hold a margin back. Each budget says
where its figure came from. A capacity is one rank's, a figure from the machine is shared
by the ranks on it: dividing it among them is the planner's part.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import torch

from tierzero.common.cgroup import cgroup_memory
from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier
from tierzero.config import CpuTierConfig, DeviceTierConfig, NvmeTierConfig, TiersConfig
from tierzero.config.checks import GiB
from tierzero.estimate.machines import Machine
from tierzero.offload.disk.files import free_space

__all__ = ["CPU_MARGIN", "DEVICE_MARGIN", "MachineBudgets", "Margin", "TierBudget", "machine_budgets", "target_budgets"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Margin:
    """What a memory tier's budget holds back: the larger of a floor and a share of the figure it is taken from."""

    floor: int
    percent: int

    def of(self, nbytes: int) -> int:
        """Bytes held back from a figure of `nbytes` (integer arithmetic, so exact)."""
        return max(self.floor, nbytes * self.percent // 100)

    def __str__(self) -> str:
        return f"max({format_size(self.floor)}, {self.percent}%)"


CPU_MARGIN = Margin(floor=2 * GiB, percent=10)
"""Host memory outside the store's count. The interpreter, torch and its libraries take about
1 GiB before any state, and training adds autograd's gradients before the store takes them
and the allocator's slack: the 2B preset's process held 1.4 GiB beyond the store's peak and
its activations, and a 1 GiB floor had it killed under a 12 GiB cgroup. The data pipeline,
a checkpoint's buffers and the page cache of the NVMe tier's files grow with the run, hence
a tenth besides."""

DEVICE_MARGIN = Margin(floor=2 * GiB, percent=10)
"""Device memory outside model state: the activations autograd saves (booked in the device
tier by tierzero/stages/activations.py, but not known before a model is planned), the caching
allocator's fragmentation and the collectives' buffers (NCCL takes a few hundred MiB per
communicator). The CUDA context is already out of the free figure."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TierBudget:
    """Bytes of model state one tier may hold, and where that figure came from."""

    tier: Tier
    nbytes: int | None
    """None: neither the config nor the machine gives a figure (the source says why)."""
    source: str
    """E.g. 'tiers.cpu.capacity', 'psutil available 20.1 GiB, less 2.0 GiB margin (...); no cgroup memory limit'."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MachineBudgets:
    """The budget of each tier: from the config where it gives a capacity, else from the machine."""

    device: TierBudget
    cpu: TierBudget
    nvme: TierBudget

    def by_tier(self) -> dict[Tier, TierBudget]:
        return {b.tier: b for b in (self.device, self.cpu, self.nvme)}

    def lines(self) -> list[str]:
        """A small table of the budgets and their sources, as `tierzero estimate` prints it."""
        rows = [["tier", "budget", "from"]]
        for tier, budget in self.by_tier().items():
            rows.append([tier.value, "-" if budget.nbytes is None else format_size(budget.nbytes), budget.source])
        widths = [max(len(r[i]) for r in rows) for i in range(2)]
        table = [f"{r[0].ljust(widths[0])}  {r[1].rjust(widths[1])}  {r[2]}" for r in rows]
        return ["budgets (a capacity is a rank's; the machine's figures are shared by its ranks):", *table]

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {t.value: {"bytes": b.nbytes, "source": b.source} for t, b in self.by_tier().items()}


def machine_budgets(
    tiers: TiersConfig,
    *,
    device: torch.device | None = None,
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    proc_self_cgroup: Path = Path("/proc/self/cgroup"),
) -> MachineBudgets:
    """Each tier's budget: its configured capacity, else what this machine offers it.

    `device` is the compute device (default: the current CUDA device, else the host standing
    in for it). A cgroup file that is not a byte count raises ValueError naming the file.
    """
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return MachineBudgets(
        device=_device_budget(tiers.device, device),
        cpu=_cpu_budget(tiers.cpu, cgroup_root=cgroup_root, proc_self_cgroup=proc_self_cgroup),
        nvme=_nvme_budget(tiers.nvme),
    )


def target_budgets(tiers: TiersConfig, machine: Machine) -> MachineBudgets:
    """Each tier's budget on `machine` (`tierzero estimate --machine`): its configured capacity, else
    the machine's figure (the GPU's memory and the host's less their margins, the disk's free space);
    nothing of this host is read."""
    assert machine.gpu_memory is not None and machine.host_memory is not None and machine.disk_free is not None
    budgets = []
    for tier, section, figure, margin, what in (
        (Tier.DEVICE, tiers.device, machine.gpu_memory, DEVICE_MARGIN, "GPU memory"),
        (Tier.CPU, tiers.cpu, machine.host_memory, CPU_MARGIN, "host memory"),
        (Tier.NVME, tiers.nvme, machine.disk_free, None, "free disk"),
    ):
        if section.capacity is not None:
            budgets.append(TierBudget(tier=tier, nbytes=section.capacity, source=f"tiers.{tier.value}.capacity"))
            continue
        held = 0 if margin is None else margin.of(figure)
        less = "" if margin is None else f", less {format_size(held)} margin ({margin})"
        source = f"{machine.name}'s {what} {format_size(figure)}{less}"
        budgets.append(TierBudget(tier=tier, nbytes=figure - held, source=source))
    device, cpu, nvme = budgets
    return MachineBudgets(device=device, cpu=cpu, nvme=nvme)


def _device_budget(section: DeviceTierConfig, device: torch.device) -> TierBudget:
    if section.capacity is not None:
        return TierBudget(tier=Tier.DEVICE, nbytes=section.capacity, source="tiers.device.capacity")
    if device.type != "cuda":
        why = "the host stands in for the device" if device.type == "cpu" else f"no free-memory figure for {device}"
        source = f"none from the machine ({why}): set tiers.device.capacity"
        return TierBudget(tier=Tier.DEVICE, nbytes=None, source=source)
    free, total = torch.cuda.mem_get_info(device)
    margin = DEVICE_MARGIN.of(free)
    source = (
        f"{device} free {format_size(free)} of {format_size(total)}, less {format_size(margin)} margin "
        f"({DEVICE_MARGIN}: activations and the allocator)"
    )
    return TierBudget(tier=Tier.DEVICE, nbytes=max(0, free - margin), source=source)


def _cpu_budget(section: CpuTierConfig, *, cgroup_root: Path, proc_self_cgroup: Path) -> TierBudget:
    if section.capacity is not None:
        return TierBudget(tier=Tier.CPU, nbytes=section.capacity, source="tiers.cpu.capacity")
    available = psutil.virtual_memory().available
    cgroup = cgroup_memory(cgroup_root=cgroup_root, proc_self_cgroup=proc_self_cgroup)
    psutil_said = f"psutil available {format_size(available)}"
    if cgroup is None:
        figure, said, note = available, psutil_said, "no cgroup memory limit"
    elif cgroup.headroom < available:
        figure, said, note = cgroup.headroom, cgroup.describe(), f"{psutil_said} is more"
    else:
        figure, said, note = available, psutil_said, f"the {cgroup.describe()} leaves more"
    margin = CPU_MARGIN.of(figure)
    source = f"{said}, less {format_size(margin)} margin ({CPU_MARGIN}); {note}"
    return TierBudget(tier=Tier.CPU, nbytes=max(0, figure - margin), source=source)


def _nvme_budget(section: NvmeTierConfig) -> TierBudget:
    if section.capacity is not None:
        return TierBudget(tier=Tier.NVME, nbytes=section.capacity, source="tiers.nvme.capacity")
    if section.path is None:
        return TierBudget(tier=Tier.NVME, nbytes=None, source="none: tiers.nvme.path is not set")
    free = free_space(section.path)
    if free is None:
        return TierBudget(tier=Tier.NVME, nbytes=None, source=f"none: the free space of {section.path} cannot be read")
    return TierBudget(tier=Tier.NVME, nbytes=free, source=f"free space of {section.path}")
