"""A step's NVMe bytes against the disk's bandwidth, measured in the same run: the I/O floor.

A step whose state lives on NVMe cannot be faster than the time its bytes take to cross
the disk. `tierzero.placement.disk.probe` measures that disk with the NvmeTier the engine uses (the
`tiers.nvme` defaults), a few sequential passes of writes then reads, so that a bench can
put its step time beside the floor its own bytes set, on the disk as it is that minute.
"""

from __future__ import annotations

from dataclasses import dataclass

from tierzero.common.sizes import format_size

__all__ = ["IoFloor"]



@dataclass(frozen=True, slots=True, kw_only=True)
class IoFloor:
    """One step's NVMe traffic and the disk's bandwidth: the least time those bytes need."""

    read_bytes: float
    written_bytes: float
    read_gbs: float
    write_gbs: float
    parameters: int
    home_bytes: int
    """What the NVMe tier holds: a step that moves each byte once each way reads and writes this much."""

    @property
    def serial_s(self) -> float:
        """Reads and writes one after the other (`tierzero estimate`'s floor)."""
        return (self.read_bytes / self.read_gbs + self.written_bytes / self.write_gbs) / 1e9

    @property
    def overlapped_s(self) -> float:
        """Reads and writes at once, each at its full rate: the least any schedule can take."""
        return max(self.read_bytes / self.read_gbs, self.written_bytes / self.write_gbs) / 1e9

    def lines(self, step_s: float) -> list[str]:
        per = max(self.parameters, 1)
        return [
            f"  NVMe per step  read {format_size(int(self.read_bytes))} ({self.read_bytes / per:.1f} B/param, "
            f"{self.read_bytes / self.home_bytes:.2f}x what it holds)   written {format_size(int(self.written_bytes))} "
            f"({self.written_bytes / per:.1f} B/param, {self.written_bytes / self.home_bytes:.2f}x)",
            f"  disk (this run) read {self.read_gbs:.2f} GB/s, write {self.write_gbs:.2f} GB/s: I/O floor "
            f"{self.serial_s * 1e3:.0f} ms serial, {self.overlapped_s * 1e3:.0f} ms overlapped; "
            f"step {step_s / self.serial_s:.2f}x the serial floor",
        ]
