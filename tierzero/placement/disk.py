"""The disk's read and write bandwidth for the planner: remembered per path and I/O setting.

A disk's rates depend on how it is driven: on the 2-core VM (docs/benchmarks-journal.md, session
13), the 2B auto plan predicted from `bench nvme --quick`'s one setting (1 MiB blocks, queue
depth 4, 2 threads: 2.27 GB/s read) came out 19-25% slow, and from a probe at `tiers.nvme`'s
default setting (8 MiB, 16, 8: 2.56 GB/s read) 5% slow. So rates are remembered per setting
(`setting_label`): `tierzero bench nvme` remembers every point of its sweep for the
directory it ran in, and a probe the setting it ran at. `disk_rates(path, nvme)` returns what
is remembered for that path at `nvme`'s setting (the config's `tiers.nvme`), else runs
`probe` at that setting and remembers that. `tierzero train` remembers, with `learn`, what
its steps after the first found, the disk driven by the step itself beside its compute, and
those rates come first. Rates older than `MAX_AGE_S` are measured
again: a shared disk's speed drifts (a plan predicted 19% slow from rates an hour old,
docs/benchmarks-journal.md, session 14). It drifts within minutes too, so a setting's rates are the
medians of its measurements of the last `HISTORY_S`, not the newest alone.

The probe drives the disk as a step's swaps do, through the NVMe tier the engine uses: 1 GiB
written, left to settle, then a quarter of it after another read back and written over, for
`PROBE_S` seconds (docs/benchmarks-journal.md, session 16). Bytes read again at once come faster
(the same 256 MiB read back to back on the 2-core VM: 2.0 GB/s at first, then up to 2.9),
where a step reads each byte once, a step after writing it; and a third of a second of
reading samples one moment of a disk whose rate moves 2.0-2.9 GB/s between passes a tenth of
a second apart (2.2-2.8 over 5-second windows; eight-second probes one after another read
2.21-2.61, where the old 256 MiB probes read 1.94-2.55).

`streaming(path, nvme)` keeps the disk as busy as a step's swaps do, for what must be measured
beside them, and pauses on demand for what must be measured alone in between. The cache is
one JSON file, `$TIERZERO_CACHE_DIR/disks.json` (default `~/.cache/tierzero`), keyed by the
directory's real path and then by setting; a file or an entry that cannot be read is ignored
and rewritten, never trusted, and a directory that is gone loses its entry at the next write.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tierzero.common.cache_files import cache_path, read_json, write_json
from tierzero.common.sizes import format_size
from tierzero.common.slices import IO_ALIGNMENT, aligned_empty
from tierzero.config import NvmeTierConfig, TiersConfig
from tierzero.offload.base import Region
from tierzero.offload.disk.busy import Busy
from tierzero.offload.disk.files import NvmeSpaceError
from tierzero.offload.nvme import NvmeTier
from tierzero.placement.history import HISTORY_S, HISTORY_SAMPLES, Sample, kept, medians, span_text

__all__ = [
    "BUSY_SHARE", "HISTORY_S", "HISTORY_SAMPLES", "IN_STEPS", "MAX_AGE_S", "PROBE_BYTES", "PROBE_S", "SETTLE_S",
    "STREAM_BYTES", "DiskRates", "DiskStream", "cache_file", "disk_rates", "label_of", "learn", "probe", "remember",
    "remembered", "setting_label", "streaming", "timed_moves",
]

log = logging.getLogger(__name__)

#: Bytes `probe` spreads over the disk by default.
PROBE_BYTES = 1 << 30
#: Seconds `probe` reads and writes for by default: the disk's rate averaged over a window of
#: the order of a step's disk time.
PROBE_S = 8.0
#: The groups `probe` reads back and writes over in turn, each of `PROBE_SLICES` slices moved at once.
PROBE_GROUPS = 4
PROBE_SLICES = 4
#: Bytes `streaming` moves each way per pass by default.
STREAM_BYTES = 256 << 20
#: Seconds after which `disk_rates` measures remembered rates again.
MAX_AGE_S = 3600.0
#: The fields of a setting's measurements (placement/history.py keeps them).
_FIELDS = ("read_GBps", "write_GBps")
#: What the rates training steps found (`learn`) are remembered under, after the setting's label.
#: A step drives the disk beside its compute, reading and writing at once: the 2B auto step's disk
#: was busy 6.2-8.9 s where probes alone at its setting counted 5.9-6.9 (docs/benchmarks-journal.md,
#: sessions 17 and 18), so the planner takes a step's rates before a probe's.
IN_STEPS = " (in steps)"
#: The least share of the steps' time the disk must have been busy for `learn` to remember their rates.
BUSY_SHARE = 0.5
#: Seconds between its writes and its reads: bytes read back at once after being written come
#: at a third of the speed on a virtio disk (its host still writing them back), and a step
#: reads what it wrote a step ago.
SETTLE_S = 3.0


@dataclass(frozen=True, slots=True, kw_only=True)
class DiskRates:
    """Sequential read and write bandwidth of one directory's disk, and where they came from."""

    read: float
    """Bytes per second."""
    write: float
    source: str


