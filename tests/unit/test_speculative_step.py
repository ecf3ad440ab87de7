"""zero.step_schedule: speculative steps each unit during backward with clipping on, and redoes the
step when the norm clips: bitwise the exact schedule's weights and optimizer states, at 1 and 2 ranks."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from test_grad_norm import Stack

import tierzero
from tierzero.common.slices import Kind
from tierzero.stages.grads.norm import clip_coefficient

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import run_ranks  # noqa: E402

STEPS = 6
PLACEMENTS = {
    "device": {},
    "cpu": {"optimizer": "cpu"},
    "nvme": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
}


def _train(schedule: str, offload: dict[str, str], swap: str, *, clip: float, rank: int = 0, world: int = 1,
           dtype: str = "fp32", accumulation: int = 1) -> dict[str, Any]:  # fmt: skip
    """Train `STEPS` steps: the full weights, this rank's fp32 masters and optimizer states, the norms, the redos."""
    swap = f"{swap}/{schedule}{rank}"
    Path(swap).mkdir(exist_ok=True)
    cfg = {
        "zero": {"stage": 3, "step_schedule": schedule},
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.1},
        "gradient_clipping": clip,
        "gradient_accumulation_steps": accumulation,
        "precision": {"param_dtype": dtype},
        "offload": offload,
        "tiers": {"nvme": {"path": swap}},
    }
    norms, kept = [], []
    with tierzero.initialize(Stack(), cfg) as engine:
        stage = engine.stage
        for step in range(STEPS):
            for micro in range(accumulation):
                seed = (step * accumulation + micro) * world + rank
                loss = engine(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed)))
                engine.backward(loss)
                job = stage._speculation
                kept.append(None if job is None else job.kept_units)
                engine.step()
            norms.append(engine.grad_norm)
        weights = engine.full_state_dict()
        states = {}
        for unit in stage.trained:
            for spec in stage.plan.of(unit):
                if spec.kind is not Kind.GRAD:
                    with stage.slice(unit, spec.kind, write=False) as tensor:
                        states[f"{unit.name}.{spec.kind.name}"] = tensor.clone()
        return {"weights": weights, "states": states, "norms": norms, "redone": stage.redone_steps, "kept": kept,
                "trained": len(stage.trained)}  # fmt: skip


def _assert_same_bits(exact: dict[str, Any], speculative: dict[str, Any]) -> None:
    assert speculative["norms"] == exact["norms"]
    for group in ("weights", "states"):
        if exact[group] is None:
            continue
        assert exact[group].keys() == speculative[group].keys()
        for name, value in exact[group].items():
            assert torch.equal(speculative[group][name], value), f"{group} {name}"


def _assert_redone_when_clipped(run: dict[str, Any], *, clip: float, accumulation: int = 1) -> None:
    clipped = sum(clip_coefficient(norm, clip) != 1.0 for norm in run["norms"])
    assert 0 < clipped < STEPS, run["norms"]  # the case has steps that clip and steps that do not
    assert run["redone"] == clipped
    # every unit stepped in the last micro-step's backward, kept for a redo
    assert run["kept"] == ([None] * (accumulation - 1) + [run["trained"]]) * STEPS


@pytest.mark.parametrize(
    ("placement", "dtype", "accumulation", "clip"),
    [("device", "fp32", 1, 2.82), ("cpu", "fp32", 1, 2.82), ("nvme", "fp32", 1, 2.82), ("nvme", "bf16", 2, 2.14),
     ("cpu", "bf16", 1, 2.86)],
)
def test_the_speculative_step_gives_the_exact_bits_and_redoes_the_steps_that_clip(
    tmp_path: Path, placement: str, dtype: str, accumulation: int, clip: float
) -> None:
    args = {"clip": clip, "dtype": dtype, "accumulation": accumulation}
    exact = _train("exact", PLACEMENTS[placement], str(tmp_path), **args)
    speculative = _train("speculative", PLACEMENTS[placement], str(tmp_path), **args)
    assert exact["redone"] == 0 and exact["kept"] == [None] * (STEPS * accumulation)
    _assert_redone_when_clipped(speculative, clip=clip, accumulation=accumulation)
    _assert_same_bits(exact, speculative)


def test_without_clipping_the_speculative_schedule_keeps_nothing(tmp_path: Path) -> None:
    run = _train("speculative", PLACEMENTS["cpu"], str(tmp_path), clip=0.0)
    assert run["kept"] == [None] * STEPS and run["redone"] == 0


def _rank_job(rank: int, world: int, swap: str) -> list[dict[str, Any]]:
    runs = []
    for placement in ("cpu", "nvme"):
        for schedule in ("exact", "speculative"):
            runs.append(_train(schedule, PLACEMENTS[placement], swap, clip=2.14, rank=rank, world=world))
    return runs


def test_two_ranks_give_the_exact_bits_and_redo_together(tmp_path: Path) -> None:
    ranks = run_ranks(_rank_job, world_size=2, payload=str(tmp_path))
    for runs in ranks:
        for exact, speculative in (runs[0:2], runs[2:4]):
            _assert_redone_when_clipped(speculative, clip=2.14)
            _assert_same_bits(exact, speculative)
