"""The host cache of NVMe-homed slices: its policy, and the store's bytes through it (tiers.nvme.cache)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.config import ConfigError, load_config
from tierzero.offload.base import TierCapacityError
from tierzero.offload.cpu import CpuTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier
from tierzero.store import TieredStore
from tierzero.store.cache_policy import Admission, CachePolicy
from tierzero.store.ledger import Use
from tierzero.swapper import Swapper

SLICE = 4096
"""Bytes of each slice in the store tests: 1024 fp32 elements."""


def _keys(n: int) -> list[SliceKey]:
    return [SliceKey(f"u{i}", Kind.MASTER) for i in range(n)]


def test_a_cyclic_scan_keeps_the_set_first_written_and_hits_it_every_cycle() -> None:
    policy, keys = CachePolicy(350), _keys(10)
    for key in keys:
        policy.track(key, 100)
    entered = [policy.write(key).entered for key in keys]  # set-up writes every first value
    assert entered == [True] * 3 + [False] * 7 and policy.used == 300
    for _ in range(5):
        hits = [key for key in keys if policy.read(key)]
        evicted = [victim for key in keys for victim in policy.write(key).evicted]
        # LRU would evict each slice just before its next read and hit nothing here.
        assert hits == keys[:3] and evicted == []
    assert [policy.cached(key) for key in keys] == [True] * 3 + [False] * 7


def test_slices_read_more_often_take_the_place_of_those_read_less_and_stay() -> None:
    policy = CachePolicy(300)
    frozen, once, twice, other, huge = [SliceKey(u, Kind.PARAM) for u in ("frozen", "once", "twice", "other", "huge")]
    for key, nbytes in ((frozen, 100), (once, 100), (twice, 100), (other, 100), (huge, 400)):
        policy.track(key, nbytes)
    for key in (frozen, once, other, twice, huge):
        policy.write(key)
    assert [policy.cached(k) for k in (frozen, once, other, twice, huge)] == [True, True, True, False, False]
    for cycle in range(4):
        policy.read(frozen)  # written once, read every cycle: never counted, never displaced
        policy.read(once)
        policy.write(once)
        policy.read(other)
        policy.write(other)
        policy.read(twice)
        assert policy.read(twice) is (cycle > 0)
        admission = policy.write(twice)
        if cycle == 0:  # read twice in its one cycle so far: the resident longest at one read makes room
            assert (admission.cached, admission.entered, admission.evicted) == (True, True, (once,))
        else:
            assert (admission.cached, admission.entered, admission.evicted) == (True, False, ())
        policy.read(huge)
        assert policy.write(huge).cached is False  # larger than the whole budget
    assert [policy.cached(k) for k in (frozen, once, other, twice)] == [True, False, True, True]
    assert policy.forget(twice) is True and policy.used == 200


def test_a_one_off_read_of_every_slice_moves_nothing() -> None:
    """A checkpoint reads every slice once more between two steps: no slice has shown it is read
    more often, not even the uncached ones a step reaches before the cached ones."""
    policy, keys = CachePolicy(200), _keys(4)
    for key in keys:
        policy.track(key, 100)
        policy.write(key)
    order = keys[2:] + keys[:2]
    for cycle in range(4):
        if cycle == 2:  # the save
            for key in keys:
                policy.read(key)
        for key in order:  # a step: each slice read, then written
            policy.read(key)
            assert policy.write(key).evicted == ()
    assert [policy.cached(key) for key in keys] == [True, True, False, False]


def _store(tmp_path: Path, *, cache: int, cpu_capacity: int = 64 << 20) -> TieredStore:
    cpu = CpuTier(capacity=cpu_capacity, reuse_limit=0)
    nvme = NvmeTier(tmp_path, capacity=1 << 20, block_size=64 << 10, queue_depth=4, threads=2)
    tiers = {Tier.DEVICE: DeviceTier(capacity=64 << 20), Tier.CPU: cpu, Tier.NVME: nvme}
    return TieredStore(tiers=tiers, swapper=Swapper(buffer_size=8192, buffer_count=2, host=cpu), cache=cache)


def _cache_bytes(store: TieredStore) -> int:
    return store.report().tiers[Tier.CPU].current_by_use[Use.CACHE]


def _settled(store: TieredStore, cached: int) -> None:
    """Wait for the cache's books to reach `cached` bytes: an evicted entry goes once its write lands."""
    deadline = time.monotonic() + 10
    while _cache_bytes(store) != cached and time.monotonic() < deadline:
        time.sleep(0.001)
    assert _cache_bytes(store) == cached


