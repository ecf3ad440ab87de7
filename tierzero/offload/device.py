"""The compute-device tier: CUDA memory, or host memory standing in for it.

See [Note: device memory never meets the NVMe tier] in tierzero/offload/memory.py.
"""

from __future__ import annotations

import torch

from tierzero.common.slices import Tier
from tierzero.config import DeviceTierConfig
from tierzero.offload.base import TierCapacityError
from tierzero.offload.memory import MemoryTier


class DeviceTier(MemoryTier):
    """The compute device: CUDA memory, or host memory standing in for it (see the note above)."""

    def __init__(self, *, device: torch.device | None = None, capacity: int | None = None) -> None:
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        if device.type == "cuda" and capacity is None:
            capacity = torch.cuda.get_device_properties(device).total_memory
        super().__init__(tier=Tier.DEVICE, capacity=capacity)
        self.device = device

    @classmethod
    def from_config(cls, section: DeviceTierConfig, *, device: torch.device | None = None) -> DeviceTier:
        """From the `tiers.device` section."""
        return cls(device=device, capacity=section.capacity)

    def _new_buffer(self, nbytes: int) -> torch.Tensor:
        try:
            return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as exc:
            # The budget said yes but the allocator said no (other users of the GPU,
            # fragmentation): report it in the tier's own terms.
            raise TierCapacityError(
                self.tier, need=nbytes, used=self._used - nbytes, capacity=self._capacity or 0
            ) from exc
