"""engine.offload_states / reload_states on the built-in GPT: the device tier empties to the byte, and
training goes on with the bits of an engine that never offloaded ([Note: offloaded states])."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from test_no_grad_read_ahead import wide_gpt

import tierzero
from tierzero.common.slices import Kind, Tier
from tierzero.models.builtin import ModelSpec
from tierzero.offload.base import TierCapacityError
from tierzero.stages.plan import KIND_HOMES
from tierzero.store.ledger import Use

SPEC = ModelSpec(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=64)
BEFORE, AFTER = 2, 3
"""Optimizer steps before the offload and after the reload."""


def _config(stage: int, swap: Path, **more: Any) -> dict[str, Any]:
    base = {"zero": {"stage": stage}, "optimizer": {"type": "adamw", "lr": 1e-2}, "tiers": {"nvme": {"path": str(swap)}}}
    return base | more


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, SPEC.vocab_size, (4, 12), generator=torch.Generator().manual_seed(step))


def _train(engine: Any, steps: range) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        ids = _batch(step)
        _, loss = engine(ids, ids.roll(-1, 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return losses


def _reference(config: dict[str, Any]) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    with tierzero.initialize(wide_gpt(SPEC), copy.deepcopy(config)) as engine:
        losses = _train(engine, range(BEFORE + AFTER))
        return losses, engine.full_state_dict()


def _device(engine: Any) -> Any:
    return engine.store.report().tiers[Tier.DEVICE]


def _home_bytes(engine: Any, tier: Tier, kinds: tuple[str, ...] = ("params", "grads", "optimizer")) -> int:
    """Bytes of the slices the plan homes on `tier`, of the kinds' fields."""
    return sum(spec.nbytes for spec in engine.plan.all() if spec.home is tier and KIND_HOMES[spec.kind] in kinds)


def _held(by_kind: dict[Kind, int]) -> dict[Kind, int]:
    return {kind: n for kind, n in by_kind.items() if n}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


