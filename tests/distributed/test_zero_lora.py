"""LoRA through peft under every stage, the frozen base offloaded, against peft in plain PyTorch.

The reference is the same peft model trained by torch: AdamW over the adapters (the base has
no gradients), clip_grad_norm_, the whole global batch per step.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import Case, reference_run, rel_error, run_ranks, train_case

import tierzero
from tierzero.units.unit import plan_units

pytest.importorskip("peft")

STEPS = 8
CASES = [
    (2, Case(model_name="llama", lora=True, stage=1, optimizer="adamw", steps=STEPS), {}),
    (2, Case(model_name="llama", lora=True, stage=2, optimizer="adamw", steps=STEPS), {"optimizer": "cpu"}),
    (2, Case(model_name="llama", lora=True, stage=3, optimizer="adamw", steps=STEPS), {"params": "nvme", "optimizer": "nvme"}),
    (2, Case(model_name="gpt2", lora=True, stage=3, optimizer="sgd", steps=STEPS), {"params": "cpu"}),
    (1, Case(model_name="llama", lora=True, stage=3, optimizer="adamw", steps=STEPS), {"params": "nvme", "optimizer": "nvme"}),
]
TOLERANCE = {"sgd": 1e-5, "adamw": 2e-3}


def _rank_job(rank: int, world_size: int, swap_dir: str) -> list[Any]:
    results = []
    for size, case, offload in CASES:
        if size != world_size:
            continue

        def make(model: torch.nn.Module, config: dict[str, Any], offload: dict[str, str] = offload) -> Any:
            return tierzero.initialize(model, config | {"offload": offload, "tiers": {"nvme": {"path": swap_dir}}})

        results.append(train_case(case, rank=rank, world_size=world_size, make_engine=make))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[Any]:
    swap = str(tmp_path_factory.mktemp("swap"))
    two = run_ranks(_rank_job, world_size=2, payload=swap)[0]
    one = run_ranks(_rank_job, world_size=1, payload=swap)[0]
    return two + one


def _case_id(size: int, case: Case, offload: dict[str, str]) -> str:
    return f"ranks{size}-{case.model_name}-stage{case.stage}-{case.optimizer}-{'-'.join(offload.values()) or 'device'}"


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(*c) for c in CASES])
def test_lora_trains_as_peft_in_plain_pytorch(runs: list[Any], index: int) -> None:
    _, case, offload = CASES[index]
    run, ref = runs[index], reference_run(case)
    assert run.steps_taken == STEPS
    assert abs(run.losses[0] - ref.losses[0]) <= 1e-6
    assert max(abs(a - b) for a, b in zip(run.losses, ref.losses, strict=True)) <= 1e-4
    errors = {name: rel_error(run.params[name], expected) for name, expected in ref.params.items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= TOLERANCE[case.optimizer], f"{worst}: {errors[worst]:.2e}"
    model = case.model()
    base = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    assert all(torch.equal(run.params[n], p.detach()) for n, p in base.items())  # the base never moved
    assert any(not torch.equal(run.params[n], p.detach()) for n, p in model.named_parameters() if p.requires_grad)
    # Optimizer states for the adapters' units only (exact bytes, padding included); the base
    # is where offload.params puts it.
    size = CASES[index][0]
    units = plan_units(model, world_size=size)
    kinds, tiers = run.memory["kinds"], run.memory["tiers"]
    assert kinds["exp_avg"] == sum(u.shard_numel * 4 for u in units if u.trainable)
    assert {s.name for u in units if u.trainable for s in u.slots} == {n for n, p in model.named_parameters() if p.requires_grad}
    if offload.get("params") == "nvme":
        assert tiers["nvme"]["current"] >= sum(u.shard_numel * 4 for u in units if not u.trainable)
