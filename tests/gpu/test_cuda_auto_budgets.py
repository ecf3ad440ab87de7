"""`offload: auto` on a GPU: the device tier's budget is the GPU's free memory as torch.cuda.mem_get_info
reads it, less the margin (tierzero/placement/budgets.py), in the budgets, the plan and the engine
`tierzero.initialize` builds from it.

Skipped without CUDA. TIERZERO_GPU_TESTS_ON_CPU=1 runs it on the host: there is no GPU to read, so
mem_get_info answers an H200's figure and the planner is handed the CUDA device it would see.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_or_cpu import ON_CPU, needs_cuda

import tierzero
import tierzero.placement.planner as planner
from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier
from tierzero.config import TiersConfig, load_config
from tierzero.estimate.estimator import Bandwidth
from tierzero.models.builtin import build_model
from tierzero.placement import DEVICE_MARGIN, machine_budgets
from tierzero.placement.compute import Compute
from tierzero.placement.planner import plan_placement

pytestmark = needs_cuda

GiB = 1 << 30
H200_FREE, H200_TOTAL = 139 * GiB + 12345 * 4096, 140 * GiB
"""What mem_get_info answers in a dry run: an H200 with its CUDA context made."""
DRIFT = 256 << 20
"""How far the GPU's free memory may move between the plan's reading and the test's (another process)."""
DISK = Bandwidth(read=2.0e9, write=3.0e9, source="test")
FLOPS = Bandwidth(read=1.0e11, write=1.0e11, source="test")
MEM_GET_INFO = torch.cuda.mem_get_info
"""torch's own, to read the GPU again beside the patched one the fixture counts."""


@pytest.fixture
def free_readings(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every (free, total) torch.cuda.mem_get_info answers during the test, in order."""
    readings: list[tuple[int, int]] = []
    def reading(device: Any = None) -> tuple[int, int]:
        answer = (H200_FREE, H200_TOTAL) if ON_CPU else MEM_GET_INFO(device)
        readings.append(answer)
        return answer

    monkeypatch.setattr(torch.cuda, "mem_get_info", reading)
    if ON_CPU:  # the planner asks machine_budgets for the current CUDA device's figure
        monkeypatch.setattr(planner, "machine_budgets", functools.partial(machine_budgets, device=torch.device("cuda", 0)))
    return readings


def _gpu(cuda: torch.device) -> torch.device:
    return torch.device("cuda", 0) if ON_CPU else cuda


def _raw(swap: Path | None) -> dict[str, Any]:
    """The model, its step and `offload: auto`; without `swap`, no NVMe tier (and no disk to probe)."""
    return {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 128, "d_ff": 512, "max_seq_len": 32},
        "train": {"micro_batch_size": 2, "seq_len": 32},
        "offload": "auto",
        "tiers": {"nvme": {"path": None if swap is None else str(swap)}},
    }


def _expected(free: int) -> int:
    return free - DEVICE_MARGIN.of(free)


def _check_reading(readings: list[tuple[int, int]]) -> int:
    """The one figure read, checked against the GPU now; returns its free bytes."""
    assert len(readings) == 1, readings
    free, total = readings[0]
    assert 0 < free <= total
    if not ON_CPU:  # a dry run has no GPU to read again
        now, _ = MEM_GET_INFO()
        assert abs(now - free) <= DRIFT, (now, free)
    return free


def test_the_device_budget_is_the_gpus_free_memory_less_the_margin(cuda: torch.device, free_readings: list[Any]) -> None:
    budgets = machine_budgets(TiersConfig(), device=_gpu(cuda))
    free = _check_reading(free_readings)
    assert budgets.device.nbytes == _expected(free) > 0
    assert budgets.device.source.startswith(f"{_gpu(cuda)} free {format_size(free)} of {format_size(free_readings[0][1])}")
    # A capacity in the config wins, and nothing is read.
    given = machine_budgets(load_config({"tiers": {"device": {"capacity": "1GiB"}}}).tiers, device=_gpu(cuda))
    assert (given.device.nbytes, given.device.source, len(free_readings)) == (GiB, "tiers.device.capacity", 1)


def test_the_plan_and_the_engine_take_the_budget_read_from_the_gpu(
    cuda: torch.device, free_readings: list[Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = load_config(_raw(tmp_path))
    plan = plan_placement(cfg, disk=DISK, flops=FLOPS, copy_rate=5e9, step_rate=1e9)
    free = _check_reading(free_readings)
    assert plan.budgets.device == _expected(free)
    assert plan.budgets.sources[Tier.DEVICE].startswith(f"{_gpu(cuda)} free {format_size(free)}")
    # The GPU's free memory holds this small model's state many times over: it all stays on the device.
    assert (plan.homes.params, plan.homes.grads, plan.homes.optimizer) == (Tier.DEVICE,) * 3 and not plan.homes.units
    free_readings.clear()
    # The rates the planner measures (a block's compute, the disk's) are not what this test is about, and
    # take seconds: the block's rate is given, and no NVMe tier is set.
    monkeypatch.setattr(planner, "measure_compute", lambda cfg: Compute(flops=FLOPS))
    engine = tierzero.initialize(build_model(cfg.model, device="meta", seed=0), _raw(None))
    try:
        assert engine.placement is not None and engine.placement.budgets.device == _expected(_check_reading(free_readings))
        assert engine.memory_report()["placement"]["device"] and not engine.memory_report()["placement"]["nvme"]
        x = torch.randint(0, cfg.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)).to(cuda)
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        assert bool(torch.isfinite(loss))
    finally:
        engine.close()
