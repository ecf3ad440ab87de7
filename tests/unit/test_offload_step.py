"""The optimizer step where the states live: placement changes no bit, and NVMe steps stay bounded."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
from tierzero.common.slices import Kind, Tier, align_up
from tierzero.stages.step_pipeline import MAX_RESIDENT_GROUPS

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case  # noqa: E402

STEPS = 10
# (stage, param dtype, offload); each is compared with the same stage and dtype homed on the device
PLACEMENTS = [
    (1, "fp32", {"optimizer": "cpu"}),
    (1, "fp32", {"optimizer": "nvme"}),
    (1, "bf16", {"optimizer": "nvme"}),
    (2, "fp32", {"optimizer": "cpu"}),
    (2, "fp32", {"gradients": "cpu", "optimizer": "nvme"}),
    (2, "bf16", {"gradients": "nvme", "optimizer": "cpu"}),
    (3, "fp32", {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}),
    (3, "bf16", {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}),
    (3, "bf16", {"params": "nvme", "optimizer": "nvme"}),
    (3, "bf16", {"optimizer": "cpu"}),
    (3, "bf16", {"params": "cpu", "gradients": "nvme", "optimizer": "nvme"}),
]


def _train(stage: int, dtype: str, offload: dict[str, str], swap: Path) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    case = Case(stage=stage, optimizer="adamw", steps=STEPS, dtype=dtype, accumulation=1, global_batch=4)
    config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": str(swap)}}}
    engine = tierzero.initialize(case.model(), config)
    losses = []
    with engine:
        for step in range(STEPS):
            loss = engine(*case.batch(step))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        params = engine.full_state_dict()
        assert params is not None
        return losses, params, engine.stage.last_step_report


@pytest.fixture(scope="module")
def device_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, str], Any]:
    swap = tmp_path_factory.mktemp("swap")
    keys = sorted({(stage, dtype) for stage, dtype, _ in PLACEMENTS})
    return {key: _train(*key, {}, swap) for key in keys}


@pytest.mark.parametrize(
    ("stage", "dtype", "offload"), PLACEMENTS, ids=[f"stage{s}-{d}-{'-'.join(f'{k}:{v}' for k, v in o.items())}" for s, d, o in PLACEMENTS]
)
def test_placement_changes_no_bit_after_ten_steps(
    device_runs: dict[tuple[int, str], Any], tmp_path: Path, stage: int, dtype: str, offload: dict[str, str]
) -> None:
    losses, params, report = _train(stage, dtype, offload, tmp_path)
    ref_losses, ref_params, _ = device_runs[(stage, dtype)]
    assert losses == ref_losses
    assert params.keys() == ref_params.keys()
    differ = [name for name in params if not torch.equal(params[name], ref_params[name])]
    assert differ == []
    assert list(tmp_path.iterdir()) == []  # close() removed the swap files
    # every unit stepped, never more than three units' copies held at once (none where all live in memory)
    assert report.groups == 4  # root and the three blocks of the tiny model
    assert (1 if "nvme" in offload.values() else 0) <= report.peak_resident_groups <= MAX_RESIDENT_GROUPS


def test_nvme_states_are_read_into_host_memory_three_units_at_most(tmp_path: Path) -> None:
    case = Case(stage=3, optimizer="adamw", steps=2, dtype="bf16", accumulation=1, global_batch=4)
    offload = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
    config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": str(tmp_path)}}}
    config["zero"] = config["zero"] | {"step_in_forward": False}  # the step after backward, whole
    engine = tierzero.initialize(case.model(), config)
    with engine:
        engine.backward(engine(*case.batch(0)))
        engine.store.reset_peaks()
        engine.step()
        cpu = engine.store.report().tiers[Tier.CPU]
        states = (Kind.MASTER, Kind.EXP_AVG, Kind.EXP_AVG_SQ)
        sizes = sorted(
            (sum(align_up(s.nbytes) for s in engine.stage.slice_specs(unit) if s.kind in states) for unit in engine.units),
            reverse=True,
        )
        peak_states = sum(cpu.peak_by_kind.get(kind, 0) for kind in states)
        # the pipeline really read ahead: more than one unit's states were up at once ...
        assert peak_states > max(sizes)
        # ... and never more than the three largest units' states
        assert peak_states <= sum(sizes[:MAX_RESIDENT_GROUPS])
        # after the step, nothing is left fetched
        assert sum(cpu.current_by_kind.get(kind, 0) for kind in states) == 0
        assert engine.store.report().tiers[Tier.NVME].current_by_kind[Kind.EXP_AVG] > 0


def _train_unclipped(stage: int, offload: dict[str, str], swap: Path, *, accumulation: int) -> tuple[list[float], dict[str, torch.Tensor], Any]:
    case = Case(stage=stage, optimizer="adamw", steps=6, clip=0.0, accumulation=accumulation, global_batch=4)
    config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": str(swap)}}}
    engine = tierzero.initialize(case.model(), config)
    losses = []
    with engine:
        for step in range(case.steps):
            for micro in range(accumulation):
                loss = engine(*case.micro_batch(step, micro=micro, rank=0, world_size=1))
                before = engine.stage.last_step_report
                engine.backward(loss)
                if stage == 3 and micro == accumulation - 1:
                    # the units stepped in backward already
                    assert engine.stage.last_step_report is not before and engine.stage.last_step_report.groups == 4
                engine.step()
                losses.append(loss.item())
        params = engine.full_state_dict()
        assert params is not None
        return losses, params, engine.stage.last_step_report


@pytest.mark.parametrize("accumulation", [1, 2])
def test_stage3_steps_during_backward_with_the_same_bits(tmp_path: Path, accumulation: int) -> None:
    # Without clipping, stage 3 steps each unit as its gradient completes in backward;
    # stage 2 steps after backward. At one rank both must give the same bits.
    after_losses, after, _ = _train_unclipped(2, {}, tmp_path, accumulation=accumulation)
    for offload in ({}, {"params": "nvme", "optimizer": "nvme"}, {"params": "cpu", "gradients": "nvme", "optimizer": "cpu"}):
        losses, params, report = _train_unclipped(3, offload, tmp_path, accumulation=accumulation)
        copies = 1 if "nvme" in offload.values() else 0  # a group whose slices all live in memory holds none
        assert report.groups == 4 and copies <= report.peak_resident_groups <= MAX_RESIDENT_GROUPS
        if offload.get("optimizer") == "nvme":
            # blocks' states started up when their backward began, ahead of their gradients
            assert report.prepared >= 1
        assert losses == after_losses
        assert [n for n in after if not torch.equal(params[n], after[n])] == []


def test_backward_step_matches_torch_adamw(tmp_path: Path) -> None:
    case = Case(stage=3, optimizer="adamw", steps=6, clip=0.0, accumulation=1, global_batch=4)
    model = case.model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    for step in range(case.steps):
        model(*case.batch(step)).backward()
        opt.step()
        opt.zero_grad()
    _, params, _ = _train_unclipped(3, {"params": "nvme", "optimizer": "nvme"}, tmp_path, accumulation=1)
    for name, expected in model.named_parameters():
        error = float((params[name] - expected.detach()).norm() / expected.detach().norm())
        assert error < 2e-3, name


def test_a_failed_write_back_is_raised_not_lost() -> None:
    from concurrent.futures import Future

    from tierzero.common.transfer import Transfer
    from tierzero.stages.step_pipeline import PendingWrite, SliceGroup, StepPipeline

    failed: Future[Any] = Future()
    failed.set_exception(OSError(28, "No space left on device"))

    class Store:
        def fetch(self, key: Any, *, to: Tier) -> Transfer[torch.Tensor]:
            return Transfer.ready(torch.zeros(4))

        def write_back(self, key: Any) -> Transfer[None]:
            return Transfer(failed)

        def release(self, key: Any) -> None:
            pass

    def compute(group: SliceGroup, fetched: dict[Kind, torch.Tensor]) -> list[PendingWrite]:
        return []

    pipeline = StepPipeline(Store(), compute)
    with pytest.raises(OSError, match="No space left"):
        pipeline.run([SliceGroup(unit=f"u{i}", fetches=((Kind.EXP_AVG, Tier.CPU),)) for i in range(3)])


def test_the_step_takes_gradients_where_no_copy_blocks_the_host() -> None:
    from types import SimpleNamespace

    from tierzero.offload.tiers import traits_of
    from tierzero.stages.plan import Homes
    from tierzero.stages.step import _grad_tier

    def tier(grads: Tier, optimizer: Tier, device: str, *, sharded: bool = True) -> Tier:
        homes = Homes(params=Tier.DEVICE, grads=grads, optimizer=optimizer)
        plan = SimpleNamespace(  # every unit at its kind's home
            home=homes.of, staged=lambda unit, kind: not traits_of(homes.of(unit, kind)).in_memory
        )
        stage = SimpleNamespace(homes=homes, plan=plan, shards_grads=sharded, device=torch.device(device))
        return _grad_tier(stage, "u0")

    assert tier(Tier.NVME, Tier.NVME, "cpu") is Tier.CPU  # up to the step tier, whatever the device
    assert tier(Tier.DEVICE, Tier.CPU, "cpu") is Tier.DEVICE  # host memory already: read in place
    assert tier(Tier.DEVICE, Tier.CPU, "cuda") is Tier.CPU  # a GPU's shard: the swapper copies it down
    assert tier(Tier.DEVICE, Tier.CPU, "cuda", sharded=False) is Tier.DEVICE  # stage 1: the owned range only
    assert tier(Tier.DEVICE, Tier.DEVICE, "cuda") is Tier.DEVICE
    assert tier(Tier.CPU, Tier.DEVICE, "cuda") is Tier.DEVICE  # a step on the GPU takes host grads up


SIZES = {"big0": 100, "big1": 100, "big2": 100, "s0": 1, "s1": 1}


@pytest.mark.parametrize(("sizes", "prepared"), [(None, 3), (SIZES, 4)])
def test_small_groups_take_a_small_part_of_the_bound(sizes: dict[str, int] | None, prepared: int) -> None:
    """Counted, three groups fill the bound whatever their size; weighed in bytes, two small ones
    fit beside two large ones and the third large one does not (3 x 100 bytes at most)."""
    from tierzero.common.transfer import Transfer
    from tierzero.stages.step_pipeline import SliceGroup, StepPipeline

    class Store:
        def fetch(self, key: Any, *, to: Tier) -> Transfer[torch.Tensor]:
            return Transfer.ready(torch.zeros(4))

        def at_home(self, key: Any) -> bool:
            return True

    pipeline = StepPipeline(Store(), lambda group, fetched: [], sizes=sizes)  # type: ignore[arg-type]
    for unit in ("big0", "big1", "s0", "s1", "big2"):
        pipeline.prepare(SliceGroup(unit=unit, fetches=((Kind.EXP_AVG, Tier.CPU),)))
    assert pipeline.report.prepared == prepared
    assert [group.unit for group, _ in pipeline.hand_over()] == ["big0", "big1", "s0", "s1"][:prepared]
