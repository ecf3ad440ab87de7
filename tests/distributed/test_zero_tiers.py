"""The stages reach slices only through the store: moving homes to host memory or NVMe changes no bit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, run_ranks, train_case

import tierzero

ALL_CPU = {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}
ALL_NVME = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
# (stage, offload) pairs; each is compared with the same stage homed on the device
RUNS = [
    (1, {}), (1, {"optimizer": "cpu"}),
    (2, {}), (2, {"gradients": "cpu", "optimizer": "nvme"}),
    (3, {}), (3, ALL_CPU), (3, ALL_NVME),
]


def _rank_job(rank: int, world_size: int, swap_dir: str) -> list[Any]:
    results = []
    for stage, offload in RUNS:
        def make(model: torch.nn.Module, config: dict[str, Any], offload: dict[str, str] = offload) -> Any:
            return tierzero.initialize(model, config | {"offload": offload, "tiers": {"nvme": {"path": swap_dir}}})

        case = Case(stage=stage, optimizer="adamw", steps=3, dtype="bf16" if stage == 3 else "fp32")
        results.append(train_case(case, rank=rank, world_size=world_size, make_engine=make))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    swap_dir: Path = tmp_path_factory.mktemp("swap")
    results = run_ranks(_rank_job, world_size=2, payload=str(swap_dir))
    assert list(swap_dir.iterdir()) == []  # the engines' close() removed their swap files
    return results[0]


@pytest.mark.parametrize("index", [i for i, (_, off) in enumerate(RUNS) if off], ids=lambda i: f"stage{RUNS[i][0]}-{'-'.join(f'{k}:{v}' for k, v in RUNS[i][1].items())}")
def test_offloaded_run_is_bitwise_the_device_run(runs: list[Any], index: int) -> None:
    stage, offload = RUNS[index]
    device_run = runs[RUNS.index((stage, {}))]
    run = runs[index]
    assert run.losses == device_run.losses
    assert run.params.keys() == device_run.params.keys()
    assert all(torch.equal(run.params[n], device_run.params[n]) for n in run.params)
    # the offloaded kinds' bytes sit in their tier (the cpu tier also holds the
    # swapper's staging buffers when nvme is used)
    tiers = run.memory["tiers"]
    for tier in set(offload.values()):
        assert tiers[tier]["current"] > 0
    if "nvme" not in offload.values():
        assert tiers.get("nvme", {"current": 0})["current"] == 0
    assert tiers["device"]["current"] < device_run.memory["tiers"]["device"]["current"]
    assert run.memory["kinds"] == device_run.memory["kinds"]