def cache_file() -> Path:
    return cache_path("disks.json")


def setting_label(*, block_size: int, queue_depth: int, threads: int, backend: str) -> str:
    """The key rates are remembered under: "8.0 MiB qd8 t8 pread", as `bench nvme` labels its points."""
    return f"{format_size(block_size)} qd{queue_depth} t{threads} {backend}"


def label_of(nvme: NvmeTierConfig) -> str:
    """`nvme`'s setting as `setting_label` gives it."""
    return setting_label(
        block_size=nvme.block_size, queue_depth=nvme.queue_depth, threads=nvme.threads, backend=nvme.backend
    )


def remembered(path: str | os.PathLike[str], setting: str, *, max_age_s: float | None = None) -> DiskRates | None:
    """The rates remembered for `path`'s directory at `setting` (a `setting_label`: the medians of
    its measurements, `remember`), those training steps found (`learn`) before a probe's or a
    benchmark's; None when none are (or the cache, or that entry, is unreadable), or when the
    newest was measured more than `max_age_s` seconds ago (an entry that does not say when is as
    old as can be)."""
    by_setting = read_json(cache_file()).get(_key(path))
    return _rates_at(by_setting, setting + IN_STEPS, max_age_s) or _rates_at(by_setting, setting, max_age_s)


def _remembered_at(path: str | os.PathLike[str], setting: str) -> DiskRates | None:
    """What is remembered for `path` under exactly `setting` (a probe's, or the steps'), however old."""
    return _rates_at(read_json(cache_file()).get(_key(path)), setting, None)


def _rates_at(by_setting: object, setting: str, max_age_s: float | None) -> DiskRates | None:
    """The rates of a directory's cache entry (`by_setting`) under `setting`; None as `remembered` says."""
    entry = by_setting.get(setting) if isinstance(by_setting, dict) else None
    if not isinstance(entry, dict):
        return None
    try:
        read, write = float(entry["read_GBps"]), float(entry["write_GBps"])
        source = str(entry["source"])
        measured = float(entry.get("measured", 0.0))
    except (TypeError, KeyError, ValueError):
        return None
    if not (read > 0 and write > 0):
        return None
    if max_age_s is not None and not time.time() - measured <= max_age_s:
        return None
    return DiskRates(read=read * 1e9, write=write * 1e9, source=f"{source} ({cache_file()})")


def remember(path: str | os.PathLike[str], rates: dict[str, tuple[float, float]], *, how: str) -> None:
    """Store `path`'s (read, write) GB/s at each setting of `rates` with what measured them and when,
    beside what is remembered at its other settings. Each setting keeps its measurements of the
    last `HISTORY_S` (the newest `HISTORY_SAMPLES`), and its rates are their medians. The file is
    replaced whole, without the entries of directories that no longer exist (a run's scratch
    swap directory)."""
    known = read_json(cache_file())
    cache = {key: entry for key, entry in known.items() if os.path.isdir(key) and isinstance(entry, dict)}
    now = time.time()
    entry = {k: v for k, v in cache.get(_key(path), {}).items() if isinstance(v, dict)}
    cache[_key(path)] = entry
    for setting, (read_gbs, write_gbs) in rates.items():
        measured = kept(entry.get(setting), _FIELDS, Sample(dict(zip(_FIELDS, (read_gbs, write_gbs))), how, now))
        figures = medians(measured)
        read, write = figures["read_GBps"], figures["write_GBps"]
        entry[setting] = {
            "read_GBps": read, "write_GBps": write, "measured": now,
            "samples": [sample.to_json() for sample in measured],
            "source": f"{span_text(measured, f' at {setting}')}: {read:.2f} GB/s read, {write:.2f} GB/s write",
        }  # fmt: skip
    write_json(cache_file(), cache)


