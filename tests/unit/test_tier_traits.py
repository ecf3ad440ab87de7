"""A tier says what it can do in its `TierTraits`, and the store, the swapper and the plan act on
that alone: a tier of a new kind needs no branch of theirs."""

from __future__ import annotations

import pytest
import torch

from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.offload.base import Region, TierStorage, TierTraits
from tierzero.offload.cpu import CpuTier, HostDeviceTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.disk.busy import Busy
from tierzero.offload.nvme import NvmeTier
from tierzero.offload.tiers import TIER_CLASSES, traits_of
from tierzero.stages.plan import Homes, SlicePlan, SliceSpec
from tierzero.store import TieredStore
from tierzero.swapper import Swapper


class HeldBytes(TierStorage):
    """A tier of another kind than the three (say, a remote object store): regions are byte strings
    held apart from any tensor, so compute can never use them in place, and it has no ranged moves."""

    tier = Tier.NVME
    traits = TierTraits(in_memory=False)

    def __init__(self) -> None:
        self.blobs: dict[int, bytes] = {}
        self.moves = 0

    @property
    def capacity(self) -> int | None:
        return None

    @property
    def used(self) -> int:
        return sum(map(len, self.blobs.values()))

    def allocate(self, nbytes: int, *, label: str) -> Region:
        offset = max(self.blobs, default=-1) + 1
        self.blobs[offset] = bytes(nbytes)
        return Region(tier=self.tier, nbytes=nbytes, label=label, offset=offset)

    def free(self, region: Region) -> None:
        assert region.offset is not None
        del self.blobs[region.offset]

    def read(self, region: Region, dst: torch.Tensor) -> None:
        assert region.offset is not None
        dst.copy_(torch.frombuffer(bytearray(self.blobs[region.offset]), dtype=torch.uint8))
        self.moves += 1

    def write(self, region: Region, src: torch.Tensor) -> None:
        assert region.offset is not None
        self.blobs[region.offset] = src.numpy().tobytes()
        self.moves += 1


def test_each_tier_declares_its_traits() -> None:
    assert TIER_CLASSES == {Tier.DEVICE: DeviceTier, Tier.CPU: CpuTier, Tier.NVME: NvmeTier}
    assert traits_of(Tier.DEVICE) == traits_of(Tier.CPU) == HostDeviceTier.traits == TierTraits(in_memory=True)
    assert traits_of(Tier.NVME) == TierTraits(in_memory=False, direct_io=True, ranged=True, cached=True)


def test_a_tier_without_ranged_moves_says_so_instead_of_lacking_the_method() -> None:
    tier = HeldBytes()
    region = tier.allocate(16, label="x")
    with pytest.raises(NotImplementedError, match="the nvme tier cannot move part of a region"):
        tier.submit_read(region, torch.empty(16, dtype=torch.uint8))
    assert tier.bounce_stats() is None and tier.kept_bytes == 0 and tier.busy_now() == Busy()


def test_the_store_moves_a_new_kind_of_tier_by_its_traits_alone() -> None:
    cpu = CpuTier(capacity=1 << 20, reuse_limit=0)
    held = HeldBytes()
    tiers = {Tier.DEVICE: HostDeviceTier(capacity=1 << 20), Tier.CPU: cpu, Tier.NVME: held}
    key = SliceKey("u0", Kind.MASTER)
    values = torch.arange(64, dtype=torch.float32)
    with TieredStore(tiers=tiers, swapper=Swapper(buffer_size=4096, buffer_count=1, host=cpu), cache=1 << 20) as store:
        store.register(key, numel=64, dtype=torch.float32, home=Tier.NVME)
        with pytest.raises(ValueError, match=f"cannot fetch {key} to nvme: fetch to device or cpu"):
            store.fetch(key, to=Tier.NVME)
        store.write_back(key, values).wait()
        copy = store.fetch(key, to=Tier.CPU).wait()
        assert torch.equal(copy, values)
        store.release(key)
        # Not memory: every move crossed the tier (no cache: it declares none), and the store counts them.
        assert held.moves == 2
        assert store.nvme_traffic() == (values.nbytes, values.nbytes)
        assert store.report().bounce is None and store.nvme_busy() == Busy()


def test_the_plan_stages_what_lives_outside_memory() -> None:
    spec = SliceSpec(kind=Kind.GRAD, numel=8, dtype=torch.float32, home=Tier.NVME)
    plan = SlicePlan({"u0": (spec,), "u1": (SliceSpec(kind=Kind.PARAM, numel=8, dtype=torch.float32, home=Tier.CPU),)})
    assert plan.staged("u0", Kind.GRAD) and not plan.staged("u1", Kind.PARAM)
    assert not plan.staged("u1", Kind.GRAD)  # the unit keeps no gradient
    assert plan.spec("u0", Kind.GRAD) is spec and plan.home("u1", Kind.GRAD) is None
    with pytest.raises(KeyError, match="keeps no grad slice"):
        plan.spec("u1", Kind.GRAD)
    homes = Homes(grads=Tier.NVME, units={("u1", "grads"): Tier.CPU})
    assert homes.tier("u1", "grads") is Tier.CPU and homes.tier("u0", "grads") is Tier.NVME
    assert plan.home_bytes(Tier.NVME) == 4096 and plan.home_bytes(Tier.CPU) == 4096
    assert Homes(grads=Tier.NVME, units={("u1", "grads"): Tier.CPU}).tiers("grads") == {Tier.NVME, Tier.CPU}
