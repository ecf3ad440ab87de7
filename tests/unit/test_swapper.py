"""The swapper's paths and guarantees: ordering per key, parallelism across keys, a bounded staging pool."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import threading
import time
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait

import pytest
import torch

from tierzero.common.slices import IO_ALIGNMENT, Tier
from tierzero.common.transfer import Transfer, TransferOutcome
from tierzero.offload.base import Region, TierStorage
from tierzero.offload.cpu import CpuTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier
from tierzero.swapper import Swapper


class GatedNvme(NvmeTier):
    """The real NVMe tier, with a gate and delays in front of its writes and a log of its I/O.

    A write is held until `gate` opens (and sleeps its delay) before it reaches the
    tier, and checks when it has landed that its source bytes did not change while it
    was in flight (which a reused staging buffer would do).
    """

    def __init__(self, path, *, capacity: int, delay: float = 0.0) -> None:
        super().__init__(path, capacity=capacity, block_size=64 << 10, queue_depth=4, threads=4)
        self.delay = delay
        self.gate = threading.Event()
        self.gate.set()
        self.write_delays: list[float] = []
        """Seconds each next write waits before it starts, first first (then `delay` applies)."""
        self.calls: list[tuple[str, int, int, int]] = []
        """(verb, position in the region, length, tensor address) of every I/O, in submission order."""
        self._held = ThreadPoolExecutor(max_workers=8)
        self._log_lock = threading.Lock()

    def submit_read(self, region: Region, dst: torch.Tensor, *, start: int = 0) -> Future[None]:
        with self._log_lock:
            self.calls.append(("read", start, dst.numel(), dst.data_ptr()))
        return super().submit_read(region, dst, start=start)

    def submit_write(self, region: Region, src: torch.Tensor, *, start: int = 0) -> Future[None]:
        with self._log_lock:
            self.calls.append(("write", start, src.numel(), src.data_ptr()))
            pause = self.write_delays.pop(0) if self.write_delays else self.delay * random.random()
        crc = zlib.crc32(src.numpy())

        def held() -> None:
            assert self.gate.wait(timeout=10), "test gate never opened"
            time.sleep(pause)
            NvmeTier.submit_write(self, region, src, start=start).result()
            assert zlib.crc32(src.numpy()) == crc, "source bytes changed while the write was in flight"

        return self._held.submit(held)

    def disk(self, region: Region) -> torch.Tensor:
        """The region's bytes as they are in the swap file now."""
        out = torch.empty(region.nbytes, dtype=torch.uint8)
        NvmeTier.submit_read(self, region, out).result()
        return out

    def close(self) -> None:
        self._held.shutdown(wait=True)
        super().close()


