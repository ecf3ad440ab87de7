"""The planner's disk rates: remembered per directory, probed once when unknown, a bad cache ignored."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tierzero.offload.base import Region
from tierzero.offload.nvme import NvmeTier
from tierzero.placement import disk

#: The setting `tiers.nvme` defaults to, as the cache keys it.
DEFAULT = "8.0 MiB qd16 t8 pread"


def test_rates_are_remembered_per_directory_and_setting(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    assert disk.remembered(a, DEFAULT) is None
    disk.remember(a, {DEFAULT: (2.5, 4.0), "1.0 MiB qd4 t2 pread": (1.5, 3.0)}, how="bench nvme")
    rates = disk.remembered(a / ".." / "a", DEFAULT)  # the same directory by another spelling
    assert rates is not None and (rates.read, rates.write) == (2.5e9, 4.0e9)
    assert rates.source.startswith(f"bench nvme at {DEFAULT}, ") and "2.50 GB/s read, 4.00 GB/s write" in rates.source
    slow = disk.remembered(a, "1.0 MiB qd4 t2 pread")
    assert slow is not None and (slow.read, slow.write) == (1.5e9, 3.0e9)
    assert disk.remembered(a, "8.0 MiB qd8 t8 pread") is None
    assert disk.remembered(b, DEFAULT) is None
    disk.remember(a, {"8.0 MiB qd8 t8 pread": (2.0, 3.5)}, how="probe")  # beside the others, not over them
    assert {k for k in json.loads(disk.cache_file().read_text())[str(a.resolve())]} == {
        DEFAULT, "1.0 MiB qd4 t2 pread", "8.0 MiB qd8 t8 pread"
    }


def test_the_label_is_the_config_s_setting() -> None:
    from tierzero.config import load_config

    nvme = load_config({"tiers": {"nvme": {"block_size": "1MiB", "queue_depth": 4, "threads": 2}}}).tiers.nvme
    assert disk.label_of(nvme) == "1.0 MiB qd4 t2 pread"
    assert disk.label_of(load_config({}).tiers.nvme) == DEFAULT


def test_a_directory_that_is_gone_loses_its_entry_at_the_next_write(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    disk.remember(a, {DEFAULT: (2.5, 4.0)}, how="probe")
    a.rmdir()
    disk.remember(b, {DEFAULT: (3.0, 5.0)}, how="probe")
    assert set(json.loads(disk.cache_file().read_text())) == {str(b.resolve())}


def test_an_unknown_disk_is_probed_once_at_the_config_s_setting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rates remembered at another setting (`bench nvme --quick`'s one) are not the config's: the
    disk is probed at the config's own, once."""
    from tierzero.config import load_config

    calls: list[tuple[Path, str]] = []

    def probe(path: Path, nvme: object, **_: object) -> tuple[float, float]:
        calls.append((Path(path), disk.label_of(nvme)))  # type: ignore[arg-type]
        return 2.0, 3.0

    monkeypatch.setattr(disk, "probe", probe)
    disk.remember(tmp_path, {"1.0 MiB qd4 t2 pread": (1.5, 3.0)}, how="bench nvme")
    nvme = load_config({"tiers": {"nvme": {"queue_depth": 8}}}).tiers.nvme
    first = disk.disk_rates(tmp_path, nvme)
    second = disk.disk_rates(tmp_path, nvme)
    assert calls == [(tmp_path, "8.0 MiB qd8 t8 pread")]
    assert (first.read, first.write) == (second.read, second.write) == (2.0e9, 3.0e9)
    assert first.source.startswith("probe of 1.0 GiB over 8 s at 8.0 MiB qd8 t8 pread")
    assert disk.disk_rates(tmp_path, load_config({"tiers": {"nvme": {"block_size": "1MiB", "queue_depth": 4,
                                                                      "threads": 2}}}).tiers.nvme).read == 1.5e9
    assert len(calls) == 1


