"""A step's NVMe bytes against the disk's bandwidth, measured in the same run: the I/O floor.

A step whose state lives on NVMe cannot be faster than the time its bytes take to cross
the disk. `disk_bandwidth` measures that disk with the NvmeTier the engine uses (the
`tiers.nvme` defaults), a few sequential passes of writes then reads, so that a bench can
put its step time beside the floor its own bytes set, on the disk as it is that minute.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from tierzero.bench.nvme import timed_pass
from tierzero.bench.workload import Direction
from tierzero.config import TiersConfig
from tierzero.offload.nvme import NvmeTier
from tierzero.sizes import format_size
from tierzero.slices import IO_ALIGNMENT, aligned_empty

__all__ = ["DISK_BYTES", "IoFloor", "disk_bandwidth"]

#: Bytes `disk_bandwidth` moves each way per pass by default.
DISK_BYTES = 256 << 20
#: Seconds between its writes and its reads.
SETTLE_S = 3.0


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


def disk_bandwidth(
    path: str | Path, *, nbytes: int = DISK_BYTES, slices: int = 4, repeats: int = 3, settle_s: float = SETTLE_S
) -> tuple[float, float]:
    """(read, write) GB/s of `path`'s disk through an NvmeTier with the default settings: the medians
    of `repeats` passes writing `slices` slices of `nbytes` in all, submitted at once, then (after
    `settle_s`) of as many passes reading them back."""
    size = nbytes // slices // IO_ALIGNMENT * IO_ALIGNMENT
    if size == 0:
        raise ValueError(f"{format_size(nbytes)} in {slices} slices is under one {IO_ALIGNMENT}-byte block each")
    nvme = TiersConfig().nvme
    tier = NvmeTier(
        path, capacity=size * slices, block_size=nvme.block_size, queue_depth=nvme.queue_depth,
        threads=nvme.threads, backend=nvme.backend,
    )  # fmt: skip
    with tier:
        regions = [tier.allocate(size, label=f"bandwidth/{i}") for i in range(slices)]
        buffers = [aligned_empty(size) for _ in range(slices)]
        for i, buffer in enumerate(buffers):
            buffer.fill_(i + 1)
        writes = [timed_pass(tier, regions, buffers, Direction.WRITE) for _ in range(repeats)]
        # Bytes read back at once after being written come at a third of the speed on a virtio
        # disk (its host still writing them back); a step reads what it wrote a step ago.
        time.sleep(settle_s)
        reads = [timed_pass(tier, regions, buffers, Direction.READ) for _ in range(repeats)]
    return statistics.median(reads), statistics.median(writes)
