"""The memory tiers (device emulated on host, cpu) and the staging pool."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tierzero.common.slices import IO_ALIGNMENT, Tier
from tierzero.config.loading import load_config
from tierzero.offload.base import TierCapacityError
from tierzero.offload.cpu import CpuTier, HostDeviceTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.staging import StagingPool
from tierzero.offload.tiers import tiers_from_config


def test_cpu_buffers_are_aligned_exact_and_counted() -> None:
    tier = CpuTier(capacity=1 << 20, reuse_limit=0)
    regions = [tier.allocate(n, label=f"r{n}") for n in (1, 4095, 4097, 10_000)]
    for region, n in zip(regions, (1, 4095, 4097, 10_000)):
        assert region.buffer is not None
        assert region.buffer.numel() == n and region.buffer.dtype == torch.uint8
        assert region.buffer.data_ptr() % IO_ALIGNMENT == 0
        assert region.tier is Tier.CPU
    assert tier.used == 1 + 4095 + 4097 + 10_000
    for region in regions:
        tier.free(region)
    assert tier.used == 0 and tier.kept_bytes == 0
    assert not tier.pinned  # no CUDA here: pinning must not be attempted


def test_cpu_capacity_refusal_names_tier_need_and_capacity() -> None:
    tier = CpuTier(capacity=3 << 20, reuse_limit=0)
    tier.allocate(2 << 20, label="first")
    with pytest.raises(TierCapacityError) as info:
        tier.allocate(2 << 20, label="u3/master")
    assert str(info.value) == (
        "cpu tier is full: needs 2.0 MiB for u3/master, 2.0 MiB of its 3.0 MiB capacity already in use; "
        "raise tiers.cpu.capacity or move state to a lower tier"
    )
    assert tier.used == 2 << 20  # the refused request left no trace


def test_freed_buffers_are_reused_by_exact_size_only() -> None:
    tier = CpuTier(capacity=None, reuse_limit=1 << 20)
    first = tier.allocate(8192, label="a")
    ptr = first.buffer.data_ptr()
    tier.free(first)
    assert tier.kept_bytes == 8192 and tier.used == 0 and tier.held == 8192
    other = tier.allocate(4096, label="b")  # another size: a new buffer
    assert tier.reused == 0 and other.buffer.data_ptr() != ptr
    again = tier.allocate(8192, label="c")
    assert tier.reused == 1 and again.buffer.data_ptr() == ptr and tier.kept_bytes == 0


def test_kept_buffers_are_bounded_by_the_reuse_limit() -> None:
    tier = CpuTier(capacity=None, reuse_limit=3 * 4096)
    regions = [tier.allocate(4096, label=str(i)) for i in range(5)]
    for region in regions:
        tier.free(region)
    assert tier.kept_bytes == 3 * 4096
    tier.close()
    assert tier.kept_bytes == 0


def test_by_default_kept_buffers_never_lift_what_the_tier_holds_past_its_live_peak() -> None:
    tier = CpuTier(capacity=None)
    # A step's pattern: three slices live at once, then released.
    first = [tier.allocate(1 << 20, label=f"a{i}") for i in range(3)]
    for region in first:
        tier.free(region)
    assert tier.kept_bytes == 3 << 20 and tier.held == 3 << 20
    # The same sizes next step come from the kept buffers, and nothing new is held.
    second = [tier.allocate(1 << 20, label=f"b{i}") for i in range(3)]
    assert tier.reused == 3 and tier.held == 3 << 20
    for region in second:
        tier.free(region)
    # A new size drops kept buffers so that held stays at the live peak (3 MiB) ...
    odd = tier.allocate(2 << 20, label="odd")
    assert tier.held == 3 << 20 and tier.kept_bytes == 1 << 20
    # ... and a live set past the old peak holds exactly the live bytes.
    big = tier.allocate(4 << 20, label="big")
    assert tier.used == 6 << 20 and tier.held == 6 << 20 and tier.kept_bytes == 0
    tier.free(odd)
    tier.free(big)
    tier.close()


def test_slack_keeps_buffers_of_other_sizes_past_the_live_peak_up_to_it_and_the_capacity() -> None:
    """[Note: slack for buffers of many sizes]: a step whose sizes alternate reuses every buffer."""
    tier = CpuTier(capacity=None, reuse_slack=2 << 20)
    small = [tier.allocate(1 << 20, label=f"s{i}") for i in range(3)]
    for region in small:
        tier.free(region)
    odd = tier.allocate(2 << 20, label="odd")  # without slack it dropped two kept MiB (the test above)
    assert tier.kept_bytes == 3 << 20 and tier.held == 5 << 20
    tier.free(odd)
    again = [tier.allocate(1 << 20, label=f"t{i}") for i in range(3)] + [tier.allocate(2 << 20, label="odd2")]
    assert tier.reused == 4 and tier.held == 5 << 20  # the next step's sizes, all from kept buffers
    for region in again:
        tier.free(region)
    big = tier.allocate(4 << 20, label="big")  # past the peak and the slack: kept ones go first
    assert tier.held <= (5 << 20) + (2 << 20) and tier.used == 4 << 20
    tier.free(big)
    capped = CpuTier(capacity=4 << 20, reuse_slack=8 << 20)
    regions = [capped.allocate(1 << 20, label=str(i)) for i in range(3)]
    for region in regions:
        capped.free(region)
    capped.allocate(2 << 20, label="big")
    assert capped.held <= 4 << 20  # the capacity bounds what slack may keep
    with pytest.raises(ValueError, match="reuse_slack must be >= 0 bytes, got -1"):
        CpuTier(reuse_slack=-1)


def test_a_run_without_a_gpu_gives_its_device_tier_the_kept_heap_as_slack() -> None:
    cfg = load_config({"tiers": {"cpu": {"keep_freed": "256MiB"}}})
    storages = tiers_from_config(cfg.tiers, nvme=False, device=torch.device("cpu"))
    device = storages[Tier.DEVICE]
    assert isinstance(device, HostDeviceTier) and device.reuse_slack == 256 << 20
    assert storages[Tier.CPU].reuse_slack == 0


def test_kept_buffers_make_room_before_a_refusal() -> None:
    # 3 MiB kept and 1 MiB live in a 4 MiB tier: a new 2 MiB region fits once kept ones go.
    tier = CpuTier(capacity=4 << 20, reuse_limit=8 << 20)
    kept = [tier.allocate(1 << 20, label=str(i)) for i in range(3)]
    live = tier.allocate(1 << 20, label="live")
    for region in kept:
        tier.free(region)
    assert tier.held == 4 << 20
    tier.allocate(2 << 20, label="big")
    assert tier.used == 3 << 20 and tier.held <= 4 << 20 and tier.kept_bytes == 1 << 20
    tier.free(live)
    assert tier.held <= 4 << 20


def test_free_twice_is_an_internal_error() -> None:
    tier = CpuTier(reuse_limit=0)
    region = tier.allocate(10, label="x")
    tier.free(region)
    with pytest.raises(AssertionError, match="x: freed twice"):
        tier.free(region)


def test_sizes_must_be_positive() -> None:
    with pytest.raises(ValueError, match="a cpu region needs a positive size, got 0 bytes for z"):
        CpuTier().allocate(0, label="z")


def test_emulated_device_budget_and_copies() -> None:
    tier = DeviceTier(capacity=10_000)
    assert tier.device == torch.device("cpu") and tier.capacity == 10_000
    region = tier.allocate(6_000, label="u0/param")
    src = torch.randint(0, 256, (6_000,), dtype=torch.uint8)
    tier.write(region, src)
    dst = torch.empty(6_000, dtype=torch.uint8)
    tier.read(region, dst)
    assert torch.equal(dst, src)
    with pytest.raises(TierCapacityError, match=r"device tier is full: needs 4.9 KiB for u1/param, 5.9 KiB of its 9.8 KiB"):
        tier.allocate(5_000, label="u1/param")
    tier.free(region)
    assert tier.used == 0
    tier.free(tier.allocate(10_000, label="exactly full"))


def test_negative_capacity_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"tiers.device.capacity must be >= 0 bytes, got -1"):
        DeviceTier(capacity=-1)


def test_pool_makes_buffers_on_need_and_never_more_than_its_count() -> None:
    pool = StagingPool(buffer_size=8192, buffer_count=2, host=CpuTier(reuse_limit=0))
    assert pool.stats().held == 0
    a = pool.acquire()
    b = pool.try_acquire()
    assert b is not None and a.index != b.index
    assert a.tensor.data_ptr() % IO_ALIGNMENT == 0 and a.tensor.numel() == 8192
    assert pool.try_acquire() is None
    stats = pool.stats()
    assert (stats.held, stats.in_use, stats.peak_in_use, stats.capacity) == (16384, 16384, 16384, 16384)
    pool.release(a)
    c = pool.try_acquire()
    assert c is a  # reuse only after release
    pool.release(c)
    with pytest.raises(AssertionError, match="given back twice"):
        pool.release(c)
    pool.release(b)
    pool.close()


def test_pool_acquire_blocks_until_a_buffer_comes_back() -> None:
    pool = StagingPool(buffer_size=4096, buffer_count=1)
    held = pool.acquire()
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(pool.acquire()))
    waiter.start()
    time.sleep(0.05)
    assert not got  # still blocked: the only buffer is lent
    pool.release(held)
    waiter.join(timeout=5)
    assert got == [held]
    pool.release(held)


def test_pool_counts_against_the_host_tier_and_reports_to_its_observer() -> None:
    host = CpuTier(capacity=3 * 4096, reuse_limit=0)
    pool = StagingPool(buffer_size=4096, buffer_count=4, host=host)
    deltas: list[int] = []
    pool.observe(deltas.append)
    buffers = [pool.acquire() for _ in range(3)]
    assert host.used == 3 * 4096 and deltas == [4096, 4096, 4096]
    with pytest.raises(TierCapacityError, match="staging buffer 3"):
        pool.try_acquire()
    for buffer in buffers:
        pool.release(buffer)
    pool.close()
    assert host.used == 0 and deltas[-1] == -3 * 4096


def test_pool_size_must_be_aligned() -> None:
    with pytest.raises(ValueError, match=r"positive multiple of 4096 bytes, got 5000: use 8192"):
        StagingPool(buffer_size=5000, buffer_count=2)
    with pytest.raises(ValueError, match=r"swapper.buffer_count must be >= 1, got 0"):
        StagingPool(buffer_size=4096, buffer_count=0)