def test_rates_older_than_an_hour_are_measured_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared disk's speed drifts: rates remembered more than `MAX_AGE_S` ago, or by a cache that
    did not say when, are probed again and the new ones remembered."""
    import time

    probes: list[float] = []

    def probe(path: Path, nvme: object, **_: object) -> tuple[float, float]:
        probes.append(time.time())
        return 2.0 + len(probes), 3.0

    monkeypatch.setattr(disk, "probe", probe)
    disk.remember(tmp_path, {DEFAULT: (1.5, 3.0)}, how="bench nvme")
    assert disk.disk_rates(tmp_path).read == 1.5e9 and probes == []
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + disk.MAX_AGE_S + 1)
    assert disk.disk_rates(tmp_path).read == 2.25e9 and len(probes) == 1  # the median of 1.5 and 3.0
    assert disk.disk_rates(tmp_path).read == 2.25e9 and len(probes) == 1  # the new ones are fresh
    entry = json.loads(disk.cache_file().read_text())[str(tmp_path.resolve())][DEFAULT]
    del entry["measured"], entry["samples"]
    disk.cache_file().write_text(json.dumps({str(tmp_path.resolve()): {DEFAULT: entry}}))
    assert disk.remembered(tmp_path, DEFAULT) is not None  # still read where age does not matter
    assert disk.disk_rates(tmp_path).read == 4.0e9 and len(probes) == 2  # an entry without samples starts anew


def test_a_setting_s_rates_are_the_medians_of_its_last_days_measurements(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    now = time.time()
    clock = [now - 12 * 3600.0 - disk.HISTORY_S - 60]  # one measurement, then one an hour from over a day later
    monkeypatch.setattr(time, "time", lambda: clock[0])
    disk.remember(tmp_path, {DEFAULT: (9.0, 9.0)}, how="bench nvme")
    for hour in range(13):  # read 10, 11, 12, 10, ...; written 20, 21, 20, ...: within the noise
        clock[0] = now - 3600.0 * (12 - hour)
        disk.remember(tmp_path, {DEFAULT: (10.0 + hour % 3, 20.0 + hour % 2)}, how="probe")
        if hour == 4:  # the day-old 9.0 is gone: 10, 11, 12, 10, 11 read, 20, 21, 20, 21, 20 written
            rates = disk.remembered(tmp_path, DEFAULT)
            assert rates is not None and (rates.read, rates.write) == (11.0e9, 20.0e9)
    # only the newest 12 are kept: hours 1 to 12, four of each read, six of each written
    rates = disk.remembered(tmp_path, DEFAULT, max_age_s=disk.MAX_AGE_S)
    assert rates is not None and (rates.read, rates.write) == (11.0e9, 20.5e9)
    assert rates.source.startswith(f"the median of {disk.HISTORY_SAMPLES} measurements since ")
    assert f", the last a probe at {DEFAULT}, " in rates.source and "11.00 GB/s read, 20.50 GB/s write" in rates.source
    entry = json.loads(disk.cache_file().read_text())[str(tmp_path.resolve())][DEFAULT]
    entry["samples"][0]["read_GBps"] = "fast"  # a sample that cannot be read is dropped, never trusted
    disk.cache_file().write_text(json.dumps({str(tmp_path.resolve()): {DEFAULT: entry}}))
    disk.remember(tmp_path, {DEFAULT: (30.0, 4.0)}, how="probe")  # far off, but alone: noise, kept among the rest
    rates = disk.remembered(tmp_path, DEFAULT)
    assert rates is not None and (rates.read, rates.write) == (11.0e9, 20.0e9)  # hours 2 to 12 and it
    samples = json.loads(disk.cache_file().read_text())[str(tmp_path.resolve())][DEFAULT]["samples"]
    assert len(samples) == 12 and samples[-1]["read_GBps"] == 30.0


@pytest.mark.parametrize(
    ("newest", "kept"),
    [((1.30, 1.25), 2), ((0.80, 0.70), 2), ((1.30, 0.70), 6), ((1.30, 1.10), 6), ((1.10, 1.30), 6)],
    ids=["both-faster", "both-slower", "opposite-sides", "second-within", "first-within"],
)
def test_two_measurements_far_off_on_one_side_say_the_machine_changed(
    newest: tuple[float, float], kept: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The newest two each more than 15% off the median of those before them, on one side: the
    earlier ones are dropped and the rates are the new ones' medians; otherwise the day's."""
    import time

    clock = [time.time()]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    for factor in (1.0, 1.05, 0.97, 1.02, *newest):
        clock[0] += 600.0
        disk.remember(tmp_path, {DEFAULT: (2.5 * factor, 2.0)}, how="probe")
    entry = json.loads(disk.cache_file().read_text())[str(tmp_path.resolve())][DEFAULT]
    assert len(entry["samples"]) == kept
    rates = disk.remembered(tmp_path, DEFAULT)
    assert rates is not None and rates.write == 2.0e9
    if kept == 2:
        assert rates.read == pytest.approx(2.5e9 * sum(newest) / 2)