def disk_rates(path: str | os.PathLike[str], nvme: NvmeTierConfig | None = None) -> DiskRates:
    """`path`'s rates remembered at `nvme`'s I/O setting (default: `tiers.nvme`'s defaults) within
    the last `MAX_AGE_S`, else a `probe` of it at that setting, remembered for next time."""
    nvme = nvme or TiersConfig().nvme
    setting = label_of(nvme)
    known = remembered(path, setting, max_age_s=MAX_AGE_S)
    if known is not None:
        return known
    log.info("probing the disk at %s for %.0f s at %s: none of its rates there are from the last %.0f min",
             os.path.realpath(path), PROBE_S, setting, MAX_AGE_S / 60)  # fmt: skip
    read, write = probe(path, nvme)
    log.info("the disk read %.2f GB/s, wrote %.2f", read, write)
    remember(path, {setting: (read, write)}, how=f"probe of {format_size(PROBE_BYTES)} over {PROBE_S:.0f} s")
    found = _remembered_at(path, setting)
    assert found is not None
    return found


def learn(
    path: str | os.PathLike[str], nvme: NvmeTierConfig, busy: Busy, *, seconds: float, steps: int
) -> DiskRates | None:
    """Remember, for `path` at `nvme`'s setting, the rates `steps` training steps of `seconds` in all
    found (`busy`: their NvmeTier's moves, `Busy.rates`), which `remembered` then prefers to a
    probe's. Nothing, and None, when the disk was busy under `BUSY_SHARE` of the time (it
    waited on the compute, and did not set the pace) or moved under `PROBE_BYTES` either way
    (a small model's moves, timed by their latency more than by the disk's bandwidth)."""
    rates = busy.rates()
    if rates is None or busy.any_s < BUSY_SHARE * seconds or min(busy.read_bytes, busy.write_bytes) < PROBE_BYTES:
        return None
    setting = label_of(nvme) + IN_STEPS
    how = f"training run's {steps} steps after its first (busy {busy.any_s / steps:.2f} s of {seconds / steps:.2f} s each)"
    try:
        remember(path, {setting: (rates[0] / 1e9, rates[1] / 1e9)}, how=how)
    except OSError as exc:  # the run is done; what it found is lost, nothing else
        warnings.warn(f"the disk's rates in these steps are not kept: cannot write {cache_file()}: {exc}", stacklevel=2)
        return None
    return _remembered_at(path, setting)


def probe(
    path: str | os.PathLike[str],
    nvme: NvmeTierConfig | None = None,
    *,
    nbytes: int = PROBE_BYTES,
    seconds: float = PROBE_S,
    settle_s: float = SETTLE_S,
) -> tuple[float, float]:
    """(read, write) GB/s of `path`'s disk through an NvmeTier at `nvme`'s I/O setting (default:
    `tiers.nvme`'s defaults), driven as a step's swaps drive it: `nbytes` written in
    `PROBE_GROUPS` groups from one group's host buffers (these first writes lay out the file,
    and are not timed), left `settle_s` to settle, then group after group read back and written
    over, until `seconds` have passed and every group has had its turn: the bytes each way over
    the time each took."""
    with _probe_slices(path, nvme, nbytes, PROBE_GROUPS * PROBE_SLICES, PROBE_SLICES) as (tier, regions, buffers):
        groups = [(regions[i::PROBE_GROUPS], buffers) for i in range(PROBE_GROUPS)]
        for group in groups:
            timed_moves(tier.submit_write, *group)
        time.sleep(settle_s)
        took = {"read": 0.0, "write": 0.0}
        turns, start = 0, time.perf_counter()
        while turns < PROBE_GROUPS or time.perf_counter() - start < seconds:
            group = groups[turns % PROBE_GROUPS]
            for way, submit in (("read", tier.submit_read), ("write", tier.submit_write)):
                took[way] += _seconds_moving(submit, *group)
            turns += 1
    moved = turns * sum(buf.numel() for buf in buffers) / 1e9
    return moved / took["read"], moved / took["write"]


