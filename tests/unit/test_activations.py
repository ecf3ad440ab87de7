"""Activations: counted in the device tier, recomputed (activations.checkpoint) or parked in the
cpu tier (activations.offload), with the same bits as keeping them; stage 3 composes with both."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import Case  # noqa: E402


def _run(
    stage: int, activations: dict[str, Any], tmp_path: Path, *, offload: dict[str, str] | None = None, clip: float = 0.5
) -> Any:
    case = Case(stage=stage, optimizer="adamw", steps=3, accumulation=2, global_batch=4, seq=32, clip=clip)
    config = case.config() | {"activations": activations}
    if offload:
        config |= {"offload": offload, "tiers": {"nvme": {"path": str(tmp_path)}}}
    losses, peaks = [], []
    with tierzero.initialize(case.model(), config) as engine:
        for step in range(case.steps):
            engine.store.reset_peaks()
            loss = case.loss(engine, *case.batch(step))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            peaks.append(engine.memory_report()["activations"])
        current = engine.store.report().tiers
        left = {tier.value: usage.current_by_kind.get(tierzero.common.slices.Kind.ACTIVATION, 0) for tier, usage in current.items()}
        return losses, engine.full_state_dict(), peaks[-1], left


@pytest.mark.parametrize(("stage", "clip"), [(1, 0.5), (3, 0.5), (3, 0.0)], ids=["stage1", "stage3", "stage3-step-in-backward"])
def test_checkpointing_and_offload_keep_the_bits_and_move_the_bytes(stage: int, clip: float, tmp_path: Path) -> None:
    offload = {"params": "nvme", "optimizer": "nvme"} if stage == 3 else None
    kept = _run(stage, {}, tmp_path, offload=offload, clip=clip)
    half = _run(stage, {"checkpoint": 2}, tmp_path, offload=offload, clip=clip)
    checkpointed = _run(stage, {"checkpoint": 1}, tmp_path, offload=offload, clip=clip)
    parked = _run(stage, {"checkpoint": 1, "offload": "cpu"}, tmp_path, offload=offload, clip=clip)
    for run in (half, checkpointed, parked):
        assert run[0] == kept[0]
        assert all(torch.equal(run[1][n], v) for n, v in kept[1].items())
    # Every saved byte is given back once backward is done.
    assert all(v == 0 for run in (half, checkpointed, parked) for v in run[3].values())
    # Checkpointing every block keeps fewer bytes on the device tier than every other block.
    assert 0 < checkpointed[2]["device"] < half[2]["device"]
    # Offloaded, the saved tensors wait in the cpu tier: the device tier books none.
    assert parked[2]["device"] == 0 and parked[2]["cpu"] == checkpointed[2]["device"]


def test_the_estimate_counts_activations_as_the_run_books_them(tmp_path: Path) -> None:
    from tierzero.config import load_config
    from tierzero.estimate import estimate

    raw = {
        "zero": {"stage": 3},
        "model": {"type": "gpt", "n_layer": 3, "n_head": 2, "d_model": 64, "d_ff": 128, "max_seq_len": 64},
        "train": {"micro_batch_size": 2, "seq_len": 64},
        "activations": {"checkpoint": 1},
    }
    half = estimate(load_config(raw | {"activations": {"checkpoint": 2}}))
    checkpointed = estimate(load_config(raw))
    device = tierzero.common.slices.Tier.DEVICE
    assert 0 < checkpointed.tiers[device].working["activations"] < half.tiers[device].working["activations"]
    assert checkpointed.tiers[device].peak < half.tiers[device].peak


def test_with_checkpointing_the_estimate_matches_the_measured_device_peak(tmp_path: Path) -> None:
    import io

    import tierzero.cli.train as T
    from tierzero.config import load_config
    from tierzero.estimate import estimate

    raw = {
        "zero": {"stage": 3},
        "model": {"type": "gpt", "n_layer": 4, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 64},
        "data": {"max_bytes": "256KiB"},
        "train": {"steps": 3, "micro_batch_size": 4, "seq_len": 64, "log_every": 1},
        "activations": {"checkpoint": 1},
        "offload": {"optimizer": "cpu", "gradients": "cpu"},
    }
    cfg = load_config(raw)
    predicted = estimate(cfg).tiers[tierzero.common.slices.Tier.DEVICE]
    measured = T.train(cfg, progress=False, out=io.StringIO()).peak_tier_bytes["device"]
    assert predicted.working["activations"] > 0
    assert abs(predicted.peak - measured) <= 0.10 * measured, (predicted.peak, measured, predicted.working)


class _CopyBack:
    """Stands in for the CUDA event after a parked tensor's copy back: only `query()` is asked."""

    fired = False

    def query(self) -> bool:
        return self.fired


def test_a_parked_buffer_waits_for_its_copy_back_before_the_cpu_tier_reuses_it() -> None:
    from tierzero.common.slices import Kind, Tier
    from tierzero.offload.cpu import CpuTier, HostDeviceTier
    from tierzero.stages.activations import SavedActivations
    from tierzero.store import TieredStore
    from tierzero.swapper import Swapper

    cpu = CpuTier(capacity=1 << 20, reuse_limit=0)
    tiers = {Tier.DEVICE: HostDeviceTier(capacity=1 << 20), Tier.CPU: cpu}
    with TieredStore(tiers=tiers, swapper=Swapper(buffer_size=4096, buffer_count=1, host=cpu)) as store:
        saved = SavedActivations(store, offload=True)

        def parked_bytes() -> int:
            return store.report().tiers[Tier.CPU].current_by_kind.get(Kind.ACTIVATION, 0)

        packed = saved.pack(torch.arange(64.0))
        assert torch.equal(saved.unpack(packed), torch.arange(64.0)) and parked_bytes() == 256
        event = _CopyBack()
        packed.copied_back.append(event)  # as unpack does on CUDA: the copy back may still run
        del packed
        assert parked_bytes() == 256  # autograd dropped it, but its copy has not run yet
        second = saved.pack(torch.ones(8))  # a pack frees what has landed: nothing yet
        assert parked_bytes() == 256 + 32
        event.fired = True
        third = saved.pack(torch.ones(4))
        assert parked_bytes() == 32 + 16  # the first buffer is back in the cpu tier
        assert torch.equal(saved.unpack(second), torch.ones(8)) and torch.equal(saved.unpack(third), torch.ones(4))
        del second, third
        assert parked_bytes() == 0