def test_the_rates_training_steps_found_are_planned_with_before_a_probes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two steps of 5 s, the disk busy 8 s of them: 6 GB read in 6 s and 3 GB written in 4 s
    inside those 8, so 1.25 x 1 GB/s read and 1.25 x 0.75 written."""
    import time

    from tierzero.config import load_config
    from tierzero.offload.disk.busy import Busy

    monkeypatch.setattr(disk, "probe", lambda *_, **__: pytest.fail("rates were known"))
    nvme = load_config({"tiers": {"nvme": {"queue_depth": 8}}}).tiers.nvme
    setting = disk.label_of(nvme)
    disk.remember(tmp_path, {setting: (2.5, 5.0)}, how="probe")
    assert disk.learn(tmp_path, nvme, Busy(6_000_000_000, 6.0, 3_000_000_000, 4.0, 4.9), seconds=10.0, steps=2) is None
    assert disk.disk_rates(tmp_path, nvme).read == 2.5e9  # busy under half the steps: the compute set the pace
    assert disk.learn(tmp_path, nvme, Busy(6_000_000_000, 6.0, 0, 0.0, 6.0), seconds=10.0, steps=2) is None
    small = Busy(6_000_000_000, 6.0, disk.PROBE_BYTES - 1, 4.0, 8.0)  # latency more than bandwidth
    assert disk.learn(tmp_path, nvme, small, seconds=10.0, steps=2) is None
    found = disk.learn(tmp_path, nvme, Busy(6_000_000_000, 6.0, 3_000_000_000, 4.0, 8.0), seconds=10.0, steps=2)
    assert found is not None and (found.read, found.write) == (pytest.approx(1.25e9), pytest.approx(0.9375e9))
    rates = disk.disk_rates(tmp_path, nvme)
    assert (rates.read, rates.write) == (found.read, found.write)
    assert rates.source.startswith(f"training run's 2 steps after its first (busy 4.00 s of 5.00 s each) at {setting} (in")
    disk.remember(tmp_path, {setting: (3.0, 6.0)}, how="probe")  # a newer probe does not displace them
    assert disk.disk_rates(tmp_path, nvme).read == pytest.approx(1.25e9)
    now = time.time()
    monkeypatch.setattr(time, "time", lambda: now + disk.MAX_AGE_S + 1)
    monkeypatch.setattr(disk, "probe", lambda *_, **__: (2.0, 4.0))  # both an hour old: probed anew, and used
    assert disk.disk_rates(tmp_path, nvme).read == pytest.approx(2.5e9)  # the median of 2.5, 3.0 and 2.0


def test_rates_found_in_steps_that_cannot_be_kept_are_let_go_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierzero.config import load_config
    from tierzero.offload.disk.busy import Busy

    blocker = tmp_path / "cache"
    blocker.write_text("a file where the cache's directory should be")
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(blocker))
    with pytest.warns(UserWarning, match="the disk's rates in these steps are not kept: cannot write"):
        busy = Busy(6_000_000_000, 6.0, 3_000_000_000, 4.0, 8.0)
        kept = disk.learn(tmp_path, load_config({}).tiers.nvme, busy, seconds=10.0, steps=2)
    assert kept is None


@pytest.mark.parametrize(
    "text",
    ["not json", "[1, 2]", '{"%s": {"%d": {"read_GBps": "fast", "write_GBps": 1, "source": "x"}}}',
     '{"%s": {"%d": {"read_GBps": 0, "write_GBps": 1, "source": "x"}}}', '{"%s": {"%d": {"read_GBps": 1}}}',
     '{"%s": {"read_GBps": 1, "write_GBps": 1, "source": "an older cache, one entry per directory"}}',
     '{"%s": [1, 2]}'],
    ids=["garbage", "not-a-mapping", "not-a-number", "zero", "missing", "no-setting", "entry-not-a-mapping"],
)
def test_a_bad_cache_is_never_trusted(text: str, tmp_path: Path) -> None:
    disk.cache_file().parent.mkdir(parents=True, exist_ok=True)
    disk.cache_file().write_text(text.replace("%s", str(tmp_path.resolve())).replace("%d", DEFAULT))
    assert disk.remembered(tmp_path, DEFAULT) is None
    disk.remember(tmp_path, {DEFAULT: (1.0, 2.0)}, how="probe")  # and it is rewritten whole
    assert json.loads(disk.cache_file().read_text())[str(tmp_path.resolve())][DEFAULT]["write_GBps"] == 2.0


def test_the_probe_reads_each_group_back_once_then_writes_it_over_as_a_step_does(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    moves: list[tuple[str, str]] = []
    buffers: set[int] = set()
    for way in ("read", "write"):
        real = getattr(NvmeTier, f"submit_{way}")

        def recorded(self: NvmeTier, region: Region, buf: torch.Tensor, *, _way: str = way, _real=real, **kw: int):
            moves.append((_way, region.label))
            buffers.add(buf.data_ptr())
            return _real(self, region, buf, **kw)

        monkeypatch.setattr(NvmeTier, f"submit_{way}", recorded)
    read, write = disk.probe(tmp_path, nbytes=16 << 20, seconds=0.3, settle_s=0.0)
    assert read > 0 and write > 0
    assert not list(tmp_path.iterdir())  # its file goes with it
    assert len(buffers) == 4  # one group's host memory, not the 16 MiB
    groups = [[f"probe/{i}" for i in range(g, 16, 4)] for g in range(4)]
    assert moves[:16] == [("write", label) for group in groups for label in group]  # the file laid out
    turns = len(moves[16:]) // 8
    assert turns > 4 and len(moves) == 16 + 8 * turns  # every group once, then on until 0.3 s passed
    assert moves[16:] == [
        (way, label) for turn in range(turns) for way in ("read", "write") for label in groups[turn % 4]
    ]


def test_the_probes_rates_are_the_bytes_each_way_over_the_time_each_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seconds = {"submit_read": 0.5, "submit_write": 0.25}
    monkeypatch.setattr(disk, "_seconds_moving", lambda submit, *_: seconds[submit.__name__])
    read, write = disk.probe(tmp_path, nbytes=16 << 20, seconds=0.0, settle_s=0.0)
    # four turns of a quarter of 16 MiB each; the layout's writes are not counted
    assert (read, write) == ((16 << 20) / 1e9 / (4 * 0.5), (16 << 20) / 1e9 / (4 * 0.25))


def test_a_stream_keeps_the_disk_busy_until_its_block_ends(tmp_path: Path) -> None:
    import threading
    import time

    with disk.streaming(tmp_path, nbytes=4 << 20) as stream:
        time.sleep(0.3)
        read, write = stream.rates()  # GB/s read and written so far, each over its own time
        assert read > 0 and write > 0
        assert any(t.name == "tierzero-disk-stream" for t in threading.enumerate())
    assert not any(t.name == "tierzero-disk-stream" for t in threading.enumerate())
    with pytest.raises(ValueError, match="under one 4096-byte block each"):
        with disk.streaming(tmp_path, nbytes=4096):
            pass


def test_a_paused_stream_leaves_the_disk_idle(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    moves: list[float] = []
    real = disk._seconds_moving

    def counted(*args: object) -> float:
        moves.append(time.perf_counter())
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(disk, "_seconds_moving", counted)
    with disk.streaming(tmp_path, nbytes=4 << 20) as stream:
        with stream.paused():
            paused_at = len(moves)
            time.sleep(0.2)
            assert len(moves) == paused_at  # the pass under way ended before the block began
        time.sleep(0.2)
        assert len(moves) > paused_at
    stopped_at = len(moves)
    time.sleep(0.05)
    assert len(moves) == stopped_at


def test_the_slowdown_is_the_mean_of_the_paired_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each pair times the block alone and then beside the stream: a drift of the whole machine
    between pairs moves the pairs' ratios not at all, and a spike in one busy window of seven
    counts as a seventh of the slowdown, as the step pays for such spikes as often as they come."""
    from contextlib import contextmanager

    from tierzero.config import load_config
    from tierzero.placement import compute as block_timing

    class Stream:
        running = True

        @contextmanager
        def paused(self):  # type: ignore[no-untyped-def]
            Stream.running = False
            yield
            Stream.running = True

        def rates(self) -> tuple[float, float]:
            return 3.5, 7.0

    @contextmanager
    def streaming(path: object, nvme: object):  # type: ignore[no-untyped-def]
        yield Stream()

    # A warm-up, then seven pairs; the machine runs at half speed from the fifth pair. Apart, the
    # medians would read 2.5 beside against 1.0 alone; the median of the ratios, 1.25.
    alone = iter([1.0, 1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 2.0])
    busy = iter([1.25, 1.25, 4.0, 1.25, 2.5, 2.5, 2.5])
    # The forward's share of each pass alone: 0.3 in six of them, 0.9 in one; beside the disk, 0.9.
    share = iter([0.3, 0.3, 0.3, 0.9, 0.3, 0.3, 0.3, 0.3])

    def timed(*_: object) -> tuple[float, float]:
        if Stream.running:
            seconds = next(busy)
            return 0.9 * seconds, seconds
        seconds = next(alone)
        return next(share) * seconds, seconds

    monkeypatch.setattr(block_timing, "streaming", streaming)
    monkeypatch.setattr(block_timing, "_timed_pass", timed)
    Stream.running = False  # the warm-up pass
    model = {"type": "gpt", "n_layer": 1, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 32}
    raw = {"model": model, "train": {"micro_batch_size": 2, "seq_len": 32}, "tiers": {"nvme": {"path": str(tmp_path)}}}
    compute = block_timing.measure_compute(load_config(raw), seconds=0.0, rounds=7)
    flops, slowdown = compute.flops, compute.slowdown
    assert slowdown == pytest.approx((6 * 1.25 + 4.0) / 7)
    assert compute.forward_share == pytest.approx(0.3)  # the median of the passes alone
    beside = "1.64x slower beside the disk, which read 3.5 GB/s, wrote 7.0"
    assert flops.source.endswith(f", the forward 30% of it; {beside}")
    block = 6.0 * (4 * 64 * 64 + 4 * 64 + 2 * 64 * 256 + 256 + 64 + 4 * 64) * 2 * 32
    assert flops.read == block / 1.0  # the median of the seven passes alone


