"""Parameters and optimizer states on NVMe, two gloo ranks, against plain single-process torch training."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, check_parity, reference_run, run_ranks, train_case

import tierzero

OFFLOAD = {"params": "nvme", "optimizer": "nvme"}
CASES = [Case(stage=3, optimizer="adamw"), Case(stage=3, optimizer="sgd"), Case(stage=2, optimizer="adamw")]
TOLERANCE = {"sgd": 1e-5, "adamw": 2e-3}


def _rank_job(rank: int, world_size: int, swap_dir: str) -> list[Any]:
    results = []
    for case in CASES:
        offload = OFFLOAD if case.stage == 3 else {"optimizer": "nvme"}

        def make(model: torch.nn.Module, config: dict[str, Any], offload: dict[str, str] = offload) -> Any:
            return tierzero.initialize(model, config | {"offload": offload, "tiers": {"nvme": {"path": swap_dir}}})

        results.append(train_case(case, rank=rank, world_size=world_size, make_engine=make))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[Any]]:
    swap_dir: Path = tmp_path_factory.mktemp("swap")
    results = run_ranks(_rank_job, world_size=2, payload=str(swap_dir))
    assert list(swap_dir.iterdir()) == []
    return results


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{c.stage}-{c.optimizer}" for c in CASES])
def test_nvme_run_matches_plain_training_at_world_size_2(ranks: list[list[Any]], index: int) -> None:
    case = CASES[index]
    run = ranks[0][index]
    check_parity(run, reference_run(case), tolerance=TOLERANCE[case.optimizer])
    assert ranks[1][index].losses == run.losses
    # the states really were on NVMe: the nvme tier held them
    assert run.memory["tiers"]["nvme"]["current"] >= run.memory["kinds"]["exp_avg"]
