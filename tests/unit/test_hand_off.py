"""The step's new parameters go up to the device from the step's memory (`SliceStore.adopt`), not
read back from NVMe: the bytes and bits a read would give, one disk crossing fewer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
import torch
from test_estimate import _raw, _train
from test_grad_norm import Stack

import tierzero
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.common.transfer import Transfer, TransferOutcome
from tierzero.config import load_config
from tierzero.estimate import estimate
from tierzero.offload.cpu import CpuTier
from tierzero.offload.device import DeviceTier
from tierzero.offload.nvme import NvmeTier
from tierzero.stages import Stage3
from tierzero.store import SliceState, TieredStore
from tierzero.store.ledger import Use
from tierzero.swapper import Swapper


def _count_reads(engine: Any, counted: Callable[[SliceKey, Tier], bool]) -> list[int]:
    """Wrap the engine's `store.fetch`: the returned one-item list counts the fetches `counted`
    picks that read the slice's home (none is fetched already)."""
    store, fetch, reads = engine.store, engine.store.fetch, [0]

    def counting(key: SliceKey, *, to: Tier) -> Any:
        if counted(key, to) and store.at_home(key):
            reads[0] += 1
        return fetch(key, to=to)

    store.fetch = counting
    return reads


def _store(tmp_path: Path) -> tuple[TieredStore, list[SliceKey]]:
    cpu = CpuTier(capacity=64 << 20, reuse_limit=0)
    tiers = {
        Tier.DEVICE: DeviceTier(capacity=64 << 20),
        Tier.CPU: cpu,
        Tier.NVME: NvmeTier(tmp_path, capacity=16 << 20, block_size=64 << 10, queue_depth=4, threads=2),
    }
    store = TieredStore(tiers=tiers, swapper=Swapper(buffer_size=8192, buffer_count=2, host=cpu))
    reads: list[SliceKey] = []
    read = store.swapper.read

    def counting(**kwargs: Any) -> Any:
        reads.append(kwargs["key"])
        return read(**kwargs)

    store.swapper.read = counting  # type: ignore[method-assign]
    return store, reads


def test_a_new_value_written_home_is_adopted_on_the_device_without_a_read(tmp_path: Path) -> None:
    store, reads = _store(tmp_path)
    with store:
        key = SliceKey("u", Kind.PARAM)
        store.register(key, numel=5000, dtype=torch.bfloat16, home=Tier.NVME)
        value = torch.randn(5000).to(torch.bfloat16)
        store.write_back(key, value)
        on_device = store.adopt(key, to=Tier.DEVICE, src=value).wait()
        assert torch.equal(on_device, value) and on_device.data_ptr() != value.data_ptr()
        assert reads == [] and store.state(key) is not SliceState.HOME
        store.release(key)
        assert torch.equal(store.fetch(key, to=Tier.DEVICE).wait(), value)  # the write landed home
        assert reads == [key]


def test_a_fetched_copy_moves_up_a_tier_and_the_old_one_goes(tmp_path: Path) -> None:
    store, reads = _store(tmp_path)
    with store:
        key = SliceKey("u", Kind.MASTER)
        store.register(key, numel=3000, dtype=torch.float32, home=Tier.NVME)
        store.write_back(key, torch.zeros(3000)).wait()
        host = store.fetch(key, to=Tier.CPU).wait()
        host.add_(torch.arange(3000.0))  # the step, in place
        store.write_back(key)
        moved = store.adopt(key, to=Tier.DEVICE)  # the caller now holds the device copy, not the host one
        assert torch.equal(moved.wait(), torch.arange(3000.0))
        store.swapper.close()  # every transfer has run: the host copy's release is due
        cpu = store.report().tiers[Tier.CPU]
        assert cpu.current_by_kind.get(Kind.MASTER, 0) == 0
        assert store.report().tiers[Tier.DEVICE].current_by_kind[Kind.MASTER] >= 3000 * 4
        assert reads == [key]  # the first fetch only