def test_a_slow_block_is_timed_in_fewer_pairs_once_the_limit_has_passed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pass of 2 s alone and 3 s beside the disk (the 2B block on a slow host): the pairs stop at
    the first that starts past `limit` seconds, but never before `MIN_ROUNDS` of them."""
    from contextlib import contextmanager

    from tierzero.config import load_config
    from tierzero.placement import compute as block_timing

    clock, beside, passes = [0.0], [False], []

    class Stream:
        @contextmanager
        def paused(self):  # type: ignore[no-untyped-def]
            beside[0] = False
            yield
            beside[0] = True

        def rates(self) -> tuple[float, float]:
            return 1.7, 1.7

    @contextmanager
    def streaming(path: object, nvme: object):  # type: ignore[no-untyped-def]
        beside[0] = True
        yield Stream()
        beside[0] = False

    def timed(*_: object) -> tuple[float, float]:
        seconds = 3.0 if beside[0] else 2.0
        clock[0] += seconds
        passes.append(beside[0])
        return 0.2 * seconds, seconds

    monkeypatch.setattr(block_timing, "streaming", streaming)
    monkeypatch.setattr(block_timing, "_timed_pass", timed)
    monkeypatch.setattr(block_timing.time, "perf_counter", lambda: clock[0])
    model = {"type": "gpt", "n_layer": 1, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 32}
    raw = {"model": model, "train": {"micro_batch_size": 2, "seq_len": 32}, "tiers": {"nvme": {"path": str(tmp_path)}}}
    for limit, pairs in ((30.0, block_timing.MIN_ROUNDS), (100.0, 21), (1000.0, 36)):
        passes.clear()
        compute = block_timing.measure_compute(load_config(raw), seconds=0.0, rounds=36, limit=limit)
        assert passes == [False] + [False, True] * pairs  # the warm-up, then the pairs
        assert compute.slowdown == pytest.approx(1.5)


def test_the_compute_is_planned_with_the_medians_of_the_days_measurements_of_its_block_and_disk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each measurement of a block beside a disk joins the day's of the same block beside the same
    disk, and the plan takes the medians of each figure; another disk's, a day-old one and an
    unreadable file take no part."""
    import time
    from types import SimpleNamespace

    from tierzero.common.cache_files import cache_path
    from tierzero.placement import compute as block_timing
    from tierzero.placement import history

    now = time.time()
    clock = [now]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    block = SimpleNamespace(what="fp32 one gpt block's forward and backward", flops=1e9)

    def measured(flops: float, slowdown: float, share: float, beside: str = "beside /swap") -> block_timing.Compute:
        clock[0] += 3600.0
        compute, _ = block_timing._remembered(block, flops, slowdown, share, how=f"timed at {flops:.0f}", beside=beside)
        return compute

    assert measured(99e9, 1.01, 0.24).flops.source == "timed at 99000000000"  # one: the measurement itself
    measured(120e9, 1.08, 0.25)
    other = measured(50e9, 2.0, 0.5, beside="beside /elsewhere")
    assert (other.flops.read, other.slowdown, other.forward_share) == (50e9, 2.0, 0.5)
    compute = measured(130e9, 1.10, 0.23)
    assert (compute.flops.read, compute.slowdown, compute.forward_share) == (120e9, 1.08, 0.24)
    assert compute.flops.source.startswith("the median of 3 measurements since ")
    assert compute.flops.source.endswith(": 120 GFLOP/s, the forward 24%, 1.08x beside")
    clock[0] += history.HISTORY_S - 2 * 3600.0  # the first two are over a day old, the third not
    compute = measured(140e9, 1.20, 0.30)
    assert (compute.flops.read, compute.slowdown) == (135e9, pytest.approx(1.15))
    clock[0] += history.HISTORY_S
    cache_path(block_timing.COMPUTE_FILE).write_text("{not json")
    compute = measured(110e9, 1.05, 0.26)  # an unreadable file is started anew, never trusted
    assert (compute.flops.read, compute.slowdown, compute.flops.source) == (110e9, 1.05, "timed at 110000000000")
    measured(111e9, 1.05, 0.26, beside="beside /elsewhere")
    clock[0] += history.HISTORY_S + 1
    measured(112e9, 1.05, 0.26)  # entries with nothing of the last day leave the file
    assert len(json.loads(cache_path(block_timing.COMPUTE_FILE).read_text())) == 1


