"""Without a GPU the device tier is host memory, as the cpu tier is: a copy between the two
changes tier instead of moving bytes, a gather at world size 1 is its fetched shard, and a
stale gradient's sum is written in one pass. The bits are those of the copies they replace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from test_grad_norm import Stack

import tierzero
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.offload.cpu import CpuTier, HostDeviceTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier
from tierzero.stages.grads.landing import add_into
from tierzero.store import TieredStore
from tierzero.swapper import Swapper

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the host is the compute device only without a GPU")


def _store(tmp_path: Path, *, device: type = HostDeviceTier) -> TieredStore:
    cpu = CpuTier(capacity=64 << 20, reuse_limit=0)
    tiers = {
        Tier.DEVICE: device(capacity=64 << 20),
        Tier.CPU: cpu,
        Tier.NVME: NvmeTier(tmp_path, capacity=16 << 20, block_size=64 << 10, queue_depth=4, threads=2),
    }
    return TieredStore(tiers=tiers, swapper=Swapper(buffer_size=8192, buffer_count=2, host=cpu))


def _fetched(store: TieredStore, kind: Kind) -> dict[Tier, int]:
    """Bytes of `kind` the memory tiers hold now (an NVMe-homed kind: its fetched copies)."""
    return {tier: usage.current_by_kind[kind] for tier, usage in store.report().tiers.items() if tier is not Tier.NVME}


def test_a_fetched_copy_changes_tier_without_a_copy(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        key = SliceKey("u", Kind.PARAM)
        store.register(key, numel=5000, dtype=torch.float32, home=Tier.NVME)
        value = torch.randn(5000)
        store.write_back(key, value).wait()
        on_device = store.fetch(key, to=Tier.DEVICE).wait()
        moved = store.adopt(key, to=Tier.CPU).wait()
        assert moved.data_ptr() == on_device.data_ptr() and torch.equal(moved, value)
        assert _fetched(store, Kind.PARAM) == {Tier.DEVICE: 0, Tier.CPU: 20000}
        moved.add_(1.0)
        store.write_back(key)
        # A write-back still reads the copy: this move copies, so the bytes it reads stay put.
        up = store.adopt(key, to=Tier.DEVICE).wait()
        assert up.data_ptr() != moved.data_ptr() and torch.equal(up, value + 1.0)
        store.release(key)  # the cpu copy goes once the write that reads it lands
        assert _fetched(store, Kind.PARAM)[Tier.DEVICE] == 0
        assert torch.equal(store.fetch(key, to=Tier.CPU).wait(), value + 1.0)


def test_a_slice_homed_in_one_memory_tier_is_fetched_to_the_other_as_its_home(tmp_path: Path) -> None:
    with _store(tmp_path) as store:
        key = SliceKey("u", Kind.PARAM)
        store.register(key, numel=5000, dtype=torch.float32, home=Tier.DEVICE)
        home = store.home_tensor(key)
        fetched = store.fetch(key, to=Tier.CPU).wait()
        assert fetched.data_ptr() == home.data_ptr()
        assert _fetched(store, Kind.PARAM) == {Tier.DEVICE: 20000, Tier.CPU: 0}  # the home's bytes, no copy's
        fetched.fill_(2.0)
        store.write_back(key).wait()
        store.release(key)
        assert torch.equal(store.home_tensor(key), torch.full((5000,), 2.0))


@pytest.mark.parametrize("device", [HostDeviceTier, DeviceTier], ids=["one-memory", "emulated-gpu"])
def test_scratch_handed_to_the_store_becomes_the_copy_or_is_copied_and_freed(tmp_path: Path, device: type) -> None:
    with _store(tmp_path, device=device) as store:
        key = SliceKey("u", Kind.GRAD)
        store.register(key, numel=3000, dtype=torch.float32, home=Tier.NVME)
        scratch = store.allocate(kind=Kind.GRAD, numel=3000, dtype=torch.float32, tier=Tier.DEVICE)
        scratch.copy_(torch.arange(3000.0))
        copy = store.adopt_scratch(key, to=Tier.CPU, scratch=scratch).wait()
        assert torch.equal(copy, torch.arange(3000.0))
        assert (copy.data_ptr() == scratch.data_ptr()) is (device is HostDeviceTier)
        with pytest.raises(ValueError, match="did not return"):
            store.free(scratch)  # the store took it over either way
        store.release(key)
        assert _fetched(store, Kind.GRAD) == {Tier.DEVICE: 0, Tier.CPU: 0}


def test_a_fresh_sum_has_the_bits_of_zeros_plus_each_gradient() -> None:
    pieces = [
        (7, torch.tensor([-0.0, 1.5, float("nan"), -2.0])),
        (0, torch.tensor([0.25, -0.0, 3.0])),
        (14, torch.tensor([-0.0, 1e-30]).to(torch.bfloat16)),
    ]
    expected = torch.zeros(20)
    add_into(expected, pieces, fresh=False)
    fresh = torch.full((20,), 123.0)
    add_into(fresh, pieces, fresh=True)
    assert torch.equal(fresh.view(torch.int32), expected.view(torch.int32))
    assert fresh[7].item() == 0.0 and not torch.signbit(fresh[7])  # -0.0 lands as zeros plus it: +0.0


def _train(tmp_path: Path, offload: dict[str, str], clipping: float) -> tuple[dict[str, torch.Tensor], list[Any]]:
    cfg = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-2},
        "gradient_clipping": clipping,
        "offload": offload,
        "tiers": {"nvme": {"path": str(tmp_path)}},
    }
    tmp_path.mkdir()
    scratch: list[Any] = []
    with tierzero.initialize(Stack(), cfg) as engine:
        allocate = engine.store.allocate

        def counting(**kwargs: Any) -> torch.Tensor:
            scratch.append((engine.stage._phase, kwargs["kind"]))
            return allocate(**kwargs)

        engine.store.allocate = counting
        for step in range(3):
            scratch.clear()
            engine.backward(engine(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))))
            engine.step()
        state = engine.full_state_dict()
    assert state is not None
    return state, scratch


@pytest.mark.parametrize("clipping", [0.0, 1.0], ids=["step-in-backward", "step-after-backward"])
def test_a_gather_of_one_rank_is_its_shard_and_trains_to_the_same_bits(tmp_path: Path, clipping: float) -> None:
    """Parameters on NVMe, gradients on NVMe (handed over from memory) or cpu: the same weights
    as with everything on the device, and a gather allocates a buffer of its own only in a
    backward whose step takes that copy as its fp32 master (parameters on NVMe, step in backward)."""
    reference, _ = _train(tmp_path / "device", {}, clipping)
    placements = ({"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}, {"params": "cpu", "optimizer": "cpu"})
    for offload in placements:
        state, scratch = _train(tmp_path / "-".join(offload.values()), offload, clipping)
        assert [name for name in reference if not torch.equal(state[name], reference[name])] == []
        gathered = {phase.value for phase, kind in scratch if kind is Kind.GATHERED}
        assert gathered == ({"backward"} if offload["params"] == "nvme" and clipping == 0 else set()), scratch


def test_a_handed_over_buffer_goes_back_to_the_tier_that_made_it(tmp_path: Path) -> None:
    """Gradients cycle device scratch -> step copy on cpu -> freed, every unit of every step: each
    freed buffer returns to the device tier's pool, so no tier's held memory grows with the cycles."""
    with _store(tmp_path) as store:
        device, cpu = store._tiers[Tier.DEVICE], store._tiers[Tier.CPU]
        key = SliceKey("u", Kind.GRAD)
        store.register(key, numel=3000, dtype=torch.float32, home=Tier.NVME)
        for _ in range(5):
            scratch = store.allocate(kind=Kind.GRAD, numel=3000, dtype=torch.float32, tier=Tier.DEVICE)
            store.adopt_scratch(key, to=Tier.CPU, scratch=scratch.fill_(1.0)).wait()
            store.release(key)
        assert device.reused == 4 and cpu.kept_bytes == 0 and device.held == 12000
