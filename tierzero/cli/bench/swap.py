"""`tierzero bench swap`: a stress test of the store, the swapper and the tiers, as training uses them.

Worker threads pick random slices (homes spread over device, cpu and nvme) and run
episodes on them: fetch to device or cpu and verify every byte against a reference
copy, maybe change the copy and write it back without waiting, release; or write
back fresh bytes straight from host memory. A fetch right after an unfinished
write-back of the same slice must see the new bytes (the swapper orders them).
At the end every slice is read back once more, everything is released and
unregistered, and the tiers must account zero bytes and leave no files.
"""

from __future__ import annotations

import argparse
import random
import re
import resource
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch

from tierzero.cli.bench import pattern
from tierzero.cli.bench.report import format_table, write_json
from tierzero.cli.bench.swap_stats import CheckFailed, Failure, SwapStats
from tierzero.cli.bench.through_store import StoreParts, open_store
from tierzero.cli.bench.workload import Setting, SweepPoint, check_free_space
from tierzero.common.sizes import format_size, parse_size
from tierzero.common.slices import Kind, SliceKey, Tier, align_up
from tierzero.common.transfer import Transfer
from tierzero.store import SliceState, Use

_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s|m|h)?\s*$")
_SECONDS = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
WAIT_TIMEOUT_S = 120.0
"""A transfer still unfinished after this long is reported as a hang, not waited for forever."""


def parse_duration(value: str) -> float:
    """Seconds in "60s", "2m", "1.5h", "500ms" or a plain number of seconds."""
    match = _DURATION_RE.match(value)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"expected a duration such as '60s', '2m' or '500ms', got {value!r}")
    return float(match.group(1)) * _SECONDS[match.group(2)]