def test_the_compute_is_measured_alone_and_beside_the_disk(tmp_path: Path) -> None:
    from tierzero.config import load_config
    from tierzero.placement.compute import measure_compute

    swap = tmp_path / "swap"
    swap.mkdir()
    model = {"type": "gpt", "n_layer": 1, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 32}
    raw = {"model": model, "train": {"micro_batch_size": 2, "seq_len": 32}, "tiers": {"nvme": {"path": str(swap)}}}
    compute = measure_compute(load_config(raw), seconds=1.0, rounds=6)
    flops, slowdown = compute.flops, compute.slowdown
    assert flops.read > 1e6 and slowdown >= 1.0 and 0.0 < compute.forward_share < 1.0
    assert f"{slowdown:.2f}x slower beside the disk, which read " in flops.source
    assert "one gpt block's forward and backward at 2x32 tokens" in flops.source
    alone = measure_compute(load_config({**raw, "tiers": {}}), seconds=1.0)  # no NVMe path: nothing to stream to
    assert alone.slowdown == 1.0 and "beside the disk" not in alone.flops.source and 0.0 < alone.forward_share < 1.0


def test_a_stream_that_fails_raises_when_its_block_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def full(*_: object) -> float:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk, "_seconds_moving", full)
    with pytest.raises(OSError, match="No space left on device"):
        with disk.streaming(tmp_path, nbytes=4 << 20):
            pass


