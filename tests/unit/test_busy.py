"""The disk's busy clocks: each way's time in flight, either way's, and the rates they make."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tierzero.offload.disk import busy as busy_module
from tierzero.offload.disk.busy import Busy, BusyClock
from tierzero.offload.nvme import NvmeTier


def _clock_at(monkeypatch: pytest.MonkeyPatch) -> tuple[BusyClock, list[float]]:
    now = [0.0]
    monkeypatch.setattr(busy_module.time, "perf_counter", lambda: now[0])
    return BusyClock(), now


def test_each_clock_runs_while_a_move_of_its_kind_is_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    clock, now = _clock_at(monkeypatch)
    clock.started("read", 300)  # t=0: a read ...
    now[0] = 1.0
    clock.started("write", 100)  # ... a write beside it from t=1 ...
    clock.started("read", 300)  # ... and a second read
    now[0] = 2.0
    clock.ended("read")
    assert clock.now() == Busy(600, 2.0, 100, 1.0, 2.0)  # moves in flight count up to now
    now[0] = 3.0
    clock.ended("read")
    now[0] = 4.0
    clock.ended("write")
    now[0] = 6.0  # idle: no clock runs
    clock.started("write", 50)
    now[0] = 7.0
    clock.ended("write")
    assert clock.now() == Busy(600, 3.0, 150, 4.0, 5.0)


def test_the_rates_add_up_to_the_time_the_disk_was_busy() -> None:
    """Reads busy 3 s and writes 3 s inside 4 s of either: 6/4 of each way's busy rate, so that
    600/read + 150/write = 4 s."""
    read, write = Busy(600, 3.0, 150, 3.0, 4.0).rates()
    assert (read, write) == (pytest.approx(300.0), pytest.approx(75.0))
    assert 600 / read + 150 / write == pytest.approx(4.0)
    assert Busy(600, 3.0, 150, 1.0, 4.0).rates() == (pytest.approx(200.0), pytest.approx(150.0))  # no overlap
    assert Busy(600, 3.0, 0, 0.0, 3.0).rates() is None  # one way only
    assert Busy(600, 3.0, 150, 3.0, 4.0) - Busy(100, 1.0, 50, 0.5, 1.5) == Busy(500, 2.0, 100, 2.5, 2.5)


def test_the_nvme_tier_counts_its_moves_and_stops_the_clock_for_one_it_failed_to_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with NvmeTier(tmp_path, capacity=1 << 20, block_size=1 << 16, queue_depth=4, threads=2) as tier:
        region = tier.allocate(1 << 20, label="x")
        data = torch.arange(1 << 20, dtype=torch.int32).to(torch.uint8)
        tier.submit_write(region, data).result()
        back = torch.empty(1 << 19, dtype=torch.uint8)
        tier.submit_read(region, back, start=1 << 19).result()
        moved = tier.busy.now()
        assert (moved.read_bytes, moved.write_bytes) == (1 << 19, 1 << 20)
        assert 0 < moved.read_s <= moved.any_s and 0 < moved.write_s <= moved.any_s
        assert torch.equal(back, data[1 << 19 :])

        def refuse(*_: object) -> None:
            raise ValueError("the NVMe tier is closed")

        monkeypatch.setattr(type(tier._queue), "submit", refuse)
        with pytest.raises(ValueError, match="closed"):
            tier.submit_read(region, back)
        failed = tier.busy.now()
        time.sleep(0.05)
        assert tier.busy.now() == failed  # no clock left running
