"""What the benchmarks move: slices of patterned bytes, I/O settings, and their fio twin.

`bench nvme` and `bench swap` share these: the sweep writes and reads `SliceSet`s
through an `NvmeTier` opened with a `SweepPoint`'s settings, and `fio_job` gives
fio the same settings.
"""

from __future__ import annotations

import enum
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from tierzero.cli.bench import pattern
from tierzero.cli.bench.fio import FioJob
from tierzero.common.sizes import format_size
from tierzero.common.slices import aligned_empty
from tierzero.offload.nvme import NvmeTier
from tierzero.placement.disk import setting_label

FIO_FILE = "tierzero-bench-fio.dat"
"""fio's data file, beside the tier's swap files in the benchmark directory."""


class Direction(enum.Enum):
    WRITE = "write"
    READ = "read"


class VerifyError(RuntimeError):
    """Bytes read back differ from the bytes written."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Setting:
    """The I/O settings fio shares: everything but the tierzero backend."""

    block_size: int
    queue_depth: int
    threads: int


@dataclass(frozen=True, slots=True, kw_only=True)
class SweepPoint:
    setting: Setting
    backend: str

    @property
    def label(self) -> str:
        s = self.setting
        return setting_label(
            block_size=s.block_size, queue_depth=s.queue_depth, threads=s.threads, backend=self.backend
        )


@dataclass(slots=True, kw_only=True)
class SliceSet:
    """The slices one pass moves: 4096-aligned sources of patterned bytes and read targets."""

    sources: list[torch.Tensor]
    targets: list[torch.Tensor]
    passes: int = 0

    @classmethod
    def make(cls, *, count: int, nbytes: int, seed: int) -> SliceSet:
        block = pattern.random_block(seed)
        sources = [aligned_empty(nbytes) for _ in range(count)]
        for i, src in enumerate(sources):
            # Shifted by an odd amount per slice, so two slices never hold the same bytes.
            pattern.fill(src, block=block.roll(i * 4097), stamp=i)
        return cls(sources=sources, targets=[aligned_empty(nbytes) for _ in range(count)])

    @property
    def nbytes(self) -> int:
        return sum(src.numel() for src in self.sources)

    def next_pass(self) -> None:
        """New page stamps, so a write that never reached the disk fails verification."""
        self.passes += 1
        for i, src in enumerate(self.sources):
            self.restamp(i, src)

    def restamp(self, i: int, tensor: torch.Tensor) -> None:
        """Give `tensor` (a copy of slice `i`, anywhere) the current pass's stamps, as its source has."""
        pattern.stamp_pages(tensor, stamp=(self.passes << 20) | i)

    def clear_targets(self) -> None:
        """Zero the read targets, so a read that moved nothing fails verification."""
        for dst in self.targets:
            dst.zero_()

    def verify(self, *, what: str, targets: list[torch.Tensor] | None = None) -> None:
        """Raise VerifyError naming the first slice whose read-back bytes (`targets`) differ from its source."""
        for i, (src, dst) in enumerate(zip(self.sources, self.targets if targets is None else targets)):
            mismatch = pattern.first_mismatch(dst.cpu(), src)
            if mismatch is not None:
                raise VerifyError(f"slice {i} read back wrong through {what}: {mismatch}")


def check_free_space(path: Path, *, need: int, what: str) -> None:
    """Stop before writing anything when `path` cannot hold `need` bytes."""
    if not path.is_dir():
        raise ValueError(f"--path {path} is not a directory: create it or pick another")
    free = shutil.disk_usage(path).free
    if free < need:
        raise ValueError(
            f"{what} needs {format_size(need)} at {path}, {format_size(free)} free: lower --size or pick another path"
        )


def open_tier(point: SweepPoint, *, path: Path, capacity: int, run_id: str) -> NvmeTier:
    """An NVMe tier with the point's settings; checksums off, the benchmark verifies the bytes itself."""
    s = point.setting
    return NvmeTier(
        path,
        capacity=capacity,
        run_id=run_id,
        block_size=s.block_size,
        queue_depth=s.queue_depth,
        threads=s.threads,
        verify=False,
        backend=point.backend,
    )


def fio_job(path: Path, setting: Setting, direction: Direction, nbytes: int) -> FioJob:
    """fio's twin of a setting: `threads` jobs sharing `queue_depth` I/Os in flight between them.

    The tier keeps at most `queue_depth` chunks in flight over all its threads, so each
    fio job gets an equal share of that depth rather than the whole of it.
    """
    return FioJob(
        path=path / FIO_FILE,
        direction=direction.value,
        total_bytes=nbytes,
        block_size=setting.block_size,
        iodepth=max(1, -(-setting.queue_depth // setting.threads)),
        numjobs=setting.threads,
    )