def test_whoever_sees_a_moved_copy_arrive_finds_the_old_one_freed(tmp_path: Path) -> None:
    """The step pipeline counts a handed-off group gone once the move up has landed: by then
    the host copy it read must be out of the books, whichever thread lands it."""
    store, _ = _store(tmp_path)
    gate: Future[TransferOutcome] = Future()
    copy = store.swapper.copy

    def gated(**kwargs: Any) -> Transfer:
        copy(**kwargs).wait()
        return Transfer(gate)  # lands when the test says, running its callbacks in this thread

    store.swapper.copy = gated  # type: ignore[method-assign]
    with store:
        key = SliceKey("u", Kind.MASTER)
        store.register(key, numel=3000, dtype=torch.float32, home=Tier.NVME)
        store.write_back(key, torch.zeros(3000)).wait()
        store.fetch(key, to=Tier.CPU).wait()
        store.write_back(key).wait()
        moved = store.adopt(key, to=Tier.DEVICE)
        held: list[int] = []

        def arrived(_: object) -> None:
            held.append(store.report().tiers[Tier.CPU].current_by_kind.get(Kind.MASTER, 0))

        moved.future.add_done_callback(arrived)
        assert held == []
        gate.set_result(TransferOutcome())
        assert held == [0]


def test_adopt_refuses_what_it_cannot_do_and_changes_nothing(tmp_path: Path) -> None:
    store, _ = _store(tmp_path)
    with store:
        key = SliceKey("u", Kind.PARAM)
        store.register(key, numel=100, dtype=torch.float32, home=Tier.NVME)
        with pytest.raises(ValueError, match="cannot adopt a copy of .* on nvme"):
            store.adopt(key, to=Tier.NVME, src=torch.zeros(100))
        with pytest.raises(ValueError, match="cannot move .* it is home"):
            store.adopt(key, to=Tier.DEVICE)
        with pytest.raises(ValueError, match="expects 100 elements of torch.float32"):
            store.adopt(key, to=Tier.DEVICE, src=torch.zeros(99))
        store.fetch(key, to=Tier.CPU).wait()
        with pytest.raises(ValueError, match="cannot adopt a copy of .* it is fetched"):
            store.adopt(key, to=Tier.DEVICE, src=torch.zeros(100))
        assert store.state(key) is SliceState.FETCHED
        assert store.report().tiers[Tier.DEVICE].current_by_kind.get(Kind.PARAM, 0) == 0
        assert store.report().tiers[Tier.DEVICE].current_by_use.get(Use.FETCHED, 0) == 0


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_next_forward_reads_no_parameter_back_from_nvme(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    def train(hand_off: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
        if not hand_off:
            monkeypatch.setattr(Stage3, "_wants_new_param", lambda self, unit: False)
        cfg = {
            "zero": {"stage": 3, "step_in_forward": True},
            "precision": {"param_dtype": dtype},
            "optimizer": {"type": "adamw", "lr": 1e-2},
            "gradient_clipping": 1.0,
            "offload": {"params": "nvme", "optimizer": "nvme"},
            "tiers": {"nvme": {"path": str(tmp_path)}},
        }
        read_in_forward: list[int] = []
        with tierzero.initialize(Stack(), cfg) as engine:
            # A real read from the home; an adopted copy is fetched already.
            reads = _count_reads(engine, lambda key, to: key.kind is Kind.PARAM)
            for step in range(4):
                reads[0] = 0
                loss = engine(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step)))
                read_in_forward.append(reads[0])
                engine.backward(loss)
                engine.step()
            state = engine.full_state_dict()
        monkeypatch.undo()
        assert state is not None
        return state, read_in_forward

    reference, read_back = train(hand_off=False)
    state, handed = train(hand_off=True)
    assert read_back[-1] == 4  # root and three blocks, each read back in every forward
    # From the third step on (the first learns the order, the second's step opens the
    # prefetcher's plan) the forward reads nothing: every stepped unit was handed up.
    assert handed[2:] == [0, 0], handed
    assert [name for name in reference if not torch.equal(state[name], reference[name])] == []