def _bytes(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def host() -> CpuTier:
    return CpuTier(reuse_limit=0)


@pytest.fixture
def make_disk(tmp_path):
    """Makes gated NVMe tiers in one directory and closes them after the test."""
    made: list[GatedNvme] = []

    def make(*, capacity: int, delay: float = 0.0) -> GatedNvme:
        made.append(GatedNvme(tmp_path, capacity=capacity, delay=delay))
        return made[-1]

    yield make
    for disk in made:
        disk.close()


def _tiers(tmp_path, host: CpuTier) -> dict[str, TierStorage]:
    nvme = NvmeTier(tmp_path, capacity=4 << 20, block_size=64 << 10, queue_depth=4, threads=2)
    return {"device": DeviceTier(), "cpu": host, "nvme": nvme}


SIZES = [1, 4095, 4096, 4097, 3 * 4096 + 5, 50_001]


@pytest.mark.parametrize("src_name", ["device", "cpu", "nvme"])
@pytest.mark.parametrize("dst_name", ["device", "cpu"])
def test_round_trip_between_every_tier_and_memory_is_bit_exact(tmp_path, host, src_name, dst_name) -> None:
    tiers = _tiers(tmp_path, host)
    storage, dst_tier = tiers[src_name], Tier(dst_name)
    with_memory = tiers[dst_name]
    swapper = Swapper(buffer_size=8192, buffer_count=2, host=host)
    try:
        for seed, n in enumerate(SIZES):
            region = storage.allocate(n, label=f"slice{n}")
            memory = with_memory.allocate(n, label=f"memory{n}")
            data = _bytes(n, seed)
            memory.buffer.copy_(data)
            swapper.write(key=n, storage=storage, region=region, src=memory.buffer, src_tier=dst_tier).wait()
            memory.buffer.zero_()
            swapper.read(key=n, storage=storage, region=region, dst=memory.buffer, dst_tier=dst_tier).wait()
            assert torch.equal(memory.buffer, data), f"{src_name}->{dst_name} {n} bytes"
        stats = swapper.stats()
        uses_pool = src_name == "nvme" and dst_name == "device"
        assert (stats.peak_in_use > 0) == uses_pool
        if uses_pool:
            assert stats.peak_in_use <= stats.capacity and stats.peak_held <= stats.capacity
    finally:
        swapper.close()
        for storage in tiers.values():
            storage.close()


def test_device_to_nvme_is_pipelined_chunk_by_chunk(make_disk, host) -> None:
    disk = make_disk(capacity=1 << 20)
    swapper = Swapper(buffer_size=4096, buffer_count=2, host=host)
    device = DeviceTier()
    n = 5 * 4096 + 7
    region, src = disk.allocate(n, label="s"), _bytes(n, 1)
    swapper.write(key="s", storage=disk, region=region, src=src, src_tier=Tier.DEVICE).wait()
    writes = [c for c in disk.calls if c[0] == "write"]
    assert [(offset, length) for _, offset, length, _ in writes] == [
        (i * 4096, 4096) for i in range(5)
    ] + [(5 * 4096, 7)]
    staging = {ptr for *_, ptr in writes}
    assert len(staging) == 2 and all(p % IO_ALIGNMENT == 0 for p in staging)  # two buffers, alternating
    assert all(p != src.data_ptr() for p in staging)  # device memory never went to the disk directly
    assert torch.equal(disk.disk(region), src)
    out = device.allocate(n, label="out")
    swapper.read(key="s", storage=disk, region=region, dst=out.buffer, dst_tier=Tier.DEVICE).wait()
    assert torch.equal(out.buffer, src)
    assert swapper.stats().peak_in_use == 2 * 4096
    swapper.close()


def test_cpu_nvme_goes_direct_into_the_tier_buffer(make_disk, host) -> None:
    disk = make_disk(capacity=1 << 20)
    swapper = Swapper(buffer_size=4096, buffer_count=2, host=host)
    n = 3 * 4096 + 1
    region, buffer = disk.allocate(n, label="s"), host.allocate(n, label="home")
    buffer.buffer.copy_(_bytes(n, 3))
    swapper.write(key="s", storage=disk, region=region, src=buffer.buffer, src_tier=Tier.CPU).wait()
    landing = host.allocate(n, label="copy")
    swapper.read(key="s", storage=disk, region=region, dst=landing.buffer, dst_tier=Tier.CPU).wait()
    assert disk.calls == [
        ("write", 0, n, buffer.buffer.data_ptr()),
        ("read", 0, n, landing.buffer.data_ptr()),
    ]
    assert torch.equal(landing.buffer, buffer.buffer)
    assert swapper.stats().peak_held == 0
    swapper.close()


@pytest.mark.parametrize("src_tier", [Tier.DEVICE, Tier.CPU])
def test_a_read_waits_for_the_pending_write_of_its_key(make_disk, host, src_tier) -> None:
    disk = make_disk(capacity=1 << 20)
    swapper = Swapper(buffer_size=4096, buffer_count=2, host=host)
    n = 3 * 4096
    region = disk.allocate(n, label="k")
    new = _bytes(n, 7)
    disk.gate.clear()
    write = swapper.write(key="k", storage=disk, region=region, src=new, src_tier=src_tier)
    out = torch.zeros(n, dtype=torch.uint8)
    read = swapper.read(key="k", storage=disk, region=region, dst=out, dst_tier=src_tier)
    time.sleep(0.1)
    assert not write.done() and not read.done()
    disk.gate.set()
    read.wait(timeout=10)
    assert write.done() and torch.equal(out, new)
    swapper.close()


@pytest.mark.parametrize(("src_tier", "n"), [(Tier.CPU, 4096), (Tier.DEVICE, 2 * 4096 + 100)])
def test_two_writes_of_one_key_land_in_order(make_disk, host, src_tier, n) -> None:
    disk = make_disk(capacity=1 << 20)
    disk.write_delays = [0.3]  # the first write is slow: unordered, the second would land first
    swapper = Swapper(buffer_size=4096, buffer_count=4, host=host)
    region = disk.allocate(n, label="k")
    first, second = _bytes(n, 1), _bytes(n, 2)
    a = swapper.write(key="k", storage=disk, region=region, src=first, src_tier=src_tier)
    b = swapper.write(key="k", storage=disk, region=region, src=second, src_tier=src_tier)
    b.wait(timeout=10)
    assert a.done()
    assert torch.equal(disk.disk(region), second)
    swapper.close()


def test_close_returns_when_ctrl_c_left_a_transfer_never_handed_to_a_worker(make_disk, host, monkeypatch) -> None:
    """A KeyboardInterrupt between a transfer becoming its key's tail and reaching a worker leaves it
    pending for ever; the close cancels it rather than wait (a run's Ctrl-C once hung there)."""
    disk = make_disk(capacity=1 << 20)
    swapper = Swapper(buffer_size=4096, buffer_count=2, host=host)
    region = disk.allocate(4096, label="k")

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(swapper._executor, "submit", interrupted)
    with pytest.raises(KeyboardInterrupt):
        swapper.write(key="k", storage=disk, region=region, src=_bytes(4096, 1), src_tier=Tier.CPU)
    monkeypatch.undo()
    closing = threading.Thread(target=swapper.close, daemon=True)
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive()


def test_different_keys_proceed_while_one_is_held(make_disk, host) -> None:
    disk = make_disk(capacity=1 << 20)
    blocked = make_disk(capacity=1 << 20)
    swapper = Swapper(buffer_size=4096, buffer_count=2, host=host)
    slow, fast = blocked.allocate(4096, label="slow"), disk.allocate(4096, label="fast")
    blocked.gate.clear()
    held = swapper.write(key="slow", storage=blocked, region=slow, src=_bytes(4096, 1), src_tier=Tier.CPU)
    for i in range(5):
        swapper.write(key="fast", storage=disk, region=fast, src=_bytes(4096, i), src_tier=Tier.CPU).wait(timeout=5)
    assert not held.done()
    blocked.gate.set()
    held.wait(timeout=5)
    swapper.close()


def test_staging_buffers_under_load_every_byte_verified(make_disk, host) -> None:
    disk = make_disk(capacity=8 << 20, delay=0.002)
    swapper = Swapper(buffer_size=4096, buffer_count=2, host=host, workers=4)
    rng = random.Random(0)
    sizes = [rng.choice([1, 4095, 4096, 4097, 9000, 20_000]) for _ in range(24)]
    regions = [disk.allocate(n, label=f"k{i}") for i, n in enumerate(sizes)]
    datas = [_bytes(n, 100 + i) for i, n in enumerate(sizes)]
    writes = [
        swapper.write(key=i, storage=disk, region=r, src=d, src_tier=Tier.DEVICE)
        for i, (r, d) in enumerate(zip(regions, datas))
    ]
    outs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    reads = [
        swapper.read(key=i, storage=disk, region=r, dst=o, dst_tier=Tier.DEVICE)
        for i, (r, o) in enumerate(zip(regions, outs))
    ]
    for transfer in writes + reads:
        transfer.wait(timeout=30)
    for i, (out, data) in enumerate(zip(outs, datas)):
        assert torch.equal(out, data), f"key {i} ({sizes[i]} bytes)"
    stats = swapper.stats()
    assert stats.peak_in_use <= 2 * 4096 and stats.peak_held <= 2 * 4096 and stats.in_use == 0
    swapper.close()


def test_reads_after_a_failed_write_fail_until_a_write_succeeds(make_disk, host, monkeypatch) -> None:
    disk = make_disk(capacity=1 << 20)
    real_pwritev, failures = os.pwritev, [OSError(errno.EIO, "disk on fire")]

    def fail_first_write(fd: int, iov: list, offset: int) -> int:
        if failures:
            raise failures.pop()
        return real_pwritev(fd, iov, offset)

    monkeypatch.setattr(os, "pwritev", fail_first_write)
    swapper = Swapper(buffer_size=4096, buffer_count=2, host=host)
    region, out = disk.allocate(4096, label="k"), torch.zeros(4096, dtype=torch.uint8)

    def read():
        return swapper.read(key="k", storage=disk, region=region, dst=out, dst_tier=Tier.CPU)

    def write(seed: int):
        return swapper.write(key="k", storage=disk, region=region, src=_bytes(4096, seed), src_tier=Tier.CPU)

    transfers = [write(0), read(), read(), write(1), read()]
    with pytest.raises(OSError, match="disk on fire"):
        transfers[0].wait(timeout=5)
    for failed_read in transfers[1:3]:
        with pytest.raises(RuntimeError, match="k: an earlier write of this key failed"):
            failed_read.wait(timeout=5)
    transfers[4].wait(timeout=5)
    assert torch.equal(out, _bytes(4096, 1))
    swapper.close()


def test_wrong_sized_tensor_is_refused(host) -> None:
    swapper = Swapper(buffer_size=4096, buffer_count=1, host=host)
    region = host.allocate(100, label="u0/grad")
    with pytest.raises(ValueError, match=r"u0/grad: expected a 1-D uint8 tensor of 100 bytes, got torch.float32 of shape \(25,\)"):
        swapper.read(key="k", storage=host, region=region, dst=torch.empty(25), dst_tier=Tier.CPU)
    swapper.close()
    with pytest.raises(ValueError, match="the swapper is closed"):
        swapper.read(key="k", storage=host, region=region, dst=torch.empty(100, dtype=torch.uint8), dst_tier=Tier.CPU)


@pytest.mark.asyncio
async def test_transfers_can_be_awaited(make_disk, host) -> None:
    disk = make_disk(capacity=1 << 20)
    swapper = Swapper(buffer_size=4096, buffer_count=2, host=host)
    region, data = disk.allocate(10_000, label="k"), _bytes(10_000, 5)
    await swapper.write(key="k", storage=disk, region=region, src=data, src_tier=Tier.DEVICE)
    out = torch.zeros(10_000, dtype=torch.uint8)
    transfers = [swapper.read(key="k", storage=disk, region=region, dst=out, dst_tier=Tier.DEVICE)]
    await asyncio.gather(*(asyncio.ensure_future(_awaited(t)) for t in transfers))
    assert torch.equal(out, data)
    swapper.close()


async def _awaited(transfer):
    return await transfer


def test_ctrl_c_in_a_callback_run_by_the_main_thread_is_not_swallowed() -> None:
    def interrupted(_: object) -> None:
        raise KeyboardInterrupt

    finished = Transfer.ready(1)
    # Already done: `then` runs the callback here, as a fetch whose bytes were there does.
    with pytest.raises(KeyboardInterrupt):
        finished.then(interrupted)

    def broken(_: object) -> None:
        raise ValueError("bad value")

    mapped = finished.then(broken)  # an ordinary error belongs to the transfer, for its waiter
    with pytest.raises(ValueError, match="bad value"):
        mapped.wait()
    failed: Future = Future()
    failed.set_exception(KeyboardInterrupt())
    # One stored by the transfer it follows is passed on to the waiter, not raised here.
    chained = Transfer(failed).then(lambda value: value)
    assert isinstance(chained.future.exception(), KeyboardInterrupt)


class _CopyEvent:
    """Stands in for the `torch.cuda.Event` a host-to-device copy ends with: only `query()` is asked."""

    fired = False

    def query(self) -> bool:
        return self.fired


def test_a_transfer_is_done_once_its_copy_event_has_fired() -> None:
    """On CUDA the host side of a copy ends when it is queued; a prefetch is a hit only once the copy ran."""
    event = _CopyEvent()
    queued: Future = Future()
    queued.set_result(TransferOutcome(value=1, event=event))
    transfer = Transfer(queued)
    mapped = transfer.then(lambda value: value)
    assert transfer.future.done() and not transfer.done() and not mapped.done()
    event.fired = True
    assert transfer.done() and mapped.done()
    failed: Future = Future()
    failed.set_exception(OSError("disk"))
    assert Transfer(failed).done()


def test_a_ready_transfer_is_a_finished_future_to_every_caller() -> None:
    """`Transfer.ready` builds its future without a condition of its own: each way callers use a finished
    `Future` must still see one, callbacks run at once, and many at once share nothing they can block on."""
    transfer = Transfer.ready(7)
    future = transfer.future
    assert transfer.wait() == 7 and transfer.done() and future.done() and not future.running() and not future.cancelled()
    assert future.result(timeout=0).value == 7 and future.exception(timeout=0) is None and not future.cancel()
    seen: list[int] = []
    future.add_done_callback(lambda done: seen.append(done.result().value))
    assert seen == [7] and transfer.settled()  # its callbacks run as they are added: none to wait for
    later: Future = Future()
    later.set_result(TransferOutcome(value=7))
    assert not Transfer(later).settled()  # finished, but another thread's callbacks may still be running
    done, pending = wait([future, Transfer.ready(8).future], timeout=0)
    assert len(done) == 2 and not pending
    assert transfer.then(lambda value: value + 1).wait() == 8
    assert asyncio.run(_awaited(Transfer.ready(9))) == 9
    with ThreadPoolExecutor(4) as pool:
        assert sorted(pool.map(lambda i: Transfer.ready(i).wait(), range(100))) == list(range(100))


async def _awaited(transfer: Transfer[int]) -> int:
    return await transfer
