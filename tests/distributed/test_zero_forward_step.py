"""Stage 3 with clipping or fp16 overflow checks and zero.step_in_forward steps each unit in the next
forward, just before its gather: bitwise the same as stepping after backward, at 1 and 2 ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, run_ranks, train_case

import tierzero

CASES = [
    Case(stage=3, optimizer="adamw", clip=0.5, accumulation=2, steps=6),
    Case(stage=3, optimizer="sgd", clip=0.05, accumulation=1, steps=6, reuse=True, unused=True),
    # fp16: a first scale of 2^40 overflows, the step is skipped and the scale backs off
    Case(stage=3, optimizer="adamw", clip=0.0, accumulation=2, steps=6, dtype="fp16", initial_scale=2.0**40),
]
OFFLOADS = [{"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}, {"optimizer": "cpu"}]


def _rank_job(rank: int, world_size: int, swap_dir: str) -> list[Any]:
    results = []
    for case in CASES:
        for offload in OFFLOADS:
            for overlap in (True, False):

                def make(model: torch.nn.Module, config: dict[str, Any], offload: dict[str, str] = offload, overlap: bool = overlap) -> Any:
                    config = config | {"offload": offload, "tiers": {"nvme": {"path": swap_dir}}}
                    config["zero"] = config["zero"] | {"step_in_forward": overlap}
                    engine = tierzero.initialize(model, config)
                    assert engine.stage.param_prefetch is not None
                    return engine

                results.append(train_case(case, rank=rank, world_size=world_size, make_engine=make))
    return results


@pytest.fixture(scope="module", params=[1, 2], ids=["ranks1", "ranks2"])
def runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    swap: Path = tmp_path_factory.mktemp("swap")
    return run_ranks(_rank_job, world_size=request.param, payload=str(swap))[0]


@pytest.mark.parametrize("index", range(len(CASES) * len(OFFLOADS)))
def test_the_step_in_the_next_forward_gives_the_same_bits(runs: list[Any], index: int) -> None:
    overlapped, after_backward = runs[2 * index], runs[2 * index + 1]
    assert overlapped.losses == after_backward.losses
    assert overlapped.steps_taken == after_backward.steps_taken
    for name, value in after_backward.params.items():
        assert torch.equal(overlapped.params[name], value), name
    case = CASES[index // len(OFFLOADS)]
    if case.dtype == "fp16":
        assert overlapped.steps_taken < case.steps  # an overflow was skipped