def _copies_gone(store: TieredStore) -> None:
    """Wait until no fetched copy is left in host memory: a released copy goes once its write lands."""
    deadline = time.monotonic() + 10
    while store.report().tiers[Tier.CPU].current_by_use[Use.FETCHED] and time.monotonic() < deadline:
        time.sleep(0.001)
    assert store.report().tiers[Tier.CPU].current_by_use[Use.FETCHED] == 0


def _step(store: TieredStore, key: SliceKey, *, to: Tier, value: torch.Tensor, reads: int = 1) -> None:
    """What a step does to a slice: read it `reads` times, then write its new value back."""
    for _ in range(reads):
        store.fetch(key, to=to).wait()
        store.release(key)
    store.fetch(key, to=to).wait().copy_(value)
    store.write_back(key)
    store.release(key)


def test_the_cached_set_moves_no_disk_bytes_and_an_eviction_writes_the_newest_value_home(tmp_path: Path) -> None:
    store = _store(tmp_path, cache=2 * SLICE)
    a, b, c = _keys(3)
    value = {key: [torch.randn(1024) for _ in range(3)] for key in (a, b, c)}
    with store:
        for key in (a, b, c):
            store.register(key, numel=1024, dtype=torch.float32, home=Tier.NVME)
            store.write_back(key, value[key][0])
        assert store.nvme_traffic() == (0, SLICE)  # a and b fill the cache; only c reaches the disk
        assert _cache_bytes(store) == 2 * SLICE
        cpu = store.report().tiers[Tier.CPU]
        assert cpu.current_by_kind[Kind.MASTER] == 2 * SLICE and cpu.current == 2 * SLICE
        # A read right after a write sees it, from the cache; b is read twice in this cycle, a once.
        assert torch.equal(store.fetch(b, to=Tier.DEVICE).wait(), value[b][0])
        store.release(b)
        _step(store, a, to=Tier.CPU, value=value[a][1], reads=0)
        _step(store, b, to=Tier.DEVICE, value=value[b][1], reads=0)
        assert store.nvme_traffic() == (0, SLICE)
        # c is read twice between its writes, as b was, a once: c takes the place of a, whose
        # newest value goes to disk, and c's own write goes to the cache. a's fetched copy goes once
        # its write into the cache lands, in the swapper's thread: the peak starts after that.
        _copies_gone(store)
        store.reset_peaks()
        _step(store, c, to=Tier.CPU, value=value[c][1], reads=1)
        assert store.nvme_traffic() == (2 * SLICE, 2 * SLICE)
        # a's entry went before c's was made: at most two entries and c's fetched copy at once
        # (the slices' own kind: the NVMe tier's bounce blocks come and go beside them).
        cpu = store.report().tiers[Tier.CPU]
        assert cpu.peak_by_kind[Kind.MASTER] == 3 * SLICE and _cache_bytes(store) == 2 * SLICE
        assert torch.equal(store.fetch(a, to=Tier.CPU).wait(), value[a][1])  # from the disk
        store.release(a)
        assert store.nvme_traffic() == (3 * SLICE, 2 * SLICE)
        _settled(store, 2 * SLICE)
        assert torch.equal(store.fetch(c, to=Tier.DEVICE).wait(), value[c][1])  # from the cache
        store.release(c)
        assert store.nvme_traffic() == (3 * SLICE, 2 * SLICE)
        store.unregister(c)  # a cached slice's entry goes unwritten
        _settled(store, SLICE)
    # close writes nothing: the swap file is scratch
    assert store.nvme_traffic() == (3 * SLICE, 2 * SLICE)


def test_a_write_back_is_ordered_before_the_next_fetch_without_waiting(tmp_path: Path) -> None:
    store = _store(tmp_path, cache=SLICE)
    (key,) = _keys(1)
    with store:
        store.register(key, numel=1024, dtype=torch.float32, home=Tier.NVME)
        store.write_back(key, torch.zeros(1024))
        for i in range(20):
            copy = store.fetch(key, to=Tier.DEVICE).wait()
            assert torch.equal(copy, torch.full((1024,), float(i)))
            copy.add_(1)
            store.write_back(key)  # not waited for
            store.release(key)
        assert store.nvme_traffic() == (0, 0)


