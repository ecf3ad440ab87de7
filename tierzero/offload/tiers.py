"""The tiers a run's `tiers` section asks for: device, cpu, and NVMe when some state lives there."""

from __future__ import annotations

import torch

from tierzero.common.slices import Tier
from tierzero.config import TiersConfig
from tierzero.offload.base import TierStorage
from tierzero.offload.cpu import CpuTier, HostDeviceTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier

__all__ = ["tiers_from_config"]


def tiers_from_config(
    tiers: TiersConfig,
    *,
    nvme: bool,
    rank: int = 0,
    device: torch.device | None = None,
    nvme_capacity: int | None = None,
    run_id: str | None = None,
) -> dict[Tier, TierStorage]:
    """Device and cpu tiers always (the device is host memory when `device` is the CPU, or
    without CUDA), the NVMe tier when `nvme`; see `TieredStore.from_config`."""
    cpu = CpuTier.from_config(tiers.cpu)
    on_host = (device.type == "cpu") if device is not None else not torch.cuda.is_available()
    device_tier = (
        HostDeviceTier(capacity=tiers.device.capacity) if on_host else DeviceTier.from_config(tiers.device, device=device)
    )
    storages: dict[Tier, TierStorage] = {Tier.DEVICE: device_tier, Tier.CPU: cpu}
    if nvme:
        storages[Tier.NVME] = NvmeTier.from_config(tiers.nvme, rank=rank, capacity=nvme_capacity, run_id=run_id)
    return storages
