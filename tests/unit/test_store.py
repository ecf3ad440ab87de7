"""TieredStore: the API the stages use, its lifecycle rules and its byte accounting."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.offload.base import TierCapacityError
from tierzero.offload.cpu import CpuTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier
from tierzero.store import SliceState, TieredStore
from tierzero.store.ledger import Use
from tierzero.swapper import Swapper

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
NUMELS = [1, 4095, 4097, 3 * 1024 + 3]


def _store(tmp_path, *, device_capacity: int | None = 64 << 20, buffer_size: int = 8192) -> TieredStore:
    cpu = CpuTier(capacity=64 << 20, reuse_limit=0)
    tiers = {
        Tier.DEVICE: DeviceTier(capacity=device_capacity),
        Tier.CPU: cpu,
        Tier.NVME: NvmeTier(tmp_path, capacity=16 << 20, block_size=64 << 10, queue_depth=4, threads=2),
    }
    return TieredStore(tiers=tiers, swapper=Swapper(buffer_size=buffer_size, buffer_count=2, host=cpu))


def _values(numel: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    high = 256 if dtype == torch.uint8 else 1 << 40
    return torch.randint(0, high, (numel,), generator=g, dtype=dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


@pytest.mark.parametrize("home", list(Tier))
def test_round_trips_through_every_tier_pair_are_bit_exact(tmp_path, home) -> None:
    with _store(tmp_path) as store:
        for seed, (dtype, numel) in enumerate((d, n) for d in DTYPES for n in NUMELS):
            key = SliceKey(f"u{seed}", Kind.PARAM)
            store.register(key, numel=numel, dtype=dtype, home=home)
            original = _values(numel, dtype, seed)
            store.write_back(key, original).wait()
            for to in (Tier.DEVICE, Tier.CPU):
                fetched = store.fetch(key, to=to).wait()
                assert fetched.dtype == dtype and fetched.shape == (numel,)
                assert torch.equal(_bits(fetched), _bits(original)), f"{home}->{to} {dtype} {numel}"
                # Change the copy, write it back, and read it again through the other tier.
                updated = _values(numel, dtype, seed + 1000)
                fetched.copy_(updated)
                store.write_back(key).wait()
                store.release(key)
                other = Tier.CPU if to is Tier.DEVICE else Tier.DEVICE
                again = store.fetch(key, to=other).wait()
                assert torch.equal(_bits(again), _bits(updated))
                store.release(key)
                store.write_back(key, original).wait()
            store.unregister(key)
        assert store.report().tiers[home].current == 0


def test_fetch_to_the_home_tier_is_the_home_tensor_itself(tmp_path) -> None:
    with _store(tmp_path) as store:
        key = SliceKey("u0", Kind.MASTER)
        store.register(key, numel=1000, dtype=torch.float32, home=Tier.CPU)
        before = store.report()
        fetched = store.fetch(key, to=Tier.CPU).wait()
        assert fetched.data_ptr() == store.home_tensor(key).data_ptr()
        assert store.report().tiers[Tier.CPU].current == before.tiers[Tier.CPU].current
        assert store.fetch(key, to=Tier.CPU).wait() is fetched
        store.write_back(key).wait()
        store.release(key)
        assert store.state(key) is SliceState.HOME


def test_fetch_is_idempotent_and_states_advance(tmp_path) -> None:
    with _store(tmp_path) as store:
        key = SliceKey("u0", Kind.EXP_AVG)
        store.register(key, numel=5000, dtype=torch.float32, home=Tier.NVME)
        store.write_back(key, torch.arange(5000, dtype=torch.float32)).wait()
        first = store.fetch(key, to=Tier.DEVICE)
        assert store.fetch(key, to=Tier.DEVICE) is first
        tensor = first.wait()
        assert store.state(key) is SliceState.FETCHED
        assert torch.equal(tensor, torch.arange(5000, dtype=torch.float32))
        tensor.mul_(2)
        store.write_back(key).wait()
        assert store.state(key) is SliceState.FETCHED
        store.release(key)
        assert store.state(key) is SliceState.HOME
        assert torch.equal(store.fetch(key, to=Tier.CPU).wait(), torch.arange(5000, dtype=torch.float32) * 2)


def test_caller_mistakes_are_value_errors_that_say_what_to_do(tmp_path) -> None:
    with _store(tmp_path) as store:
        key = SliceKey("u7", Kind.GRAD)
        with pytest.raises(ValueError, match=r"^u7/grad is not registered in the store$"):
            store.fetch(key, to=Tier.DEVICE)
        store.register(key, numel=10, dtype=torch.float32, home=Tier.NVME)
        with pytest.raises(ValueError, match=r"^u7/grad is already registered; unregister it first$"):
            store.register(key, numel=10, dtype=torch.float32, home=Tier.CPU)
        with pytest.raises(ValueError, match=r"^cannot release u7/grad: it is home, expected fetching or fetched or writing$"):
            store.release(key)
        with pytest.raises(ValueError, match=r"^u7/grad lives on nvme, which has no tensor: fetch it to device or cpu$"):
            store.home_tensor(key)
        with pytest.raises(ValueError, match=r"^cannot fetch u7/grad to nvme: fetch to device or cpu$"):
            store.fetch(key, to=Tier.NVME)
        store.fetch(key, to=Tier.CPU).wait()
        with pytest.raises(ValueError, match=r"^u7/grad is already fetched to cpu, asked for device: release it first$"):
            store.fetch(key, to=Tier.DEVICE)
        with pytest.raises(ValueError, match=r"^cannot unregister u7/grad: it is fetched, expected home$"):
            store.unregister(key)
        with pytest.raises(ValueError, match=r"expects 10 elements of torch.float32, got 10 of torch.float16"):
            store.write_back(key, torch.zeros(10, dtype=torch.float16))
        with pytest.raises(ValueError, match=r"^u7/param: numel must be positive, got 0$"):
            store.register(SliceKey("u7", Kind.PARAM), numel=0, dtype=torch.float32, home=Tier.CPU)
        with pytest.raises(ValueError, match=r"allocate\(\) did not return"):
            store.free(torch.zeros(3))


def test_a_full_tier_refuses_and_nothing_is_spilled(tmp_path) -> None:
    with _store(tmp_path, device_capacity=40_000) as store:
        store.register(SliceKey("u0", Kind.PARAM), numel=8000, dtype=torch.float32, home=Tier.DEVICE)
        before = store.report()
        with pytest.raises(TierCapacityError) as info:
            store.register(SliceKey("u1", Kind.PARAM), numel=8000, dtype=torch.float32, home=Tier.DEVICE)
        assert str(info.value) == (
            "device tier is full: needs 31.2 KiB for u1/param, 31.2 KiB of its 39.1 KiB capacity already in use; "
            "raise tiers.device.capacity or move state to a lower tier"
        )
        with pytest.raises(ValueError, match=r"^u1/param is not registered"):
            store.state(SliceKey("u1", Kind.PARAM))
        assert store.report() == before  # no other tier took the bytes
        cpu_key = SliceKey("u2", Kind.MASTER)
        store.register(cpu_key, numel=8000, dtype=torch.float32, home=Tier.CPU)
        with pytest.raises(TierCapacityError, match="for u2/master fetched"):
            store.fetch(cpu_key, to=Tier.DEVICE)
        assert store.state(cpu_key) is SliceState.HOME


def test_accounting_is_exact_per_tier_kind_and_use(tmp_path) -> None:
    with _store(tmp_path, buffer_size=4096) as store:
        p, m, e = SliceKey("u0", Kind.PARAM), SliceKey("u0", Kind.MASTER), SliceKey("u0", Kind.EXP_AVG)
        store.register(p, numel=1000, dtype=torch.bfloat16, home=Tier.DEVICE)
        store.register(m, numel=1000, dtype=torch.float32, home=Tier.CPU)
        store.register(e, numel=3000, dtype=torch.float32, home=Tier.NVME)
        assert store.kind_bytes() == {Kind.PARAM: 2000, Kind.GRAD: 0, Kind.MASTER: 4000, Kind.EXP_AVG: 12000, Kind.EXP_AVG_SQ: 0}
        # One element into torch's 64-byte aligned allocation: never 4096-aligned, so always bounced.
        store.write_back(e, torch.ones(3001)[1:]).wait()
        store.fetch(m, to=Tier.DEVICE).wait()
        store.fetch(e, to=Tier.DEVICE).wait()
        gathered = store.allocate(kind=Kind.GATHERED, numel=500, dtype=torch.float32, tier=Tier.DEVICE, label="u0 full")
        report = store.report()
        device = report.tiers[Tier.DEVICE]
        assert device.current == 2000 + 4000 + 12000 + 2000
        assert device.current_by_kind[Kind.MASTER] == 4000 and device.current_by_kind[Kind.GATHERED] == 2000
        uses = {Use.HOME: 2000, Use.FETCHED: 16000, Use.SCRATCH: 2000, Use.STAGING: 0, Use.CACHE: 0}
        assert device.current_by_use == uses
        assert store.kind_bytes()[Kind.MASTER] == 4000  # homes only: the fetched copy is not counted
        cpu = report.tiers[Tier.CPU]
        # The 12000-byte nvme->device fetch went through the swapper's two 4096-byte staging buffers
        # (made from the cpu tier). The NVMe tier bounced the unaligned torch.ones source through one
        # 64 KiB block and the fetch's 3808-byte last chunk through one 4096-byte block.
        assert (report.staging.held, report.staging.peak_held) == (2 * 4096, 2 * 4096)
        assert (report.bounce.held, report.bounce.peak_held, report.bounce.capacity) == (65536 + 4096, 65536 + 4096, 4 * 65536)
        assert cpu.current_by_use[Use.STAGING] == cpu.current_by_kind[Kind.STAGING] == 2 * 4096 + 65536 + 4096
        assert cpu.current == 4000 + 2 * 4096 + 65536 + 4096
        store.release(m)
        store.release(e)
        store.free(gathered)
        after = store.report().tiers[Tier.DEVICE]
        assert (after.current, after.peak, after.peak_by_kind[Kind.EXP_AVG]) == (2000, 20000, 12000)
        store.reset_peaks()
        assert store.report().tiers[Tier.DEVICE].peak == 2000
        table = store.report().format()
        assert table.splitlines()[0].split()[:4] == ["tier", "current", "peak", "capacity"]
        device_row = next(line for line in table.splitlines() if line.startswith("device"))
        assert device_row.split()[:9] == ["device", "2.0", "KiB", "2.0", "KiB", "64.0", "MiB", "0", "B"]
        assert "staging: 2 x 4.0 KiB, held" in table
        assert "bounce: at most 4 x 64.0 KiB, held 68.0 KiB (peak 68.0 KiB)" in table


def test_release_right_after_write_back_frees_only_when_the_write_is_done(tmp_path) -> None:
    with _store(tmp_path) as store:
        key = SliceKey("u0", Kind.PARAM)
        store.register(key, numel=50_000, dtype=torch.float32, home=Tier.NVME)
        store.write_back(key, torch.zeros(50_000)).wait()
        store.fetch(key, to=Tier.CPU).wait().fill_(3.0)
        write = store.write_back(key)
        store.release(key)  # does not block; the copy goes once the write is done
        write.wait()
        assert store.report().tiers[Tier.CPU].current_by_use[Use.FETCHED] == 0
        assert torch.equal(store.fetch(key, to=Tier.DEVICE).wait(), torch.full((50_000,), 3.0))


@pytest.mark.asyncio
async def test_fetch_can_be_awaited(tmp_path) -> None:
    with _store(tmp_path) as store:
        keys = [SliceKey(f"u{i}", Kind.PARAM) for i in range(4)]
        for i, key in enumerate(keys):
            store.register(key, numel=3000 + i, dtype=torch.float16, home=Tier.NVME)
            await store.write_back(key, torch.full((3000 + i,), float(i), dtype=torch.float16))
        tensors = await asyncio.gather(*(_awaited(store.fetch(k, to=Tier.DEVICE)) for k in keys))
        for i, tensor in enumerate(tensors):
            assert torch.equal(tensor, torch.full((3000 + i,), float(i), dtype=torch.float16))


async def _awaited(transfer):
    return await transfer


def _store_from(cfg: SimpleNamespace, **kwargs: object) -> TieredStore:
    """`TieredStore.from_config` with the sections of `cfg`, as the engine builds it."""
    offload = cfg.offload
    nvme = Tier.NVME in (offload.params, offload.gradients, offload.optimizer)
    return TieredStore.from_config(cfg.tiers, cfg.swapper, nvme=nvme, **kwargs)


def _config(path, *, optimizer: Tier) -> SimpleNamespace:
    return SimpleNamespace(
        offload=SimpleNamespace(params=Tier.DEVICE, gradients=Tier.CPU, optimizer=optimizer),
        tiers=SimpleNamespace(
            device=SimpleNamespace(capacity=1 << 20),
            cpu=SimpleNamespace(capacity=2 << 20, pin_memory=True, keep_freed=0),
            nvme=SimpleNamespace(
                path=str(path), capacity=1 << 20, block_size=1 << 20, queue_depth=2, threads=1, verify=True,
                backend="pread", cache=0,
            ),
        ),
        swapper=SimpleNamespace(buffer_size=1 << 16, buffer_count=3),
    )


def test_from_config_builds_nvme_only_when_offloaded(tmp_path) -> None:
    def cfg(optimizer: Tier) -> SimpleNamespace:
        return _config(tmp_path, optimizer=optimizer)

    with _store_from(cfg(Tier.CPU)) as store:
        assert set(store.report().tiers) == {Tier.DEVICE, Tier.CPU}
        assert store.report().tiers[Tier.DEVICE].capacity == 1 << 20
    with _store_from(cfg(Tier.NVME), nvme_capacity=2 << 20) as store:
        assert store.report().tiers[Tier.NVME].capacity == 2 << 20
        assert store.report().staging.capacity == 3 << 16
        key = SliceKey("u0", Kind.EXP_AVG_SQ)
        store.register(key, numel=100_000, dtype=torch.float32, home=Tier.NVME)
        store.write_back(key, torch.linspace(0, 1, 100_000)).wait()
        assert torch.equal(store.fetch(key, to=Tier.DEVICE).wait(), torch.linspace(0, 1, 100_000))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the host is the compute device only without a GPU")
def test_without_a_gpu_nvme_moves_to_the_device_tier_are_direct_and_reuse_memory(tmp_path) -> None:
    from tierzero.common.slices import IO_ALIGNMENT
    from tierzero.offload.cpu import HostDeviceTier

    with _store_from(_config(tmp_path, optimizer=Tier.NVME), nvme_capacity=2 << 20) as store:
        device = store._tiers[Tier.DEVICE]
        assert isinstance(device, HostDeviceTier) and device.capacity == 1 << 20
        key = SliceKey("u0", Kind.EXP_AVG)
        store.register(key, numel=100_000, dtype=torch.float32, home=Tier.NVME)
        store.write_back(key, torch.linspace(0, 1, 100_000)).wait()
        pointers = []
        for value in (2.0, 3.0):
            fetched = store.fetch(key, to=Tier.DEVICE).wait()
            assert fetched.data_ptr() % IO_ALIGNMENT == 0
            pointers.append(fetched.data_ptr())
            fetched.fill_(value)
            store.write_back(key).wait()
            store.release(key)
        assert torch.equal(store.fetch(key, to=Tier.DEVICE).wait(), torch.full((100_000,), 3.0))
        store.release(key)
        report = store.report()
        assert report.staging.peak_held == 0  # no device<->NVMe move went through staging
        assert pointers[0] == pointers[1] and device.reused >= 2  # the freed copy came back


def test_ranks_given_one_run_id_share_its_directory_until_the_last_closes(tmp_path) -> None:
    from tierzero.offload.disk.files import new_run_id

    cfg, run_id = _config(tmp_path, optimizer=Tier.NVME), new_run_id()
    run_dir = tmp_path / run_id
    stores = [_store_from(cfg, rank=rank, run_id=run_id) for rank in (0, 1)]
    try:
        assert sorted(p.name for p in run_dir.iterdir()) == ["rank0.owner", "rank0.swap", "rank1.owner", "rank1.swap"]
        key = SliceKey("u0", Kind.EXP_AVG)
        for rank, store in enumerate(stores):
            store.register(key, numel=50_000, dtype=torch.float32, home=Tier.NVME)
            store.write_back(key, torch.full((50_000,), float(rank + 1))).wait()
        # Each rank reads its own bytes back: the two swap files do not share extents.
        for rank, store in enumerate(stores):
            assert torch.equal(store.fetch(key, to=Tier.CPU).wait(), torch.full((50_000,), float(rank + 1)))
            store.release(key)
        stores[0].close()
        assert sorted(p.name for p in run_dir.iterdir()) == ["rank1.owner", "rank1.swap"]
    finally:
        for store in stores:
            store.close()
    assert not run_dir.exists() and list(tmp_path.iterdir()) == []


def test_from_a_loaded_config_the_nvme_capacity_is_required(tmp_path) -> None:
    from tierzero.config import load_config

    cfg = load_config(
        {
            "zero": {"stage": 3},
            "offload": {"params": "nvme", "gradients": "cpu", "optimizer": "cpu"},
            "tiers": {"nvme": {"path": str(tmp_path)}, "device": {"capacity": "1MiB"}},
            "swapper": {"buffer_size": "64KiB", "buffer_count": 2},
        }
    )
    with pytest.raises(ValueError, match=r"tiers.nvme.capacity is not set"):
        _store_from(cfg)
    with _store_from(cfg, nvme_capacity=1 << 20) as store:
        usage = store.report().tiers
        assert (usage[Tier.DEVICE].capacity, usage[Tier.NVME].capacity, usage[Tier.CPU].capacity) == (1 << 20, 1 << 20, None)
        key = SliceKey("u0", Kind.PARAM)
        store.register(key, numel=70_000, dtype=torch.bfloat16, home=Tier.NVME)
        values = torch.randn(70_000).to(torch.bfloat16)
        store.write_back(key, values).wait()
        assert torch.equal(store.fetch(key, to=Tier.DEVICE).wait(), values)


def test_threads_cycling_their_own_keys_keep_bytes_and_books_exact(tmp_path) -> None:
    import threading

    with _store(tmp_path, buffer_size=4096) as store:
        keys = [SliceKey(f"u{i}", kind) for i in range(3) for kind in (Kind.PARAM, Kind.MASTER)]
        for i, key in enumerate(keys):
            store.register(key, numel=3000 + 7 * i, dtype=torch.float32, home=Tier.NVME if i % 2 else Tier.CPU)
            store.write_back(key, torch.full((3000 + 7 * i,), float(i))).wait()
        errors: list[BaseException] = []

        def cycle(i: int, key: SliceKey) -> None:
            try:
                for step in range(1, 6):
                    to = Tier.DEVICE if step % 2 else Tier.CPU
                    tensor = store.fetch(key, to=to).wait()
                    assert torch.equal(tensor, torch.full_like(tensor, float(i + step - 1)))
                    tensor.add_(1.0)
                    store.write_back(key)
                    store.release(key)
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=cycle, args=(i, key)) for i, key in enumerate(keys)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors, errors
        for i, key in enumerate(keys):
            assert torch.equal(store.fetch(key, to=Tier.CPU).wait(), torch.full((3000 + 7 * i,), float(i + 5)))
            store.release(key)
        for key in keys:
            store.unregister(key)
        report = store.report()
        assert all(usage.current_by_use[Use.FETCHED] == 0 for usage in report.tiers.values())
        assert store.kind_bytes() == dict.fromkeys(store.kind_bytes(), 0)
        assert report.staging.in_use == 0
    store.close()  # idempotent after the with block


def test_fetch_to_home_waits_for_a_write_back_still_in_flight() -> None:
    import threading
    import time

    class GatedCpu(CpuTier):
        gate = threading.Event()

        def write(self, region, src):
            assert self.gate.wait(timeout=10)
            super().write(region, src)

    cpu = GatedCpu(reuse_limit=0)
    tiers = {Tier.DEVICE: DeviceTier(), Tier.CPU: cpu}
    with TieredStore(tiers=tiers, swapper=Swapper(buffer_size=4096, buffer_count=1, host=cpu)) as store:
        key = SliceKey("u0", Kind.MASTER)
        store.register(key, numel=100, dtype=torch.float32, home=Tier.CPU)
        store.home_tensor(key).zero_()
        store.fetch(key, to=Tier.DEVICE).wait().fill_(7.0)
        write = store.write_back(key)
        store.release(key)
        at_home = store.fetch(key, to=Tier.CPU)
        time.sleep(0.05)
        assert not write.done() and not at_home.done()
        GatedCpu.gate.set()
        assert torch.equal(at_home.wait(timeout=5), torch.full((100,), 7.0))
        assert at_home.wait().data_ptr() == store.home_tensor(key).data_ptr()


def test_kept_host_buffers_are_reported_beside_the_current_bytes() -> None:
    cpu = CpuTier(capacity=1 << 20, reuse_limit=1 << 20)
    tiers = {Tier.DEVICE: DeviceTier(), Tier.CPU: cpu}
    with TieredStore(tiers=tiers, swapper=Swapper(buffer_size=4096, buffer_count=1, host=cpu)) as store:
        key = SliceKey("u0", Kind.PARAM)
        store.register(key, numel=2048, dtype=torch.float32, home=Tier.DEVICE)
        store.fetch(key, to=Tier.CPU).wait()
        store.release(key)
        usage = store.report().tiers[Tier.CPU]
        assert (usage.current, usage.kept) == (0, 8192)
        store.fetch(key, to=Tier.CPU).wait()  # the kept buffer serves the same size again
        usage = store.report().tiers[Tier.CPU]
        assert (usage.current, usage.kept, cpu.reused) == (8192, 0, 1)


def test_both_host_pools_stay_within_their_bounds_and_are_given_back_on_close(tmp_path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    store = _store(tmp_path, buffer_size=4096)  # staging 2 x 4 KiB; NVMe bounce at most 4 x 64 KiB
    keys = [SliceKey(f"u{i}", Kind.EXP_AVG_SQ) for i in range(8)]
    values = [_values(100_001, torch.float32, seed=i) for i in range(8)]
    for key in keys:
        store.register(key, numel=100_000, dtype=torch.float32, home=Tier.NVME)

    def cycle(i: int) -> None:
        # values[i][1:] starts 4 bytes past an allocation: the NVMe tier must bounce it.
        store.write_back(keys[i], values[i][1:]).wait(timeout=30)
        fetched = store.fetch(keys[i], to=Tier.DEVICE).wait(timeout=30)
        assert torch.equal(fetched, values[i][1:])
        store.release(keys[i])

    with ThreadPoolExecutor(max_workers=8) as pool:
        for done in [pool.submit(cycle, i) for i in range(8)]:
            done.result(timeout=60)  # re-raises a failed check of that thread
    report = store.report()
    assert report.staging.capacity == 2 * 4096 and 0 < report.staging.peak_held <= report.staging.capacity
    assert report.bounce.capacity == 4 * 65536 and 65536 <= report.bounce.peak_held <= report.bounce.capacity
    cpu = report.tiers[Tier.CPU]
    assert cpu.current_by_use[Use.STAGING] == report.staging.held + report.bounce.held
    assert cpu.peak_by_kind[Kind.STAGING] <= report.staging.capacity + report.bounce.capacity
    store.close()
    after = store.report()
    assert after.tiers[Tier.CPU].current_by_use[Use.STAGING] == 0 and after.bounce.held == 0


def test_a_fetch_is_in_place_only_where_the_home_is_the_copy(tmp_path) -> None:
    """`fetched_in_place`: the fetched copy is the home tensor (fetched to the home's own tier), not a copy
    read into another tier; nothing while only the home exists."""
    store = _store(tmp_path)
    homes = {"dev": Tier.DEVICE, "cpu": Tier.CPU, "nvme": Tier.NVME}
    keys = {name: SliceKey(name, Kind.PARAM) for name in homes}
    for name, home in homes.items():
        store.register(keys[name], numel=4096, dtype=torch.float32, home=home)
        assert not store.fetched_in_place(keys[name])
    store.fetch(keys["dev"], to=Tier.DEVICE).wait()
    store.fetch(keys["cpu"], to=Tier.CPU).wait()
    store.fetch(keys["nvme"], to=Tier.DEVICE).wait()
    assert [store.fetched_in_place(keys[name]) for name in homes] == [True, True, False]
    store.release(keys["cpu"])
    store.fetch(keys["cpu"], to=Tier.DEVICE).wait()  # these tiers are two memories: a copy
    assert not store.fetched_in_place(keys["cpu"])
    for key in keys.values():
        store.release(key)
        assert not store.fetched_in_place(key)
    store.close()
