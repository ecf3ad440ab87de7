"""Stage 3's units kept gathered from forward to backward where their gather is their PARAM home
([Note: homes kept across the turn] in tierzero/stages/gather_ahead.py): one gather a step instead of
two, the bits of resharding them, with activation checkpointing too, and only where it costs nothing."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
from tierzero.common.slices import Kind, SliceKey
from tierzero.stages.gather_ahead import GatherAhead
from tierzero.units.unit import UnitState

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case, train_case  # noqa: E402


def _gathers(engine: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The units whose gather starts from now on, in order, one entry a gather."""
    started: list[str] = []
    stage, start = engine.stage, engine.stage.start_gather

    def counted(unit: Any) -> None:
        if unit.state is UnitState.SHARDED:
            started.append(unit.name)
        start(unit)

    monkeypatch.setattr(stage, "start_gather", counted)
    return started


@pytest.mark.parametrize("params", ["device", "nvme"])
def test_a_unit_whose_gather_is_its_home_stays_gathered_from_forward_to_backward(
    tmp_path: Path, params: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    case = Case(stage=3, optimizer="adamw", steps=2, dtype="bf16", accumulation=1, global_batch=4, clip=1.0)
    offload = {} if params == "device" else {"params": "nvme"}
    config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": str(tmp_path)}}}
    with tierzero.initialize(case.model(), config) as engine:
        stage = engine.stage
        engine.backward(engine(*case.batch(0)))
        engine.step()
        gathers = _gathers(engine, monkeypatch)
        loss = engine(*case.batch(1))
        after_forward = {unit.name: unit.state for unit in stage.units}
        if params == "device":
            for unit in stage.units:  # the gathered buffer is the home itself: no byte of its own
                home = stage.store.home_tensor(SliceKey(unit.name, Kind.PARAM))
                assert unit.gathered is not None and unit.gathered.data_ptr() == home.data_ptr(), unit.name
        engine.backward(loss)
        engine.step()
        assert all(unit.state is UnitState.SHARDED for unit in stage.units)
        with torch.no_grad():
            engine(*case.batch(2))  # a forward without grad frees each unit at its end
        assert all(unit.state is UnitState.SHARDED for unit in stage.units)
    names = [unit.name for unit in stage.units]
    if params == "device":
        assert set(after_forward.values()) == {UnitState.GATHERED}
        assert sorted(gathers[: len(names)]) == sorted(names) and len(gathers) == 2 * len(names)  # the no-grad forward's too
    else:  # a copy read from NVMe: freed after forward, gathered again in backward
        assert set(after_forward.values()) == {UnitState.SHARDED}
        assert sorted(gathers[: 2 * len(names)]) == sorted(names * 2)


def _resharding(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every unit freed after its forward, as before homes were kept."""
    monkeypatch.setattr(GatherAhead, "_keeps_across", lambda self, unit: unit.name in self._decoded_across)


@pytest.mark.parametrize(
    "case",
    [
        Case(stage=3, optimizer="adamw", steps=3, dtype="bf16", accumulation=2, clip=1.0, reuse=True),
        Case(model_name="gpt2", stage=3, optimizer="adamw", steps=3, checkpointing="non_reentrant"),
        Case(model_name="llama", stage=3, optimizer="adamw", steps=3, checkpointing="reentrant", clip=0.0),
    ],
    ids=["tiny-reused-accumulated", "gpt2-non-reentrant", "llama-reentrant-step-in-backward"],
)
def test_kept_homes_train_to_the_bits_of_resharded_ones(case: Case, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.model_name != "tiny":
        pytest.importorskip("transformers")
    kept = train_case(case, rank=0, world_size=1)
    with monkeypatch.context() as patched:
        _resharding(patched)
        resharded = train_case(case, rank=0, world_size=1)
    assert kept.losses == resharded.losses
    assert kept.params is not None and resharded.params is not None
    for name, value in resharded.params.items():
        assert torch.equal(kept.params[name], value), name