@pytest.mark.parametrize(("stage", "dtype"), [(1, "fp32"), (2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_the_device_tier_empties_and_training_goes_on_with_the_same_bits(tmp_path: Path, stage: int, dtype: str) -> None:
    config = _config(stage, tmp_path, precision={"param_dtype": dtype})
    losses, weights = _reference(config)
    with tierzero.initialize(wide_gpt(SPEC), config) as engine:
        got = _train(engine, range(BEFORE))
        on_device = _home_bytes(engine, Tier.DEVICE)
        assert on_device > 0 and _device(engine).current == on_device  # everything lives on the device tier
        engine.offload_states()
        device, cpu = _device(engine), engine.store.report().tiers[Tier.CPU]
        assert (device.current, _held(device.current_by_kind)) == (0, {})
        assert cpu.current_by_use[Use.HOME] == on_device
        with pytest.raises(ValueError, match=r"^a forward while the engine's params, grads, optimizer states are offloaded "
                           r"\(engine.offload_states\): call engine.reload_states\(\) first$"):  # fmt: skip
            _train(engine, range(1))
        engine.reload_states()
        assert _device(engine).current == on_device and engine.store.report().tiers[Tier.CPU].current == 0
        got += _train(engine, range(BEFORE, BEFORE + AFTER))
        assert _same(engine.full_state_dict(), weights)
    assert all(torch.equal(a, b) for a, b in zip(got, losses, strict=True))


def test_generation_runs_with_the_optimizer_and_gradients_offloaded(tmp_path: Path) -> None:
    config = _config(2, tmp_path)
    losses, weights = _reference(config)
    ids = _batch(99)[:, :6]
    with tierzero.initialize(wide_gpt(SPEC), config) as engine:
        got = _train(engine, range(BEFORE))
        expected = engine.generate(ids, max_new_tokens=8)
        engine.offload_states(["grads", "optimizer"])
        params = _home_bytes(engine, Tier.DEVICE, ("params",))
        assert _device(engine).current_by_use[Use.HOME] == params > 0
        assert set(_held(_device(engine).current_by_kind)) == {Kind.PARAM}
        assert torch.equal(engine.generate(ids, max_new_tokens=8), expected)
        assert len(set(expected[:, 6:].flatten().tolist())) > 3
        refused = "while the engine's grads, optimizer states are offloaded (engine.offload_states): call engine.reload_states() first"
        for what, call in [
            ("a forward", lambda: _train(engine, range(1))),
            ("step()", engine.step),
            ("full_state_dict()", engine.full_state_dict),
        ]:
            with pytest.raises(ValueError) as caught:
                call()
            assert str(caught.value) == f"{what} {refused}"
        with pytest.raises(ValueError, match="^offload_states\\(\\) while"):
            engine.offload_states(["params"])
        engine.reload_states()
        engine.reload_states()  # nothing offloaded: nothing to do
        got += _train(engine, range(BEFORE, BEFORE + AFTER))
        assert _same(engine.full_state_dict(), weights)
    assert all(torch.equal(a, b) for a, b in zip(got, losses, strict=True))


def test_offloading_params_and_optimizer_states_homed_on_nvme_moves_only_the_device_s(tmp_path: Path) -> None:
    config = _config(3, tmp_path, offload={"params": "nvme", "optimizer": "nvme"})
    losses, weights = _reference(config)
    with tierzero.initialize(wide_gpt(SPEC), config) as engine:
        got = _train(engine, range(BEFORE))
        grads = _home_bytes(engine, Tier.DEVICE)
        assert grads == _home_bytes(engine, Tier.DEVICE, ("grads",)) > 0
        engine.offload_states()
        # the PARAM slices read ahead for the next forward are given back: nothing is left on the device
        assert (_device(engine).current, engine.store.report().tiers[Tier.CPU].current_by_use[Use.HOME]) == (0, grads)
        engine.reload_states()
        got += _train(engine, range(BEFORE, BEFORE + AFTER))
        assert _same(engine.full_state_dict(), weights)
    assert all(torch.equal(a, b) for a, b in zip(got, losses, strict=True))


def test_offload_is_refused_inside_a_step_and_for_unknown_kinds(tmp_path: Path) -> None:
    with tierzero.initialize(wide_gpt(SPEC), _config(1, tmp_path)) as engine:
        ids = _batch(0)
        _, loss = engine(ids, ids)
        with pytest.raises(ValueError) as caught:
            engine.offload_states()
        assert str(caught.value) == (
            "offload_states() in the middle of a training step (unit blocks.0 has a backward to come): call it after engine.step()"
        )
        engine.backward(loss)
        with pytest.raises(ValueError, match=r"\(unit blocks.0 holds gradients not stepped yet\): call it after engine.step\(\)$"):
            engine.offload_states()
        engine.step()
        with pytest.raises(ValueError) as caught:
            engine.offload_states(["optimizer", "weights"])
        assert str(caught.value) == "offload_states kinds must be some of params, grads, optimizer, got ['optimizer', 'weights']"
        assert _device(engine).current == _home_bytes(engine, Tier.DEVICE)  # nothing moved


def test_a_cpu_tier_too_small_moves_nothing(tmp_path: Path) -> None:
    probe = _config(1, tmp_path)
    with tierzero.initialize(wide_gpt(SPEC), probe) as engine:
        on_device = _home_bytes(engine, Tier.DEVICE)
    config = _config(1, tmp_path, tiers={"cpu": {"capacity": on_device // 2}, "nvme": {"path": str(tmp_path)}})
    losses, _ = _reference(config)
    with tierzero.initialize(wide_gpt(SPEC), config) as engine:
        got = _train(engine, range(BEFORE))
        with pytest.raises(TierCapacityError, match=r"cpu tier is full: .*slices moved, and moved back\), .* raise tiers.cpu.capacity"):
            engine.offload_states()
        assert _device(engine).current == on_device and engine.store.report().tiers[Tier.CPU].current_by_use[Use.HOME] == 0
        got += _train(engine, range(BEFORE, BEFORE + AFTER))  # not offloaded: nothing refused
    assert all(torch.equal(a, b) for a, b in zip(got, losses, strict=True))
