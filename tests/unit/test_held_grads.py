"""Gradient pieces held from backward to a clipped step ([Note: held gradient pieces])."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
from tierzero.common.slices import Kind, Tier
from tierzero.stages.grads.held import HeldGrads
from tierzero.stages.grads.pieces import GradPieces
from tierzero.store.ledger import StoreReport, TierUsage

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case  # noqa: E402

CASE = Case(stage=3, optimizer="adamw", steps=3, clip=0.05, accumulation=1, global_batch=4)


class _Store:
    """What `HeldGrads` asks of a store: its CPU tier's usage, and the bookings it makes."""

    def __init__(self, *, capacity: int | None, current: int) -> None:
        self.capacity, self.current, self.booked = capacity, current, 0

    def report(self) -> Any:
        usage = TierUsage(capacity=self.capacity, current=self.current, peak=self.current, current_by_kind={},
                          peak_by_kind={}, current_by_use={})  # fmt: skip
        return StoreReport(tiers={Tier.CPU: usage}, staging=None)  # type: ignore[arg-type]  # no swapper to report

    def book(self, tier: Tier, kind: Kind, nbytes: int) -> None:
        assert tier is Tier.CPU and kind is Kind.GRAD
        self.booked += nbytes


def _pieces(nbytes: int) -> GradPieces:
    return GradPieces(tensors=(torch.zeros(nbytes // 4),), tier=Tier.CPU, nbytes=nbytes)


@pytest.mark.parametrize(("capacity", "headroom"), [(None, 10**9), (10**9, 10**9), (None, 2 * 250)])
def test_pieces_are_held_only_where_there_is_room_and_booked_while_held(capacity: int | None, headroom: int) -> None:
    store = _Store(capacity=capacity, current=1000)
    held = HeldGrads(store, headroom=lambda: headroom)  # type: ignore[arg-type]  # a fake: report() and book() only
    kept = [held.hold(f"u{i}", _pieces(100)) for i in range(3)]
    if capacity is not None:  # a capacity the plan filled: no second copy of the gradients beside the homes
        assert kept == [False] * 3 and store.booked == 0
        return
    assert kept == ([True, True, True] if headroom > 500 else [True, True, False])  # half of 500: two of 100
    assert store.booked == 100 * sum(kept) and ("u0" in held) and ("u2" in held) is kept[2]
    assert held.get("u0") is not None and store.booked == 100 * sum(kept)  # still held, still booked
    assert held.take("u0") is not None and "u0" not in held and store.booked == 100 * (sum(kept) - 1)
    held.drop()
    assert store.booked == 0 and "u1" not in held and held.take("u1") is None


def _run(monkeypatch: pytest.MonkeyPatch, *, hold: bool, between: Any = None) -> tuple[list[Any], dict[str, torch.Tensor]]:
    """(each step's loss and norm, the final parameters), holding pieces or landing them; `between(engine)`
    runs after each backward, before the step."""
    with monkeypatch.context() as patch:
        if not hold:
            patch.setattr(HeldGrads, "hold", lambda self, unit, pieces: False)
        config = CASE.config() | {"offload": {"gradients": "cpu", "optimizer": "cpu"}, "precision": {"param_dtype": "bf16"}}
        engine = tierzero.initialize(CASE.model(), config)
        seen = []
        with engine:
            for step in range(CASE.steps):
                loss = engine(*CASE.batch(step))
                engine.backward(loss)
                if between is not None:
                    seen.append(between(engine))
                engine.step()
                seen.append((loss.item(), engine.grad_norm))
            return seen, engine.full_state_dict()


def _grads(engine: Any) -> tuple[int, list[torch.Tensor]]:
    """(the units holding pieces, every unit's GRAD slice read as a user's hook would read it before the step)."""
    held = sum(unit.name in engine.stage.held_grads for unit in engine.units)
    out = []
    for unit in engine.units:
        with engine.stage.slice(unit, Kind.GRAD, write=False) as grads:
            out.append(grads.clone())
    return held, out


def test_a_gradient_read_before_the_step_finds_the_held_pieces_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    held, params = _run(monkeypatch, hold=True, between=_grads)
    landed, landed_params = _run(monkeypatch, hold=False, between=_grads)
    assert len(held) == len(landed) == 2 * CASE.steps
    for step in range(CASE.steps):
        (units_held, ours), (units_landed, theirs) = held[2 * step], landed[2 * step]
        assert units_held == len(ours) and units_landed == 0
        assert all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True)) and any(a.any() for a in ours)
        # The same loss and norm, and the step clipped.
        assert held[2 * step + 1] == landed[2 * step + 1] and held[2 * step + 1][1] > CASE.clip
    assert all(torch.equal(params[name], landed_params[name]) for name in params)


def test_dropped_gradients_drop_the_held_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    def dropped(engine: Any) -> tuple[int, int]:
        stage = engine.stage
        held = sum(unit.name in stage.held_grads for unit in engine.units)
        stage.zero_grads()
        grads = engine.store.report().tiers[Tier.CPU].current_by_kind[Kind.GRAD]
        homes = sum(unit.padded_numel * 2 for unit in engine.units)
        assert not any(unit.name in stage.held_grads for unit in engine.units) and grads == homes
        return held, len(engine.units)

    seen, _ = _run(monkeypatch, hold=True, between=dropped)
    counts = seen[::2]
    assert all(held == units for held, units in counts)  # every unit held, then none once dropped
