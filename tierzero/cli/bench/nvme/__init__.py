"""`tierzero bench nvme`: sweep the NVMe tier's I/O settings against fio, side by side.

For every (block size, queue depth, threads) setting, each repeat writes and then
reads the same slices through an `NvmeTier` per backend, then runs fio with the
same settings, so that tierzero and fio see the same minute of a noisy disk.
Medians of the repeats are reported, and the ratio to fio is the median of the
per-repeat ratios (each tierzero run against the fio run beside it).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections.abc import Callable
from contextlib import ExitStack, closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
from tqdm import tqdm

from tierzero.cli.bench.fio import fio_executable, fio_version, run_fio
from tierzero.cli.bench.nvme import report as sweep_report
from tierzero.cli.bench.nvme.results import PointResult
from tierzero.cli.bench.report import format_table, machine_info, now_text, nvme_config_snippet, write_json, write_plot
from tierzero.cli.bench.through_store import StoreBench, open_store, through_store_lines
from tierzero.cli.bench.workload import (
    FIO_FILE,
    Direction,
    Setting,
    SliceSet,
    SweepPoint,
    VerifyError,
    check_free_space,
    fio_job,
    open_tier,
)
from tierzero.common.sizes import format_size, parse_size
from tierzero.offload.base import Region
from tierzero.offload.nvme import NvmeTier
from tierzero.placement.disk import remember, timed_moves


@dataclass(frozen=True, slots=True, kw_only=True)
class Grid:
    block_sizes: tuple[int, ...]
    queue_depths: tuple[int, ...]
    threads: tuple[int, ...]
    backends: tuple[str, ...]

    def settings(self) -> list[Setting]:
        product = itertools.product(self.block_sizes, self.queue_depths, self.threads)
        return [Setting(block_size=b, queue_depth=q, threads=t) for b, q, t in product]


#: 12 settings x 2 backends: the block sizes where direct I/O on this class of disk
#: levels off, and enough parallelism to keep a virtio or NVMe queue busy.
DEFAULT_GRID = Grid(
    block_sizes=(1 << 20, 4 << 20, 8 << 20), queue_depths=(4, 16), threads=(4, 8), backends=("pread", "aiofiles")
)
QUICK_GRID = Grid(block_sizes=(1 << 20,), queue_depths=(4,), threads=(2,), backends=("pread", "aiofiles"))


def slice_bytes(*, size: int, slices: int, grid: Grid) -> int:
    """Bytes per slice: `size` split in `slices`, each a whole number of every fio job's share."""
    if slices < 1:
        raise ValueError(f"--slices must be >= 1, got {slices}")
    quantum = math.lcm(*grid.block_sizes) * math.lcm(*grid.threads)
    per_slice = size // slices // quantum * quantum
    if per_slice == 0:
        raise ValueError(
            f"--size {format_size(size)} in {slices} slices is under {format_size(quantum)} per slice "
            f"(a block per thread for every setting): raise --size to at least {format_size(quantum * slices)}"
        )
    return per_slice


def timed_pass(tier: NvmeTier, regions: list[Region], buffers: list[torch.Tensor], direction: Direction) -> float:
    """GB/s of moving all slices at once, as the swapper does: all submitted, then all awaited."""
    return timed_moves(tier.submit_write if direction is Direction.WRITE else tier.submit_read, regions, buffers)


@dataclass(slots=True, kw_only=True)
class Lane:
    """One backend at the current setting: its tier, the slices' regions in it, its results."""

    tier: NvmeTier
    regions: list[Region]
    result: PointResult


