"""Resharding: a checkpoint written at 2 ranks loads at 1 and at 4 (and back) with every state element in place.

The checkpoint of step 3 (written at 2 ranks) is loaded at 1 and at 4 ranks and saved
again right away: the logical buffers of every unit and kind (parameters, masters, Adam
moments) must be bitwise those of the original, and the weights those `consolidate`
writes. Training then continues at each world size; it matches the run that went on at
2 ranks up to fp32 reduction order (the gradient sums are split differently).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import Case, rel_error, run_ranks

import tierzero
from tierzero.checkpoint import load_checkpoint, save_checkpoint
from tierzero.checkpoint.consolidate import consolidate, load_consolidated
from tierzero.checkpoint.format import dtype_from_name
from tierzero.checkpoint.manifest import Manifest
from tierzero.checkpoint.shards import ShardReader

CASES = {
    "fp32": Case(stage=3, optimizer="adamw", steps=6, accumulation=2),
    "bf16-stage2": Case(stage=2, optimizer="adamw", steps=6, accumulation=2, dtype="bf16"),
}
SAVED_AT = 3


def _train(engine: Any, case: Case, steps: range, *, rank: int, world_size: int) -> None:
    for step in steps:
        for micro in range(case.accumulation):
            engine.backward(case.loss(engine, *case.micro_batch(step, micro=micro, rank=rank, world_size=world_size)))
            engine.step()


def _job(rank: int, world_size: int, payload: tuple[str, str | None]) -> dict[str, Any]:
    """Per case: at 2 ranks train and save at step 3; elsewhere load that checkpoint and save it again. Then finish."""
    root, source = Path(payload[0]), payload[1]
    out: dict[str, Any] = {}
    for name, case in CASES.items():
        with tierzero.initialize(case.model(), case.config()) as engine:
            if source is None:
                _train(engine, case, range(SAVED_AT), rank=rank, world_size=world_size)
                save_checkpoint(engine, root / name / "written")
            else:
                load_checkpoint(engine, Path(source) / name / "written")
                assert engine.global_step == SAVED_AT
                save_checkpoint(engine, root / name / f"again-{world_size}")
            at_save = engine.full_state_dict()
            _train(engine, case, range(SAVED_AT, case.steps), rank=rank, world_size=world_size)
            out[name] = {"at_save": at_save, "final": engine.full_state_dict()}
    return out


def _back_job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """At 2 ranks again: load what 1 and 4 ranks wrote, save it, return the weights."""
    out = {}
    for name, case in CASES.items():
        for world in (1, 4):
            with tierzero.initialize(case.model(), case.config()) as engine:
                load_checkpoint(engine, Path(root) / name / f"again-{world}")
                save_checkpoint(engine, Path(root) / name / f"back-from-{world}")
                out[name, world] = engine.full_state_dict()
    return out


def _logical(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    """Every unit's every kind as one flat buffer, padding dropped, read back from the rank files."""
    manifest = Manifest.read(path)
    reader = ShardReader(path, manifest)
    out = {}
    for unit in manifest.units:
        for kind, dtype in unit.kinds.items():
            buffer = torch.empty(unit.numel, dtype=dtype_from_name(dtype, where=str(path)))
            out[unit.name, kind] = reader.read(unit, kind, 0, unit.numel, out=buffer)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("reshard")
    results = {2: run_ranks(_job, world_size=2, payload=(str(root), None))[0]}
    for world in (1, 4):
        results[world] = run_ranks(_job, world_size=world, payload=(str(root), str(root)))[0]
    results[0] = run_ranks(_back_job, world_size=2, payload=str(root))[0]  # 1 -> 2 and 4 -> 2
    return root, results


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", [1, 4])
def test_state_survives_resharding_bitwise(runs: tuple[Path, dict[int, dict[str, Any]]], name: str, world: int) -> None:
    root, results = runs
    written = root / name / "written" / str(SAVED_AT)
    again = root / name / f"again-{world}" / str(SAVED_AT)
    assert Manifest.read(written).world_size == 2 and Manifest.read(again).world_size == world
    original, resharded = _logical(written), _logical(again)
    assert original.keys() == resharded.keys()
    assert {kind for _, kind in original} == ({"param", "exp_avg", "exp_avg_sq"} | ({"master"} if name.startswith("bf16") else set()))
    for key in original:
        assert torch.equal(original[key], resharded[key]), key
    expected = results[2][name]["at_save"]
    assert all(torch.equal(results[world][name]["at_save"][n], expected[n]) for n in expected)


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("world", [1, 4])
def test_back_to_two_ranks_from_one_and_four(runs: tuple[Path, dict[int, dict[str, Any]]], name: str, world: int) -> None:
    root, results = runs
    original, back = _logical(root / name / "written" / str(SAVED_AT)), _logical(root / name / f"back-from-{world}" / str(SAVED_AT))
    assert original.keys() == back.keys() and all(torch.equal(original[k], back[k]) for k in original)
    expected = results[2][name]["at_save"]
    assert all(torch.equal(results[0][name, world][n], expected[n]) for n in expected)


@pytest.mark.parametrize("name", list(CASES))
def test_consolidated_weights_are_the_full_state_dict(runs: tuple[Path, dict[int, dict[str, Any]]], tmp_path: Path, name: str) -> None:
    root, results = runs
    done = consolidate(root / name / "written", tmp_path / "model.safetensors")
    state, expected = load_consolidated(done.path), results[2][name]["at_save"]
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[n], expected[n]) for n in expected)


@pytest.mark.parametrize("world", [1, 4])
def test_training_continues_at_any_world_size(runs: tuple[Path, dict[int, dict[str, Any]]], world: int) -> None:
    _, results = runs
    expected, actual = results[2]["fp32"]["final"], results[world]["fp32"]["final"]
    errors = {n: rel_error(actual[n], expected[n]) for n in expected}
    assert max(errors.values()) < 1e-5, errors
    # the continuation moved the weights: the comparison is not of a run that stood still
    assert max(rel_error(results[2]["fp32"]["at_save"][n], expected[n]) for n in expected) > 1e-3
