"""Units used twice in one step, and modules that run no forward, on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import Case, Reference, check_parity, reference_run, run_ranks, train_case

STAGES = (1, 2, 3)
# block 0 runs twice per forward; block 3 never runs
CASES = [Case(stage=s, optimizer="sgd", reuse=True, unused=True) for s in STAGES]
# the same with every collective synchronous
BLOCKING = [Case(stage=s, optimizer="sgd", reuse=True, unused=True, overlap=False) for s in STAGES]


def _rank_job(rank: int, world_size: int, _: Any) -> list[Any]:
    return [train_case(c, rank=rank, world_size=world_size) for c in CASES + BLOCKING]


@pytest.fixture(scope="module")
def runs() -> list[Any]:
    return run_ranks(_rank_job, world_size=2)[0]


@pytest.fixture(scope="module")
def reference() -> Reference:
    return reference_run(CASES[0])


@pytest.mark.parametrize("stage", STAGES)
def test_unit_used_twice_and_module_without_forward(runs: list[Any], reference: Reference, stage: int) -> None:
    run = runs[stage - 1]
    check_parity(run, reference, tolerance=1e-5)
    # the block that never ran forward kept its initial weights, as torch.optim leaves
    # a parameter without .grad untouched (weight decay included)
    initial = CASES[0].model().state_dict()
    assert run.params["blocks.3.up.weight"].equal(initial["blocks.3.up.weight"])
    assert not run.params["blocks.0.up.weight"].equal(initial["blocks.0.up.weight"])


@pytest.mark.parametrize("stage", STAGES)
def test_blocking_collectives_give_the_same_bits(runs: list[Any], stage: int) -> None:
    overlapped, blocking = runs[stage - 1], runs[len(CASES) + stage - 1]
    assert blocking.losses == overlapped.losses
    assert all(torch.equal(blocking.params[n], overlapped.params[n]) for n in overlapped.params)