@dataclass(slots=True, kw_only=True)
class Sweep:
    """Runs the grid: owns the slices, the fio data file and the progress bar."""

    path: Path
    grid: Grid
    repeats: int
    data: SliceSet
    fio: str | None
    progress: tqdm

    @property
    def steps(self) -> int:
        per_repeat = len(self.grid.backends) + (self.fio is not None)
        return len(self.grid.settings()) * self.repeats * len(Direction) * per_repeat

    def run(self) -> list[PointResult]:
        results: list[PointResult] = []
        for setting in self.grid.settings():
            results.extend(self._run_setting(setting))
        return results

    def _run_setting(self, setting: Setting) -> list[PointResult]:
        with ExitStack() as stack:
            lanes = []
            for backend in self.grid.backends:
                point = SweepPoint(setting=setting, backend=backend)
                tier = open_tier(point, path=self.path, capacity=self.data.nbytes, run_id=f"tz-bench-{os.getpid()}-{backend}")
                stack.enter_context(closing(tier))
                regions = [tier.allocate(src.numel(), label=f"bench/{i}") for i, src in enumerate(self.data.sources)]
                stack.callback(lambda t=tier, rs=regions: [t.free(r) for r in rs])
                lanes.append(Lane(tier=tier, regions=regions, result=PointResult(point=point)))
            for repeat in range(self.repeats):
                self._one_repeat(setting, lanes, fio_first=repeat % 2 == 1)
        return [lane.result for lane in lanes]

    def _one_repeat(self, setting: Setting, lanes: list[Lane], *, fio_first: bool) -> None:
        """Writes then reads, each by every backend and by fio; who goes first alternates by repeat,
        so that neither always reads what was written just before it."""
        self.data.next_pass()
        for direction in Direction:
            if fio_first:
                self._fio(setting, direction, lanes)
            for lane in lanes:
                self._tierzero(lane, direction)
            if not fio_first:
                self._fio(setting, direction, lanes)

    def _tierzero(self, lane: Lane, direction: Direction) -> None:
        if direction is Direction.READ:
            self.data.clear_targets()
        buffers = self.data.sources if direction is Direction.WRITE else self.data.targets
        lane.result.runs(direction).gbps.append(timed_pass(lane.tier, lane.regions, buffers, direction))
        if direction is Direction.READ:
            self.data.verify(what=f"the NvmeTier ({lane.result.point.label})")
        self.progress.update()

    def _fio(self, setting: Setting, direction: Direction, lanes: list[Lane]) -> None:
        if self.fio is None:
            return
        gbps = run_fio(fio_job(self.path, setting, direction, self.data.nbytes), executable=self.fio).gbps
        for lane in lanes:
            lane.result.runs(direction).fio_gbps.append(gbps)
        self.progress.update()


def best_point(results: list[PointResult]) -> PointResult:
    return max(results, key=lambda r: r.score)