def test_a_block_rate_far_off_the_days_is_measured_again_and_two_alike_replace_the_day(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first plan of a slow afternoon: its measurement alone is off the fast morning's median,
    so it is measured again; the second confirms the change and the plan takes the afternoon's."""
    from types import SimpleNamespace

    from tierzero.config import load_config
    from tierzero.placement import compute as block_timing

    block = SimpleNamespace(what="fp32 one gpt block's forward and backward", flops=1e9)
    lone = SimpleNamespace(what="fp32 another block", flops=1e9)  # one earlier measurement tells no side: none again
    assert [block_timing._remembered(lone, f, 1.1, 0.24, how="t", beside="b")[1] for f in (137e9, 90e9)] == [False, False]
    for flops in (137e9, 130e9, 135e9):
        block_timing._remembered(block, flops, 1.1, 0.24, how="morning", beside="beside /swap")
    afternoon = iter([100e9, 97e9, 125e9, 99e9])
    calls = []

    def measured(cfg: object, timed: object, *, seconds: float, rounds: int, limit: float) -> tuple[block_timing.Compute, bool]:
        calls.append(timed)
        return block_timing._remembered(block, next(afternoon), 1.1, 0.24, how="afternoon", beside="beside /swap")

    monkeypatch.setattr(block_timing, "_measured", measured)
    monkeypatch.setattr(block_timing._TimedBlock, "build", classmethod(lambda cls, cfg: block))
    model = {"type": "gpt", "n_layer": 1, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 32}
    cfg = load_config({"model": model, "train": {"seq_len": 32}})
    compute = block_timing.measure_compute(cfg)
    assert len(calls) == 2 and compute.flops.read == pytest.approx(98.5e9)  # the two afternoon ones' median
    # An odd one (125, 27% above 98.5) is measured again, and the second (99) says it was noise: kept among the rest.
    compute = block_timing.measure_compute(cfg)
    assert len(calls) == 4 and compute.flops.read == pytest.approx(99.5e9)
