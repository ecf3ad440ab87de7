"""Frozen parameters (requires_grad=False) sharded and placed like trained ones, at two gloo ranks.

The model freezes its tied embedding (the root's frozen unit), all of block 1 (a frozen
unit sandwiched between trained ones: backward passes through it) and block 0's norm (a
frozen unit beside its module's trained one). Each run is held to plain torch training
of the same model, whose optimizer skips the frozen parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, check_parity, reference_run, run_ranks, train_case

import tierzero
from tierzero.units.unit import plan_units

FROZEN = ("embed.", "blocks.1.", "blocks.0.norm.")
CASES = [
    (Case(stage=1, optimizer="adamw", steps=4, frozen=FROZEN), {}),
    (Case(stage=2, optimizer="sgd", steps=4, frozen=FROZEN), {"optimizer": "cpu"}),
    (Case(stage=3, optimizer="adamw", steps=4, frozen=FROZEN), {"params": "nvme", "optimizer": "nvme"}),
    (Case(stage=3, optimizer="adamw", steps=4, frozen=FROZEN, dtype="bf16"), {"params": "cpu", "optimizer": "cpu"}),
]
TOLERANCE = {"sgd": 1e-5, "adamw": 2e-3}


def _rank_job(rank: int, world_size: int, swap_dir: str) -> list[Any]:
    results = []
    for case, offload in CASES:

        def make(model: torch.nn.Module, config: dict[str, Any], offload: dict[str, str] = offload) -> Any:
            return tierzero.initialize(model, config | {"offload": offload, "tiers": {"nvme": {"path": swap_dir}}})

        results.append(train_case(case, rank=rank, world_size=world_size, make_engine=make))
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[list[Any]]:
    swap_dir: Path = tmp_path_factory.mktemp("swap")
    return run_ranks(_rank_job, world_size=2, payload=str(swap_dir))


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"stage{c.stage}-{c.dtype}-{'-'.join(o.values()) or 'device'}" for c, o in CASES]
)
def test_frozen_parameters_stay_put_and_the_rest_trains_as_in_torch(ranks: list[list[Any]], index: int) -> None:
    case, _ = CASES[index]
    run, ref = ranks[0][index], reference_run(case)
    assert ranks[1][index].losses == run.losses
    initial = dict(case.model().named_parameters())
    for name, value in run.params.items():
        if name.startswith(FROZEN) or name == "head.weight":
            # bf16 keeps a frozen parameter in bf16 only: its value is the bf16 rounding
            expected = initial["embed.weight" if name == "head.weight" else name].detach()
            assert torch.equal(value, expected.to(getattr(torch, {"fp32": "float32", "bf16": "bfloat16"}[case.dtype])).float())
    if case.dtype == "fp32":
        check_parity(run, ref, tolerance=TOLERANCE[case.optimizer])
    # Exact bytes per rank: every unit's PARAM slice (sharded at stage 3, whole at 1 and 2),
    # gradients and optimizer states for the trained units only.
    units = plan_units(case.model(), world_size=2)
    itemsize = 2 if case.dtype == "bf16" else 4
    per_rank = {u.name: u.shard_numel if case.stage == 3 else u.padded_numel for u in units}
    kinds = run.memory["kinds"]
    assert any(not u.trainable for u in units)
    assert kinds["param"] == sum(per_rank.values()) * itemsize
    assert kinds["exp_avg"] == sum(u.shard_numel * 4 for u in units if u.trainable)
    assert kinds["grad"] == sum((u.padded_numel if case.stage == 1 else u.shard_numel) * itemsize for u in units if u.trainable)