def test_a_cpu_tier_too_small_for_the_cache_names_the_key_and_the_fix(tmp_path: Path) -> None:
    store = _store(tmp_path, cache=2 * SLICE, cpu_capacity=SLICE)
    a, b = _keys(2)
    with store:
        for key in (a, b):
            store.register(key, numel=1024, dtype=torch.float32, home=Tier.NVME)
        store.write_back(a, torch.ones(1024)).wait()
        with pytest.raises(TierCapacityError) as refused:
            store.write_back(b, torch.ones(1024))
    assert str(refused.value) == (
        f"cpu tier is full: needs 4.0 KiB for {b} in the NVMe cache (tiers.nvme.cache), 4.0 KiB of its "
        "4.0 KiB capacity already in use; lower tiers.nvme.cache or raise tiers.cpu.capacity"
    )


def test_the_config_refuses_a_cache_beyond_the_cpu_capacity(tmp_path: Path) -> None:
    raw = {
        "zero": {"stage": 3},
        "offload": {"optimizer": "nvme"},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
        "tiers": {"cpu": {"capacity": "1MiB"}, "nvme": {"path": str(tmp_path), "cache": "1MiB"}},
    }
    with pytest.raises(ConfigError) as refused:
        load_config(raw)
    assert refused.value.key == "tiers.nvme.cache"
    assert str(refused.value).endswith(
        "tiers.nvme.cache 1.0 MiB and the swapper's staging 256.0 KiB need 1.2 MiB of host memory but "
        "tiers.cpu.capacity is 1.0 MiB: lower tiers.nvme.cache or raise tiers.cpu.capacity"
    )
    assert load_config({**raw, "tiers": {**raw["tiers"], "nvme": {"path": str(tmp_path), "cache": "768KiB"}}})


def test_random_reads_and_writes_decide_as_the_rule_says_and_stay_within_the_budget() -> None:
    """Against the rule written out plainly, every resident looked at on every write."""
    rng = random.Random(0)
    keys = _keys(30)
    sizes = {key: rng.choice([100, 200, 300, 500]) for key in keys}
    policy = CachePolicy(1500)
    reads = dict.fromkeys(keys, 0)
    cycles: dict[SliceKey, list[int]] = {key: [] for key in keys}  # completed cycles' reads, newest last
    written: set[SliceKey] = set()
    reached: dict[SliceKey, tuple[int | None, int]] = {}  # resident -> (its score, when it reached it)
    evictions = 0

    def score(key: SliceKey) -> int | None:
        return max(cycles[key][-1], reads[key]) if cycles[key] else None

    for key in keys:
        policy.track(key, sizes[key])
    for step in range(3000):
        key = rng.choice(keys)
        if rng.random() < 0.6:
            reads[key] += 1
            assert policy.read(key) is (key in reached)
        else:
            if key in written:
                cycles[key].append(reads[key])
            written.add(key)
            reads[key] = 0
            admission = policy.write(key)
            if key in reached:
                assert admission == Admission(cached=True, entered=False)
            else:
                newcomer = min(cycles[key][-2:]) if cycles[key] else None
                need = sizes[key] - (1500 - sum(sizes[k] for k in reached))
                beaten = [(s, t, k) for k, (s, t) in reached.items() if None not in (s, newcomer) and s < newcomer]
                lower = sorted(beaten)
                victims = [k for i, (_, _, k) in enumerate(lower) if sum(sizes[v] for _, _, v in lower[:i]) < need]
                if need <= 0:
                    expected: tuple[SliceKey, ...] | None = ()
                elif sizes[key] > 1500 or sum(sizes[k] for k in victims) < need:
                    expected = None
                else:
                    expected = tuple(victims)
                assert admission.cached is (expected is not None), step
                if expected is not None:
                    assert admission.evicted == expected, step
                    evictions += len(expected)
                    for k in expected:
                        del reached[k]
                    reached[key] = (score(key), step)
        for k, (s, _) in list(reached.items()):
            if score(k) != s:
                reached[k] = (score(k), step)
        assert policy.used == sum(sizes[k] for k in reached) <= 1500
    assert evictions > 100, evictions