class DiskStream:
    """A disk kept busy by a thread (`streaming`), which `paused` stops for what is measured alone."""

    def __init__(self, tier: NvmeTier, regions: list[Region], buffers: list[torch.Tensor]) -> None:
        self._moves = [(submit, regions, buffers) for submit in (tier.submit_write, tier.submit_read)]
        self._each_way = sum(buf.numel() for buf in buffers)
        self._changed = threading.Condition()
        self._wanted, self._stopping, self._idle = True, False, False
        self._passes, self._busy_s = 0, {"write": 0.0, "read": 0.0}
        self.failed: Exception | None = None
        self._thread = threading.Thread(target=self._stream, name="tierzero-disk-stream", daemon=True)
        self._thread.start()

    def rates(self) -> tuple[float, float]:
        """(read, write) GB/s while it streamed, each over its own time: the disk as a step finds it
        beside whatever else runs ((0.0, 0.0) before its first pass ends)."""
        with self._changed:
            moved = self._passes * self._each_way / 1e9
            read, write = self._busy_s["read"], self._busy_s["write"]
            return (moved / read if read else 0.0, moved / write if write else 0.0)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The disk idle inside the block: the pass under way ends first."""
        with self._changed:
            self._wanted = False
            self._changed.wait_for(lambda: self._idle)
        try:
            yield
        finally:
            with self._changed:
                self._wanted = True
                self._changed.notify_all()

    def _stream(self) -> None:
        try:
            while True:  # one pass at least, however short the block
                took = {}
                for way, (submit, regions, buffers) in zip(("write", "read"), self._moves):
                    took[way] = _seconds_moving(submit, regions, buffers)
                with self._changed:
                    self._passes += 1
                    for way, seconds in took.items():
                        self._busy_s[way] += seconds
                    self._idle = True
                    self._changed.notify_all()
                    self._changed.wait_for(lambda: self._wanted or self._stopping)
                    self._idle = False
                    if self._stopping:
                        return
        except Exception as exc:  # raised in the caller's thread once the block ends
            self.failed = exc
            with self._changed:
                self._idle = True
                self._changed.notify_all()

    def _stop(self) -> None:
        with self._changed:
            self._stopping = True
            self._changed.notify_all()
        self._thread.join()


@contextmanager
def streaming(
    path: str | os.PathLike[str], nvme: NvmeTierConfig | None = None, *, nbytes: int = STREAM_BYTES, slices: int = 4
) -> Iterator[DiskStream]:
    """Keep `path`'s disk busy while the block runs: a thread writes `slices` slices of `nbytes` in
    all through an NvmeTier at `nvme`'s I/O setting (default: `tiers.nvme`'s defaults) and reads
    them back, over and over, as a step's swaps do. Yields the `DiskStream`. An error of the
    stream's is raised when the block ends."""
    with _probe_slices(path, nvme, nbytes, slices) as (tier, regions, buffers):
        stream = DiskStream(tier, regions, buffers)
        try:
            yield stream
        finally:
            stream._stop()
        if stream.failed is not None:
            raise stream.failed


class ProbeSpaceError(NvmeSpaceError):
    """The disk under `tiers.nvme.path` has no room for the probe that measures it (`offload: auto`)."""

    def __init__(self, *, path: Path, need: int, free: int) -> None:
        super().__init__(path=path, need=need, free=free)
        self.strerror = (
            f"offload: auto measures the disk at {path} with a {format_size(need)} probe file, and it has "
            f"{format_size(free)} free: free space there, pick another tiers.nvme.path, or name each offload tier instead of auto"
        )


@contextmanager
def _probe_slices(
    path: str | os.PathLike[str], nvme: NvmeTierConfig | None, nbytes: int, slices: int, buffers: int | None = None
) -> Iterator[tuple[NvmeTier, list[Region], list[torch.Tensor]]]:
    """An open NvmeTier at `nvme`'s I/O setting (default: `tiers.nvme`'s defaults), its `slices`
    aligned regions of `nbytes` in all, and a patterned host buffer of a slice's size for each
    (or `buffers` of them, for slices moved a few at a time); the tier's file goes when the
    block ends."""
    size = nbytes // slices // IO_ALIGNMENT * IO_ALIGNMENT
    if size == 0:
        raise ValueError(f"{format_size(nbytes)} in {slices} slices is under one {IO_ALIGNMENT}-byte block each")
    nvme = nvme or TiersConfig().nvme
    try:
        tier = NvmeTier(
            path, capacity=size * slices, block_size=nvme.block_size, queue_depth=nvme.queue_depth,
            threads=nvme.threads, backend=nvme.backend,
        )  # fmt: skip
    except NvmeSpaceError as exc:  # the probe's own file, not tiers.nvme.capacity, is what did not fit
        raise ProbeSpaceError(path=exc.path, need=exc.need, free=exc.free) from None
    with tier:
        regions = [tier.allocate(size, label=f"probe/{i}") for i in range(slices)]
        yield tier, regions, [aligned_empty(size).fill_(i + 1) for i in range(buffers or slices)]


def timed_moves(
    submit: Callable[[Region, torch.Tensor], Future[None]], regions: list[Region], buffers: list[torch.Tensor]
) -> float:
    """GB/s of moving all slices at once, as the swapper does: all submitted, then all awaited."""
    return sum(buf.numel() for buf in buffers) / _seconds_moving(submit, regions, buffers) / 1e9


def _seconds_moving(
    submit: Callable[[Region, torch.Tensor], Future[None]], regions: list[Region], buffers: list[torch.Tensor]
) -> float:
    """Seconds to move all slices at once: all submitted, then all awaited."""
    start = time.perf_counter()
    futures = [submit(region, buf) for region, buf in zip(regions, buffers)]
    for future in futures:
        future.result()
    return time.perf_counter() - start


def _key(path: str | os.PathLike[str]) -> str:
    return os.path.realpath(path)
