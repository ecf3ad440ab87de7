"""The host tier's pinned registrations ([Note: pinned registrations] in offload/pinned.py), on the
CPU through a runtime that behaves as CUDA's does: overlaps refused (712), each range unregistered once."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.offload.cpu import CpuTier, HostDeviceTier
from tierzero.offload.pinned import PinnedRange, PinnedRegistry
from tierzero.store import TieredStore
from tierzero.swapper import Swapper

ALREADY_REGISTERED, NOT_REGISTERED = 712, 713


class FakeCudart:
    """cudaHostRegister/cudaHostUnregister as the CUDA runtime answers them, with every call counted."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.registered = self.unregistered = 0
        self.errors: list[int] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        wanted = PinnedRange(ptr, size)
        if any(PinnedRange(start, n).overlaps(wanted) for start, n in self.live.items()):
            self.errors.append(ALREADY_REGISTERED)
            return ALREADY_REGISTERED
        self.live[ptr] = size
        self.registered += 1
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802 - CUDA's name
        if self.live.pop(ptr, None) is None:
            self.errors.append(NOT_REGISTERED)
            return NOT_REGISTERED
        self.unregistered += 1
        return 0


@pytest.fixture
def cudart() -> FakeCudart:
    return FakeCudart()


def _tier(cudart: FakeCudart, **kwargs: object) -> CpuTier:
    return CpuTier(capacity=64 << 20, registry=PinnedRegistry(cudart), **kwargs)


def test_allocate_free_and_reallocate_thousands_of_times(cudart: FakeCudart) -> None:
    """Buffers kept for reuse stay pinned; dropped ones are unpinned first; nothing ever overlaps."""
    rng = random.Random(0)
    tier, live = _tier(cudart, reuse_limit=1 << 20), []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            tier.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(tier.allocate(rng.choice([4096, 8192, 12288, 1 << 20]) + rng.randrange(3) * 4096, label="x"))
        if rng.random() < 0.01:
            gc.collect()
        assert len(cudart.live) == len(live) + sum(len(b) for b in tier._kept.values())
    for region in live:
        tier.free(region)
    tier.close()
    # Kept buffers are reused pinned (no new registration); every other allocation registers afresh.
    assert cudart.errors == [] and cudart.live == {} and cudart.registered == cudart.unregistered > 300
    assert tier.reused > 1000


def test_buffers_collected_without_close_are_unregistered_before_reuse(cudart: FakeCudart) -> None:
    """A store's tier dropped without close: its memory goes back to the heap only once unregistered,
    so the next engine's buffers, often on the same pages, pin cleanly (the H200's cudaError 712)."""
    for _ in range(12):
        tier = _tier(cudart)
        regions = [tier.allocate(3 << 20, label="slice") for _ in range(4)]
        assert all(r.buffer is not None for r in regions)
        del tier, regions
        gc.collect()
        assert cudart.live == {}
    assert cudart.errors == [] and cudart.registered == cudart.unregistered == 48


def test_two_tiers_side_by_side_share_the_process_registry(cudart: FakeCudart) -> None:
    registry = PinnedRegistry(cudart)
    a, b = (CpuTier(capacity=16 << 20, registry=registry, reuse_limit=0) for _ in range(2))
    held = [tier.allocate(1 << 20, label="x") for tier in (a, b) for _ in range(4)]
    assert len(registry.live()) == 8 and not any(x.overlaps(y) for i, x in enumerate(registry.live()) for y in registry.live()[i + 1 :])
    for region in held[:4]:
        a.free(region)
    assert len(registry.live()) == 4
    b.close()
    a.close()
    del held
    gc.collect()
    assert registry.live() == [] and cudart.errors == []


def test_an_overlapping_pin_is_refused_before_cuda_sees_it(cudart: FakeCudart) -> None:
    registry = PinnedRegistry(cudart)
    raw = torch.empty(3 * 4096, dtype=torch.uint8)
    registry.pin(raw[:8192])
    with pytest.raises(RuntimeError, match=r"pinning 8192 bytes at 0x[0-9a-f]+ overlaps the live registration of 8192 bytes"):
        registry.pin(raw[4096:])
    assert cudart.registered == 1 and cudart.errors == []
    registry.unpin(raw[:8192])
    registry.pin(raw[4096:])
    assert [r.nbytes for r in registry.live()] == [8192]


def test_a_pinned_store_moves_bytes_and_leaves_nothing_registered(cudart: FakeCudart) -> None:
    cpu = _tier(cudart, reuse_limit=0)
    assert cpu.pinned
    tiers = {Tier.DEVICE: HostDeviceTier(capacity=16 << 20), Tier.CPU: cpu}
    values = torch.arange(1024, dtype=torch.float32)
    with TieredStore(tiers=tiers, swapper=Swapper(buffer_size=4096, buffer_count=1, host=cpu)) as store:
        for step in range(20):
            key = SliceKey(f"u{step}", Kind.MASTER)
            store.register(key, numel=1024, dtype=torch.float32, home=Tier.CPU)
            store.write_back(key, values + step).wait()
            assert torch.equal(store.fetch(key, to=Tier.DEVICE).wait(), values + step)
            store.release(key)
            store.unregister(key)
    del store, tiers, cpu
    gc.collect()
    assert cudart.live == {} and cudart.errors == []


def test_without_a_runtime_or_cuda_nothing_is_pinned() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the tier pins")
    assert not CpuTier(capacity=1 << 20).pinned
    assert not PinnedRegistry().available
