"""The engine's public surface: initialize with and without a process group, reports, state, errors."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness import Case, TinyLM, run_ranks

import tierzero


def _config(**zero: Any) -> dict[str, Any]:
    return {"zero": {"stage": 3, **zero}, "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.0, "weight_decay": 0.0}}


def test_single_process_without_group_counts_no_traffic() -> None:
    case = Case(stage=3, optimizer="sgd", accumulation=3)
    with tierzero.initialize(case.model(), case.config()) as engine:
        assert not torch.distributed.is_initialized()
        assert isinstance(engine.module, TinyLM)
        for micro in range(3):
            engine.backward(case.loss(engine, *case.micro_batch(0, micro=micro, rank=0, world_size=1)))
            engine.step()
            assert engine.global_step == (1 if micro == 2 else 0)
        assert engine.comm_report() == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
        report = engine.memory_report()
        assert set(report["kinds"]) == {"param", "grad", "master", "exp_avg", "exp_avg_sq"}
        assert set(report["tiers"]["device"]) == {"current", "peak", "capacity"}
        assert report["tiers"]["device"]["current"] >= sum(report["kinds"].values())


def test_full_state_dict_loads_into_the_plain_model_and_gives_the_same_loss() -> None:
    case = Case(stage=3, optimizer="adamw", accumulation=1)
    engine = tierzero.initialize(case.model(), case.config())
    try:
        for step in range(3):
            engine.backward(case.loss(engine, *case.batch(step)))
            engine.step()
        state = engine.full_state_dict()
        assert state is not None and list(state) == [n for n, _ in TinyLM().named_parameters(remove_duplicate=False)]
        assert all(t.device.type == "cpu" and t.dtype == torch.float32 for t in state.values())
        plain = TinyLM()
        plain.load_state_dict(state)
        with torch.no_grad():
            expected = case.loss(plain, *case.batch(9))
            actual = case.loss(engine, *case.batch(9))
        assert actual.item() == pytest.approx(expected.item(), rel=1e-6)
    finally:
        engine.close()


def test_stage_zero_is_refused_with_the_fix() -> None:
    with pytest.raises(ValueError, match="zero.stage is 0, this engine runs stages 1, 2 and 3: set zero.stage to 1, 2 or 3"):
        tierzero.initialize(TinyLM(), _config() | {"zero": {"stage": 0}})


def test_unknown_unit_class_is_refused() -> None:
    with pytest.raises(ValueError, match=r"zero.unit_classes names \['GPT2Block'\]"):
        tierzero.initialize(TinyLM(), _config(unit_classes=["GPT2Block"]))


def test_world_size_without_launcher_variables_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE is 2 but RANK, MASTER_ADDR, MASTER_PORT is not set: launch with torchrun"):
        tierzero.initialize(TinyLM(), _config())


def _launched_job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    case = Case(stage=2, optimizer="sgd", accumulation=1, global_batch=4)
    engine = tierzero.initialize(case.model(), case.config())
    created = torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo"
    engine.backward(case.loss(engine, *case.micro_batch(0, micro=0, rank=rank, world_size=world_size)))
    engine.step()
    out = {"created": created, "world": torch.distributed.get_world_size(), "comm": engine.comm_report()}
    engine.close()
    out["left"] = not torch.distributed.is_initialized()
    return out


def test_initialize_creates_the_gloo_group_from_torchrun_environment() -> None:
    results = run_ranks(_launched_job, world_size=2, launched=True)
    assert [r["created"] for r in results] == [True, True]
    assert [r["world"] for r in results] == [2, 2]
    assert all(r["comm"]["all_gather"] > 0 and r["comm"]["reduce_scatter"] > 0 for r in results)
    # the engine created the group, so closing it leaves the group too
    assert [r["left"] for r in results] == [True, True]
    assert "WORLD_SIZE" not in os.environ


def test_device_tier_too_small_fails_at_start_and_cleans_up(tmp_path: Any) -> None:
    config = _config() | {
        "optimizer": {"type": "adamw"},
        "offload": {"optimizer": "nvme"},
        "tiers": {"device": {"capacity": 4096}, "nvme": {"path": str(tmp_path)}},
    }
    with pytest.raises(MemoryError, match="device tier is full: needs .* raise tiers.device.capacity"):
        tierzero.initialize(TinyLM(), config)
    assert list(tmp_path.iterdir()) == []


def test_frozen_parameters_are_not_trained_and_stay_in_the_state_dict() -> None:
    case = Case(stage=3, optimizer="adamw", accumulation=1)
    model = case.model()
    model.norm.weight.requires_grad_(False)
    frozen = model.norm.weight.detach().clone()
    with tierzero.initialize(model, case.config()) as engine:
        # the frozen weight is sharded in a unit of its own, like the trained ones: no module holds it
        assert [name for name, _ in engine.module.named_parameters()] == []
        assert [s.name for u in engine.units if not u.trainable for s in u.slots] == ["norm.weight"]
        for step in range(2):
            engine.backward(case.loss(engine, *case.batch(step)))
            engine.step()
        state = engine.full_state_dict()
    assert state is not None and state["norm.weight"].equal(frozen)
    assert not state["norm.bias"].equal(case.model().norm.bias.detach())
