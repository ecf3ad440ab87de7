"""The CUDA paths of the tiers and the swapper: pinned host buffers, the copy stream, staging to NVMe.

Skipped without CUDA. The stream tests hold a stream back with `torch.cuda._sleep` (a
kernel that spins for a number of GPU cycles) so that a missing stream wait would let a
copy overtake the work it must follow, and a host block would show up as wall time.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tierzero.common.slices import IO_ALIGNMENT, Kind, SliceKey, Tier
from tierzero.offload.base import TierCapacityError
from tierzero.offload.cpu import CpuTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier
from tierzero.store import TieredStore
from tierzero.swapper import Swapper

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

MiB = 1 << 20
SPIN_CYCLES = 1_000_000_000
"""About half a second of GPU time at 2 GHz: far longer than any host step it races."""


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@pytest.fixture
def host() -> CpuTier:
    tier = CpuTier(pin_memory=True, reuse_limit=0)
    yield tier
    tier.close()


def random_bytes(n: int, *, device: torch.device | str = "cpu", seed: int = 0) -> torch.Tensor:
    values = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    return values.to(device)


def copy_is_asynchronous(host_buffer: torch.Tensor) -> bool:
    """Whether a host-to-device copy from `host_buffer` returns while the stream is still busy.

    `Tensor.is_pinned()` cannot tell: it asks about the start of the tensor's storage, and
    the tier registers only the aligned slice of it. CUDA can: from registered (pinned)
    memory `cudaMemcpyAsync` just queues the copy, while from pageable memory it first
    synchronizes the stream, here held for about half a second by a spinning kernel.
    """
    device_buffer = torch.empty(host_buffer.numel(), dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(SPIN_CYCLES)
    started = time.perf_counter()
    device_buffer.copy_(host_buffer, non_blocking=True)
    returned = time.perf_counter() - started
    torch.cuda.synchronize()
    return returned < 0.25


def test_pinned_cpu_buffers_are_exact_sized_and_round_trip(host: CpuTier) -> None:
    assert host.pinned
    sizes = [1, 4097, 3 * MiB + 5]
    regions = []
    for seed, n in enumerate(sizes):
        region = host.allocate(n, label=f"slice{seed}")
        buffer = region.buffer
        assert buffer.numel() == n and buffer.data_ptr() % IO_ALIGNMENT == 0
        data = random_bytes(n, seed=seed)
        buffer.copy_(data)
        on_gpu = buffer.to("cuda", non_blocking=True)
        back = torch.zeros(n, dtype=torch.uint8)
        back.copy_(on_gpu)
        torch.cuda.synchronize()
        assert torch.equal(back, data)
        regions.append(region)
    assert host.used == sum(sizes)  # exact bytes, no power-of-two rounding
    largest = regions[-1].buffer
    assert copy_is_asynchronous(largest), "the cpu tier's buffer is not registered with CUDA"
    host.free(regions[-1])
    # With reuse_limit=0 the tier unregisters the buffer it lets go: copies from it sync again.
    assert not copy_is_asynchronous(largest)
    for region in regions[:-1]:
        host.free(region)
    assert host.used == 0


def test_host_to_device_waits_on_the_stream_not_the_host(cuda: torch.device, host: CpuTier) -> None:
    n = 64 * MiB
    swapper = Swapper(buffer_size=MiB, buffer_count=2, host=host)
    device = DeviceTier(device=cuda)
    try:
        src = host.allocate(n, label="home")
        src.buffer.copy_(random_bytes(n, seed=1))
        expected = int(src.buffer.sum(dtype=torch.int64))
        dst = device.allocate(n, label="copy")
        # The caller's stream is busy, then zeroes the destination: the copy must land after both.
        torch.cuda._sleep(SPIN_CYCLES)
        dst.buffer.zero_()
        started = time.perf_counter()
        transfer = swapper.read(key="k", storage=host, region=src, dst=dst.buffer, dst_tier=Tier.DEVICE)
        transfer.wait(timeout=10)
        waited = time.perf_counter() - started
        event = transfer.future.result().event
        assert event is not None
        assert not event.query(), "the copy finished before the spinning kernel it must follow"
        assert waited < 0.25, f"wait() blocked the host for {waited:.3f} s"
        # Consumed at once on the caller's stream, which wait() ordered after the copy.
        total = dst.buffer.sum(dtype=torch.int64)
        assert int(total) == expected
        assert torch.equal(dst.buffer.cpu(), src.buffer)
    finally:
        swapper.close()


def test_device_to_host_follows_the_producer_on_the_callers_stream(cuda: torch.device, host: CpuTier) -> None:
    n = 32 * MiB
    swapper = Swapper(buffer_size=MiB, buffer_count=2, host=host)
    try:
        produced = torch.zeros(n, dtype=torch.uint8, device=cuda)
        values = random_bytes(n, device=cuda, seed=2)
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN_CYCLES)
        produced.copy_(values)  # still queued behind the spin when the write is submitted
        home = host.allocate(n, label="home")
        swapper.write(key="k", storage=host, region=home, src=produced, src_tier=Tier.DEVICE).wait(timeout=10)
        assert torch.equal(home.buffer, values.cpu())
    finally:
        swapper.close()


@pytest.mark.parametrize("verify", [False, True])
def test_device_nvme_through_pinned_staging_is_bit_exact(tmp_path: Path, cuda: torch.device, host: CpuTier, verify: bool) -> None:
    n = 5 * MiB + 12_345
    swapper = Swapper(buffer_size=MiB, buffer_count=3, host=host)
    device = DeviceTier(device=cuda)
    with NvmeTier(tmp_path, capacity=16 * MiB, block_size=MiB, queue_depth=4, threads=4, verify=verify) as nvme:
        try:
            region = nvme.allocate(n, label="u0/param")
            src = random_bytes(n, device=cuda, seed=3)
            torch.cuda._sleep(SPIN_CYCLES // 4)
            src.add_(1)  # produced on the caller's stream after a spin; the write must see it
            expected = src.cpu()
            swapper.write(key="k", storage=nvme, region=region, src=src, src_tier=Tier.DEVICE).wait(timeout=30)
            on_disk = torch.empty(n, dtype=torch.uint8)
            nvme.read(region, on_disk)
            assert torch.equal(on_disk, expected)
            dst = device.allocate(n, label="copy")
            dst.buffer.fill_(0xA5)
            swapper.read(key="k", storage=nvme, region=region, dst=dst.buffer, dst_tier=Tier.DEVICE).wait(timeout=30)
            assert torch.equal(dst.buffer, src)
            stats = swapper.stats()
            assert 0 < stats.peak_in_use <= 3 * MiB and stats.peak_held <= 3 * MiB and stats.in_use == 0
        finally:
            swapper.close()


def test_device_capacity_is_accounted_on_a_real_gpu(cuda: torch.device) -> None:
    whole = DeviceTier(device=cuda)
    assert whole.capacity == torch.cuda.get_device_properties(cuda).total_memory
    tier = DeviceTier(device=cuda, capacity=8 * MiB)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # a fresh segment, split to the request, so the count below is exact
    before = torch.cuda.memory_allocated(cuda)
    n = 6 * MiB + 100
    region = tier.allocate(n, label="u0/grad")
    grown = torch.cuda.memory_allocated(cuda) - before
    assert region.buffer.is_cuda and tier.used == n
    assert n <= grown < n + 512, f"the allocator holds {grown} bytes for {n}"
    with pytest.raises(TierCapacityError, match=r"device tier is full: needs 2\.0 MiB for u1/grad, 6\.0 MiB of its 8\.0 MiB capacity already in use"):
        tier.allocate(2 * MiB, label="u1/grad")
    tier.free(region)
    assert tier.used == 0 and torch.cuda.memory_allocated(cuda) == before


def test_store_fetches_to_the_gpu_and_accounts_the_copy(tmp_path: Path, cuda: torch.device) -> None:
    cpu = CpuTier(pin_memory=True, reuse_limit=0)
    tiers = {
        Tier.DEVICE: DeviceTier(device=cuda, capacity=64 * MiB),
        Tier.CPU: cpu,
        Tier.NVME: NvmeTier(tmp_path, capacity=64 * MiB, block_size=MiB, queue_depth=4, threads=2, verify=True),
    }
    with TieredStore(tiers=tiers, swapper=Swapper(buffer_size=MiB, buffer_count=2, host=cpu)) as store:
        values = torch.randn(3 * MiB // 4 + 7, generator=torch.Generator().manual_seed(4))
        for home in (Tier.CPU, Tier.NVME):
            key = SliceKey(f"on_{home.value}", Kind.MASTER)
            store.register(key, numel=values.numel(), dtype=torch.float32, home=home)
            store.write_back(key, values).wait(timeout=30)
            fetched = store.fetch(key, to=Tier.DEVICE).wait(timeout=30)
            assert fetched.is_cuda and torch.equal(fetched.cpu(), values)
            usage = store.report().tiers[Tier.DEVICE]
            assert usage.current == values.numel() * 4 and usage.current_by_kind[Kind.MASTER] == values.numel() * 4
            fetched.mul_(2)
            store.write_back(key).wait(timeout=30)
            store.release(key)
            again = store.fetch(key, to=Tier.CPU).wait(timeout=30)
            assert torch.equal(again, values * 2)
            store.release(key)
            store.unregister(key)
        assert store.report().tiers[Tier.DEVICE].current == 0


def test_the_nvme_cache_serves_the_gpu_from_pinned_entries_in_stream_order(tmp_path: Path, cuda: torch.device) -> None:
    cpu = CpuTier(pin_memory=True, reuse_limit=0)
    tiers = {
        Tier.DEVICE: DeviceTier(device=cuda, capacity=64 * MiB),
        Tier.CPU: cpu,
        Tier.NVME: NvmeTier(tmp_path, capacity=64 * MiB, block_size=MiB, queue_depth=4, threads=2, verify=True),
    }
    values = torch.randn(3 * MiB // 4 + 7, generator=torch.Generator().manual_seed(5))
    n = values.numel() * 4
    swapper = Swapper(buffer_size=MiB, buffer_count=2, host=cpu)
    with TieredStore(tiers=tiers, swapper=swapper, cache=n) as store:  # room for one slice
        a, b = SliceKey("a", Kind.MASTER), SliceKey("b", Kind.MASTER)
        for key, value in ((a, values), (b, values + 1)):
            store.register(key, numel=values.numel(), dtype=torch.float32, home=Tier.NVME)
            store.write_back(key, value).wait(timeout=30)
        assert store.nvme_traffic() == (0, n)  # a entered the cache; b went to disk
        for step in range(3):
            fetched = store.fetch(a, to=Tier.DEVICE).wait(timeout=30)
            assert fetched.is_cuda and torch.equal(fetched.cpu(), values * 2**step)
            torch.cuda._sleep(SPIN_CYCLES // 4)
            fetched.mul_(2)  # queued behind the spin: the copy into the entry must follow it
            store.write_back(a)
            store.release(a)
        assert store.nvme_traffic() == (0, n)
        # b, read twice between its writes, takes a's place: a's newest value goes to disk.
        for _ in range(2):
            fetched = store.fetch(b, to=Tier.DEVICE).wait(timeout=30)
            store.release(b)
        fetched = store.fetch(b, to=Tier.DEVICE).wait(timeout=30)
        fetched.add_(1)
        store.write_back(b)
        store.release(b)
        assert store.nvme_traffic() == (3 * n, 2 * n)
        assert torch.equal(store.fetch(a, to=Tier.DEVICE).wait(timeout=30).cpu(), values * 8)  # from the disk
        store.release(a)
        assert torch.equal(store.fetch(b, to=Tier.CPU).wait(timeout=30), values + 1 + 1)  # from the cache
        store.release(b)
        assert store.nvme_traffic() == (4 * n, 2 * n)
