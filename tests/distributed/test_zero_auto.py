"""`offload: auto` at two ranks: rank 0 plans, every rank places alike, and the run is the device run's bits."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, run_ranks, train_case

import tierzero
from tierzero import api
from tierzero.config import TiersConfig
from tierzero.estimate import Bandwidth
from tierzero.placement import disk, planner
from tierzero.placement.compute import Compute


def _rank_job(rank: int, world_size: int, swap_dir: str) -> list[Any]:
    planner.measure_compute = lambda cfg: Compute(flops=Bandwidth(read=1e10, write=1e10, source="a test's"))
    if rank != 0:
        def refuse(*_: object, **__: object) -> None:
            raise AssertionError("only rank 0 plans; the others take its plan")

        api.plan_placement = refuse  # type: ignore[assignment]
    results = []
    # The optimizer's states alone left to the planner: its three tiers and their splits, not 27 placements.
    for offload in ({"optimizer": "auto"}, {"optimizer": "device"}):
        def make(model: torch.nn.Module, config: dict[str, Any], offload: Any = offload) -> Any:
            return tierzero.initialize(model, config | {"offload": offload, "tiers": {"nvme": {"path": swap_dir}}})

        case = Case(stage=3, optimizer="adamw", steps=3)
        results.append(train_case(case, rank=rank, world_size=world_size, make_engine=make))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[list[Any]]:
    swap_dir: Path = tmp_path_factory.mktemp("swap")
    disk.remember(swap_dir, {disk.label_of(TiersConfig().nvme): (2.0, 3.0)}, how="a test's")  # no probe
    return run_ranks(_rank_job, world_size=2, payload=str(swap_dir))


def test_every_rank_takes_rank_0s_plan_and_trains_bitwise(runs: list[list[Any]]) -> None:
    (auto_0, device_0), (auto_1, _) = runs
    planned = auto_0.memory["planned"]
    assert planned is not None and planned == auto_1.memory["planned"]
    assert auto_0.memory["placement"] == auto_1.memory["placement"]
    assert auto_0.losses == device_0.losses
    assert all(torch.equal(auto_0.params[name], device_0.params[name]) for name in device_0.params)