@dataclass(frozen=True, slots=True, kw_only=True)
class NvmeBenchOptions:
    path: Path
    size: int
    slices: int
    repeats: int
    grid: Grid
    seed: int
    use_fio: bool
    through_store: bool
    cpu_reuse_limit: int | None
    """The CPU tier's `reuse_limit` in the store measurement; None for its default."""
    progress: bool
    json_path: Path | None
    plot_path: Path | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> NvmeBenchOptions:
        if args.repeats is not None and args.repeats < 1:
            raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
        return cls(
            path=Path(args.path),
            size=parse_size(args.size),
            slices=args.slices,
            repeats=args.repeats or (1 if args.quick else 3),
            grid=QUICK_GRID if args.quick else DEFAULT_GRID,
            seed=args.seed,
            use_fio=not args.no_fio,
            through_store=not args.no_store,
            cpu_reuse_limit=None if args.cpu_reuse_limit is None else parse_size(args.cpu_reuse_limit),
            progress=not args.no_progress,
            json_path=Path(args.json) if args.json else None,
            plot_path=Path(args.plot) if args.plot else None,
        )


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench nvme`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "nvme", help="sweep NVMe tier settings against fio; print the best as config",
        description="Sweep block size x queue depth x threads x backend through the NVMe tier, beside fio.",
    )
    parser.add_argument("--path", required=True, help="directory on the disk to measure (files are removed after)")
    parser.add_argument("--size", default="4GiB", help="bytes moved per pass, split in --slices slices (default 4GiB)")
    parser.add_argument("--slices", type=int, default=4, help="slices per pass (default 4)")
    parser.add_argument("--repeats", type=int, default=None, help="repeats per point (default 3, 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the test bytes")
    parser.add_argument("--json", help="write the results as JSON here")
    parser.add_argument("--plot", help="write a PNG plot here")
    parser.add_argument("--quick", action="store_true", help="a tiny grid, one repeat (for tests)")
    parser.add_argument("--no-fio", action="store_true", help="skip fio even where it is installed")
    parser.add_argument("--no-store", action="store_true", help="skip the measurement through the store")
    parser.add_argument(
        "--cpu-reuse-limit", help="CPU tier's reuse_limit in the store measurement (default: the tier's own default)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    opts = NvmeBenchOptions.from_args(args)
    try:
        report = run_bench(opts)
    except VerifyError as exc:
        print(f"bench nvme: FAILED: {exc}", file=sys.stderr)
        return 1
    if opts.json_path is not None:
        write_json(report, opts.json_path)
    return 0


def run_bench(opts: NvmeBenchOptions, *, out: TextIO | None = None) -> dict[str, Any]:
    """Sweep, measure through the store at the best point, print the results; returns the JSON report."""
    grid = opts.grid
    per_slice = slice_bytes(size=opts.size, slices=opts.slices, grid=grid)
    fio = fio_executable() if opts.use_fio else None
    files = len(grid.backends) + (fio is not None)
    check_free_space(opts.path, need=per_slice * opts.slices * files, what="bench nvme")
    data = SliceSet.make(count=opts.slices, nbytes=per_slice, seed=opts.seed)
    store_bench = None
    with tqdm(desc="bench nvme", unit="run", disable=None if opts.progress else True, file=sys.stderr) as bar:
        sweep = Sweep(path=opts.path, grid=grid, repeats=opts.repeats, data=data, fio=fio, progress=bar)
        store_steps = StoreBench.warm_up_steps() + opts.repeats * StoreBench.steps_per_repeat(fio=fio is not None)
        bar.total = sweep.steps + (store_steps if opts.through_store else 0)
        try:
            results = sweep.run()
            best = best_point(results)
            if opts.through_store:
                store_bench = measure_through_store(opts, best.point, data=data, fio=fio, on_step=bar.update)
        finally:
            (opts.path / FIO_FILE).unlink(missing_ok=True)
    fio_part = None
    if fio is not None:
        depths = {s: fio_job(opts.path, s, Direction.READ, data.nbytes).iodepth for s in grid.settings()}
        fio_part = sweep_report.fio_json(results, version=fio_version(fio), iodepth=depths)
    report = {
        "best": sweep_report.best_json(best),
        "runs": sweep_report.runs_json(results),
        "fio": fio_part,
        "through_store": None if store_bench is None else store_bench.to_json(fio_best=fio_best(fio_part, store_bench)),
        "settings": {
            "size": data.nbytes, "slices": opts.slices, "repeats": opts.repeats, "seed": opts.seed,
            "cpu_reuse_limit": opts.cpu_reuse_limit,
        },
        "machine": machine_info(opts.path, fio=fio_part["version"] if fio_part else None),
        "date": now_text(),
    }
    print_summary(report, results, best, out=out or sys.stdout)
    # The planner (`offload: auto`) reads these for this directory, at its config's setting, instead of probing it.
    remember(opts.path, {r.point.label: (r.read.median, r.write.median) for r in results}, how="bench nvme")
    if opts.plot_path is not None:
        title = f"tierzero NVMe tier vs fio, {format_size(data.nbytes)} per pass, medians of {opts.repeats}"
        write_plot(sweep_report.plot_bars(results), opts.plot_path, title=title)
    return report


def measure_through_store(
    opts: NvmeBenchOptions, point: SweepPoint, *, data: SliceSet, fio: str | None, on_step: Callable[[], object]
) -> StoreBench:
    """Staging buffers of one block each, as many as the queue depth, so staging keeps the queue full."""
    s = point.setting
    parts = open_store(
        point, path=opts.path, nvme_capacity=data.nbytes, buffer_size=s.block_size,
        buffer_count=s.queue_depth, run_id=f"tz-bench-{os.getpid()}-store", cpu_reuse_limit=opts.cpu_reuse_limit,
    )
    with closing(parts):
        bench = StoreBench(store=parts.store, point=point, data=data, fio_path=opts.path, fio=fio, on_step=on_step)
        bench.warm_up()
        for repeat in range(opts.repeats):
            bench.repeat(fio_first=repeat % 2 == 1)
        bench.close()
    return bench


def fio_best(fio_part: dict[str, Any] | None, store_bench: StoreBench) -> dict[str, float | None]:
    """fio's best median by direction over the sweep and the store measurement."""
    best: dict[str, float | None] = {}
    for direction, beside in store_bench.fio_medians().items():
        swept = fio_part[f"best_{direction}_GBps"] if fio_part is not None else None
        best[direction] = max(beside, swept or 0.0)
    return best


def print_summary(report: dict[str, Any], results: list[PointResult], best: PointResult, *, out: TextIO) -> None:
    print(format_table(sweep_report.TABLE_HEADERS, list(sweep_report.table_rows(results))), file=out)
    print(f"\nbest: {best.point.label}", file=out)
    for line in sweep_report.ratio_lines(best, report["fio"]):
        print(f"  {line}", file=out)
    if report["through_store"] is not None:
        for line in through_store_lines(report["through_store"]):
            print(f"  {line}", file=out)
    s = best.point.setting
    snippet = nvme_config_snippet(
        block_size=s.block_size, queue_depth=s.queue_depth, threads=s.threads, backend=best.point.backend
    )
    print("\nbest settings as config:\n" + snippet, file=out)
