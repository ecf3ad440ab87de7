"""`tierzero bench load`: stream a pretrained checkpoint into the engine's slices, and measure it.

What the issue of fine-tuning asks of loading: the bytes read from the files equal the
checkpoint's size (nothing read twice), and the process's peak RSS stays within twice the
largest unit plus the tiers' host budgets, however large the model. `--cold` first drops
the files from the page cache (posix_fadvise), so that the disk's own counter
(/proc/self/io read_bytes) sees every byte the load takes.
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from tierzero.cli.config import parse_overrides
from tierzero.comm import dist as D
from tierzero.common.sizes import format_size
from tierzero.config import load_config
from tierzero.engine.engine import Engine
from tierzero.models.builtin import build_model
from tierzero.pretrained import PretrainedWeights

__all__ = ["LoadResult", "add_command", "bench_load", "command"]


@dataclass(frozen=True, slots=True)
class LoadResult:
    checkpoint_bytes: int
    """The safetensors files' sizes together."""
    requested_bytes: int
    """What the reader took from the files (whole rows of each tensor)."""
    disk_bytes: int
    """The kernel's count of bytes this process read from storage during the load."""
    seconds: float
    peak_rss: int
    start_rss: int
    """The process's RSS when the load began: the interpreter, torch and the meta-built model."""
    largest_unit_bytes: int
    """The largest unit's full buffer in fp32: what one unit's values take on the host."""
    host_budget: int
    """Host memory the config budgets: the cpu tier's capacity and the device tier's on a CPU-only
    run (where set), the swapper's staging buffers, the NVMe bounce blocks and prefetch.max_live_bytes."""
    parameters: int

    @property
    def rss_bound(self) -> int:
        """What the load may add to the process it starts in: two units' fp32 values (a unit's
        values and one of its zeroed states on their way to their homes), and the host budgets."""
        return self.start_rss + 2 * self.largest_unit_bytes + self.host_budget

    def format(self) -> str:
        ratio = self.requested_bytes / self.checkpoint_bytes
        return "\n".join(
            [
                f"loaded {self.parameters:,} parameters from {format_size(self.checkpoint_bytes)} of safetensors "
                f"in {self.seconds:.1f} s ({self.checkpoint_bytes / self.seconds / 1e9:.2f} GB/s)",
                f"read by the loader: {format_size(self.requested_bytes)} ({ratio:.4f}x the checkpoint); "
                f"from storage (/proc/self/io): {format_size(self.disk_bytes)} "
                f"({self.disk_bytes / self.checkpoint_bytes:.4f}x)",
                f"peak RSS {format_size(self.peak_rss)}; bound: RSS at the start ({format_size(self.start_rss)}) "
                f"+ 2 x largest unit ({format_size(self.largest_unit_bytes)}) + host budgets "
                f"({format_size(self.host_budget)}) = {format_size(self.rss_bound)}: "
                f"{'within' if self.peak_rss <= self.rss_bound else 'OVER'}",
            ]
        )


def bench_load(config: str, *, overrides: dict[str, Any], cold: bool) -> LoadResult:
    cfg = load_config(config, overrides=overrides)
    if cfg.model.pretrained is None:
        raise ValueError("bench load streams model.pretrained: set it in the config or with --set model.pretrained=DIR")
    files = sorted(Path(cfg.model.pretrained).glob("*.safetensors"))
    if cold:
        for path in files:
            _drop_from_page_cache(path)
    model = build_model(cfg.model, device="meta", seed=cfg.train.seed)
    process = psutil.Process()
    start_rss = process.memory_info().rss
    before = process.io_counters().read_bytes
    started = time.perf_counter()
    weights = PretrainedWeights.open(cfg.model.pretrained).for_model(model)
    weights.check(model)
    with Engine(model, cfg, ctx=D.setup(timeout_s=cfg.dist.timeout), weights=weights) as engine:
        seconds = time.perf_counter() - started
        disk = process.io_counters().read_bytes - before
        largest = max(unit.padded_numel for unit in engine.units) * 4
        parameters = sum(unit.numel for unit in engine.units)
    requested = weights.read.bytes
    # Host memory the config lets the store hold: the host tiers' capacities where set, the
    # swapper's staging buffers, the NVMe tier's bounce blocks and the prefetcher's resident slices.
    capacities = [cfg.tiers.cpu.capacity, cfg.tiers.device.capacity, cfg.prefetch.max_live_bytes]
    capacities.append(cfg.swapper.buffer_size * cfg.swapper.buffer_count)
    capacities.append(cfg.tiers.nvme.block_size * cfg.tiers.nvme.queue_depth)
    return LoadResult(
        checkpoint_bytes=sum(p.stat().st_size for p in files),
        requested_bytes=requested,
        disk_bytes=disk,
        seconds=seconds,
        peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        start_rss=start_rss,
        largest_unit_bytes=largest,
        host_budget=sum(int(c) for c in capacities if c is not None),
        parameters=parameters,
    )


def _drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench load`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "load", help="stream model.pretrained into the engine's slices: bytes read, seconds, peak RSS",
        description="Build the engine from a pretrained checkpoint as tierzero train does, and measure the load.",
    )
    parser.add_argument("--config", required=True, help="a config with model.pretrained (e.g. configs/finetune-oversized.yaml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one dotted config key")
    parser.add_argument("--cold", action="store_true", help="drop the checkpoint's files from the page cache first")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    result = bench_load(args.config, overrides=parse_overrides(args.set), cold=args.cold)
    print(result.format())
    return 0 if result.peak_rss <= result.rss_bound else 1
