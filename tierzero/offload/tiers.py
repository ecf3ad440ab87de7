"""The tiers a run's `tiers` section asks for: device, cpu, and NVMe when some state lives there.

`TIER_CLASSES` names the class behind each tier, so that what a kind of tier can do (its
`TierTraits`) is known before any tier exists: the slice plan and the estimate ask `traits_of`.
A new tier is its class, its config section and its line here.
"""

from __future__ import annotations

import torch

from tierzero.common.slices import Tier
from tierzero.config import TiersConfig
from tierzero.offload.base import TierStorage, TierTraits
from tierzero.offload.cpu import CpuTier, HostDeviceTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier

__all__ = ["TIER_CLASSES", "tiers_from_config", "traits_of"]

TIER_CLASSES: dict[Tier, type[TierStorage]] = {Tier.DEVICE: DeviceTier, Tier.CPU: CpuTier, Tier.NVME: NvmeTier}
"""The class of each tier (without a GPU the device tier is `HostDeviceTier`, with the same traits)."""


def traits_of(tier: Tier) -> TierTraits:
    """What `tier` can do, from its class."""
    return TIER_CLASSES[tier].traits


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
        HostDeviceTier(capacity=tiers.device.capacity, reuse_slack=tiers.cpu.keep_freed)
        if on_host
        else DeviceTier.from_config(tiers.device, device=device)
    )
    storages: dict[Tier, TierStorage] = {Tier.DEVICE: device_tier, Tier.CPU: cpu}
    if nvme:
        storages[Tier.NVME] = NvmeTier.from_config(tiers.nvme, rank=rank, capacity=nvme_capacity, run_id=run_id)
    return storages