def _master_reads(tmp_path: Path, **zero: Any) -> tuple[dict[str, torch.Tensor], list[int]]:
    """fp32 stage 3, step in backward, parameters and optimizer on NVMe: the weights after 4 steps,
    and how many times each step read an fp32 master (a PARAM slice fetched to the cpu tier) from NVMe."""
    cfg = {
        "zero": {"stage": 3, **zero},
        "optimizer": {"type": "adamw", "lr": 1e-2},
        "gradient_clipping": 0.0,
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "tiers": {"nvme": {"path": str(tmp_path)}},
        "prefetch": {"bytes": 0},  # no slice kept or fetched ahead: every gather reads its shard
    }
    master_reads: list[int] = []
    with tierzero.initialize(Stack(), cfg) as engine:
        reads = _count_reads(engine, lambda key, to: key.kind is Kind.PARAM and to is Tier.CPU)
        for step in range(4):
            reads[0] = 0
            engine.backward(engine(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))))
            engine.step()
            master_reads.append(reads[0])
        state = engine.full_state_dict()
    assert state is not None
    return state, master_reads


def test_the_backward_gathers_copy_becomes_the_steps_master(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 stage 3, step in backward: a unit's PARAM slice is its master, and the gather just
    read it; moved down to the step instead of released, it is not read from NVMe again."""
    with monkeypatch.context() as patched:
        patched.setattr(Stage3, "_hand_down", lambda self, *args: False)
        reference, read_again = _master_reads(tmp_path)
    state, handed = _master_reads(tmp_path)
    assert read_again[1:] == [4] * 3  # root and three blocks: each master read after its gather
    assert handed[1:] == [1] * 3, handed  # only the root's (it is never handed down), from the second step
    assert [name for name in reference if not torch.equal(state[name], reference[name])] == []


def test_a_full_pipeline_lets_its_oldest_write_land_rather_than_read_a_master_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As on a disk that has not kept up: every write-back is still landing when the step's
    pipeline is asked for room. A unit's backward then waits for the oldest to land (its step
    would wait for it anyway), and its gathered copy still moves down to the step."""
    from tierzero.stages import step_pipeline
    monkeypatch.setattr(step_pipeline._Writing, "landed", lambda self: False)
    # Each Linear a unit: four step in backward, more than the pipeline's three groups.
    _, handed = _master_reads(tmp_path, unit_classes=["Linear"])
    assert handed[1:] == [1] * 3, handed  # the root's only, as with a disk that keeps up


def test_a_slow_move_up_holds_its_group_and_the_run_stays_within_the_estimate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A handed-off copy is freed once its move to the device has read it. A move queued behind
    other transfers (a loaded host) must hold its group in the step pipeline's bound, as the
    estimate counts it, or the next group's reads overrun a cpu tier sized to the estimate."""
    raw = _raw(tmp_path, stage=3, params="nvme", grads="cpu", optimizer="nvme", unit_classes=("Linear",))
    raw["tiers"]["nvme"]["cache"] = 40 << 10
    raw["tiers"]["cpu"] = {"capacity": estimate(load_config(raw)).tiers[Tier.CPU].need}
    copy, slowed = Swapper.copy, []

    def slow_moves_up(swapper: Swapper, *, key: Any, src: torch.Tensor, dst: torch.Tensor) -> Transfer:
        moved = copy(swapper, key=key, src=src, dst=dst)
        if not (isinstance(key, tuple) and key[-1] == "adopt"):
            return moved
        late: Future[TransferOutcome] = Future()
        threading.Timer(0.2, lambda: late.set_result(moved.future.result())).start()
        slowed.append(key)
        return Transfer(late)

    monkeypatch.setattr(Swapper, "copy", slow_moves_up)
    _train(raw, monkeypatch)
    assert slowed


@pytest.mark.parametrize("cuda", [False, True])
def test_the_counting_store_fetches_in_place_as_the_machine_it_counts_for(cuda: bool) -> None:
    """The estimate of a GPU machine, run on a host without one, holds a host-homed slice's fetch to the
    device as a copy, as that machine would: the stage keeps no such gather across the turn."""
    from tierzero.estimate.counting import CountingStore

    cfg = load_config({})
    store = CountingStore(cfg.tiers, cfg.swapper, cuda=cuda)
    host, device = SliceKey("host", Kind.PARAM), SliceKey("dev", Kind.PARAM)
    store.register(host, numel=4096, dtype=torch.float32, home=Tier.CPU)
    store.register(device, numel=4096, dtype=torch.float32, home=Tier.DEVICE)
    assert not store.fetched_in_place(host)
    store.fetch(host, to=Tier.DEVICE).wait()
    store.fetch(device, to=Tier.DEVICE).wait()
    assert (store.fetched_in_place(host), store.fetched_in_place(device)) == (not cuda, True)