@dataclass(frozen=True, slots=True, kw_only=True)
class SwapBenchOptions:
    path: Path
    duration_s: float
    slices: int
    slice_size: int
    seed: int
    workers: int
    buffer_size: int
    buffer_count: int
    nvme: Setting
    backend: str
    json_path: Path | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SwapBenchOptions:
        opts = cls(
            path=Path(args.path),
            duration_s=parse_duration(args.duration),
            slices=args.slices,
            slice_size=parse_size(args.slice_size),
            seed=args.seed,
            workers=args.workers,
            buffer_size=parse_size(args.buffer_size),
            buffer_count=args.buffer_count,
            nvme=Setting(block_size=parse_size(args.block_size), queue_depth=args.queue_depth, threads=args.threads),
            backend=args.backend,
            json_path=Path(args.json) if args.json else None,
        )
        if opts.slices < 3 or opts.slice_size < 8 or opts.workers < 1:
            raise ValueError(
                f"bench swap needs --slices >= 3 (one per tier), --slice-size >= 8 bytes and --workers >= 1, "
                f"got {opts.slices}, {opts.slice_size} and {opts.workers}"
            )
        return opts


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench swap`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "swap", help="stress the store and swapper with random concurrent transfers, verifying every byte",
        description="Concurrent fetches, write-backs and releases of random slices across device, cpu and nvme.",
    )
    parser.add_argument("--path", required=True, help="directory for the NVMe tier's swap file")
    parser.add_argument("--duration", default="60s", help="how long to run: '60s', '2m' (default 60s)")
    parser.add_argument("--slices", type=int, default=48, help="slices, homes spread over the three tiers (default 48)")
    parser.add_argument("--slice-size", default="4MiB", help="largest slice; sizes vary from half of it (default 4MiB)")
    parser.add_argument("--seed", type=int, default=0, help="seed of sizes, homes, choices and bytes")
    parser.add_argument("--workers", type=int, default=8, help="threads running episodes at once (default 8)")
    parser.add_argument("--buffer-size", default="256KiB", help="swapper staging buffer size (default 256KiB)")
    parser.add_argument("--buffer-count", type=int, default=4, help="swapper staging buffers (default 4, contended)")
    parser.add_argument("--block-size", default="1MiB", help="NVMe tier block size (default 1MiB)")
    parser.add_argument("--queue-depth", type=int, default=8, help="NVMe tier queue depth (default 8)")
    parser.add_argument("--threads", type=int, default=4, help="NVMe tier threads (default 4)")
    parser.add_argument("--backend", default="pread", help="NVMe tier backend: pread or aiofiles (default pread)")
    parser.add_argument("--json", help="write the report as JSON here")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    opts = SwapBenchOptions.from_args(args)
    stats = run_swap_bench(opts)
    if opts.json_path is not None:
        write_json(stats.to_json(), opts.json_path)
    return 0 if stats.passed else 1


@dataclass(slots=True, kw_only=True)
class SliceUnderTest:
    """One slice as the test sees it: where it lives and the bytes it must hold."""

    index: int
    key: SliceKey
    home: Tier
    reference: torch.Tensor
    lock: threading.Lock
    version: int = 0

    def __str__(self) -> str:
        return f"slice {self.key} (#{self.index}, home {self.home.value}, {self.reference.numel()} bytes)"


def mutate(tensor: torch.Tensor, *, index: int, version: int) -> None:
    """New bytes for a new version: fresh page stamps, and the last 8 bytes (tails shorter than a page)."""
    pattern.stamp_pages(tensor, stamp=(version << 16) | index)
    tail = torch.tensor([(version << 16) | index], dtype=torch.int64).view(torch.uint8)
    tensor[-8:].copy_(tail)


def make_slices(opts: SwapBenchOptions) -> list[SliceUnderTest]:
    rng = random.Random(opts.seed)
    homes = [(Tier.DEVICE, Tier.CPU, Tier.NVME)[i % 3] for i in range(opts.slices)]
    rng.shuffle(homes)
    block = pattern.random_block(opts.seed, 1 << 20)
    slices = []
    for i, home in enumerate(homes):
        nbytes = rng.randint(max(8, opts.slice_size // 2), opts.slice_size)
        reference = torch.empty(nbytes, dtype=torch.uint8)
        pattern.fill(reference, block=block.roll(i), stamp=i)
        mutate(reference, index=i, version=0)
        key = SliceKey(unit=f"swap.{i}", kind=(Kind.PARAM, Kind.MASTER, Kind.EXP_AVG)[i % 3])
        slices.append(SliceUnderTest(index=i, key=key, home=home, reference=reference, lock=threading.Lock()))
    return slices


@dataclass(slots=True, kw_only=True)
class Episodes:
    """The workers' loop: random episodes on random slices until the deadline or the first failure."""

    parts: StoreParts
    slices: list[SliceUnderTest]
    stats: SwapStats
    deadline: float
    stop: threading.Event

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set() and time.monotonic() < self.deadline:
            state = self.slices[rng.randrange(len(self.slices))]
            if not state.lock.acquire(blocking=False):
                continue
            try:
                self.episode(state, rng)
            except Exception as exc:  # noqa: BLE001 - every failure is reported, the run goes on to clean up
                self.stats.fail(Failure(what=str(state), error=exc))
                self.stop.set()
                release_if_fetched(self.parts, state)
            finally:
                state.lock.release()

    def episode(self, state: SliceUnderTest, rng: random.Random) -> None:
        store = self.parts.store
        if rng.random() < 0.2:
            # Fresh bytes from host memory straight to the home, as an optimizer step writes a slice.
            fresh = state.reference.clone()
            mutate(fresh, index=state.index, version=state.version + 1)
            self._timed(f"cpu->{state.home.value}", state, store.write_back(state.key, fresh), wait=True, moves=True)
            state.version += 1
            state.reference.copy_(fresh)
            return
        to = rng.choice((Tier.DEVICE, Tier.CPU))
        moves = to is not state.home
        copy = self._timed(f"{state.home.value}->{to.value}", state, store.fetch(state.key, to=to), wait=True, moves=moves)
        # A snapshot, so that a byte changed behind our back is reported as it was compared.
        mismatch = pattern.first_mismatch(copy.to("cpu", copy=True), state.reference)
        if mismatch is not None:
            raise CheckFailed(f"fetched to {to.value} is wrong: {mismatch}")
        if rng.random() < 0.5:
            state.version += 1
            mutate(copy, index=state.index, version=state.version)
            mutate(state.reference, index=state.index, version=state.version)
            # Not waited for: the next fetch of this slice must be ordered after it.
            self._timed(f"{to.value}->{state.home.value}", state, store.write_back(state.key), wait=False, moves=moves)
        store.release(state.key)

    def _timed(self, path: str, state: SliceUnderTest, transfer: Transfer, *, wait: bool, moves: bool) -> torch.Tensor | None:
        """Records the latency (submit to done) under `path` of a transfer that `moves` bytes.

        A fetch to the home tier hands back the home tensor itself: nothing moves, nothing is timed.
        """
        start, nbytes = time.perf_counter(), state.reference.numel()
        if moves:
            transfer.future.add_done_callback(
                lambda f: f.exception() is None and self.stats.record(path, nbytes, time.perf_counter() - start)
            )
        return transfer.wait(timeout=WAIT_TIMEOUT_S) if wait else None


def run_swap_bench(opts: SwapBenchOptions, *, out: TextIO | None = None) -> SwapStats:
    slices = make_slices(opts)
    nvme_bytes = sum(align_up(s.reference.numel()) for s in slices if s.home is Tier.NVME)
    check_free_space(opts.path, need=nvme_bytes, what="bench swap")
    point = SweepPoint(setting=opts.nvme, backend=opts.backend)
    parts = open_store(
        point, path=opts.path, nvme_capacity=max(nvme_bytes, 4096), buffer_size=opts.buffer_size,
        buffer_count=opts.buffer_count, run_id=f"tz-bench-swap-{threading.get_native_id()}",
    )
    stats = SwapStats(staging_capacity=opts.buffer_size * opts.buffer_count)
    run_dir = parts.nvme.run_dir
    try:
        for state in slices:
            parts.store.register(state.key, numel=state.reference.numel(), dtype=torch.uint8, home=state.home)
            parts.store.write_back(state.key, state.reference.clone()).wait(timeout=WAIT_TIMEOUT_S)
        episodes = Episodes(
            parts=parts, slices=slices, stats=stats, deadline=time.monotonic() + opts.duration_s, stop=threading.Event()
        )
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=opts.workers, thread_name_prefix="tierzero-bench-swap") as pool:
            workers = [pool.submit(episodes.worker, opts.seed * 1000 + w) for w in range(opts.workers)]
            for worker in workers:
                worker.result()
        stats.elapsed_s = time.perf_counter() - started
        final_check(parts, slices, stats)
    except Exception as exc:  # noqa: BLE001 - reported as a failure of the run
        stats.fail(Failure(what="bench swap", error=exc))
    finally:
        stats.staging = parts.store.swapper.stats()
        parts.close()
    if run_dir.exists():
        stats.fail(Failure(what="NVMe tier", error=CheckFailed(f"{run_dir} left behind after close")))
    stats.peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print_report(stats, out=out or sys.stdout)
    return stats


def final_check(parts: StoreParts, slices: list[SliceUnderTest], stats: SwapStats) -> None:
    """Every slice read back once more; then all released and unregistered, and nothing still accounted."""
    store = parts.store
    for state in slices:
        release_if_fetched(parts, state)
        copy = store.fetch(state.key, to=Tier.CPU).wait(timeout=WAIT_TIMEOUT_S)
        mismatch = pattern.first_mismatch(copy, state.reference)
        store.release(state.key)
        if mismatch is not None:
            stats.fail(Failure(what=str(state), error=CheckFailed(f"final read-back is wrong: {mismatch}")))
    for state in slices:
        store.unregister(state.key)
    leaks = accounted_bytes(parts)
    # A released copy is freed by a callback of its last transfer, which may run just
    # after the waiter woke up: give the callbacks a moment before calling it a leak.
    settle_by = time.monotonic() + 5.0
    while any(leaks.values()) and time.monotonic() < settle_by:
        time.sleep(0.01)
        leaks = accounted_bytes(parts)
    for tier, used in leaks.items():
        if used:
            stats.fail(Failure(what=f"{tier} tier", error=CheckFailed(f"{format_size(used)} still accounted after every release")))
    stats.leaked = leaks


def release_if_fetched(parts: StoreParts, state: SliceUnderTest) -> None:
    """After a failed episode: give the copy back, so the end checks can still run."""
    if parts.store.state(state.key) is not SliceState.HOME:
        parts.store.release(state.key)


def accounted_bytes(parts: StoreParts) -> dict[str, int]:
    """Bytes still held for slices, by each tier and in the store's ledger (`ledger.<tier>`).

    The staging buffers are the swapper's pool, taken from the CPU tier: not a leak.
    """
    staging = parts.store.swapper.stats().held
    held = {"device": parts.device.used, "cpu": parts.cpu.used - staging, "nvme": parts.nvme.used}
    for tier, usage in parts.store.report().tiers.items():
        held[f"ledger.{tier.value}"] = usage.current - usage.current_by_use.get(Use.STAGING, 0)
    return held


def print_report(stats: SwapStats, *, out: TextIO) -> None:
    print(format_table(SwapStats.TABLE_HEADERS, stats.table_rows()), file=out)
    for line in stats.summary_lines():
        print(line, file=out)
