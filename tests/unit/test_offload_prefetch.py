"""The prefetcher wired into stage 3: order learned, hits counted, order changes survived, budgets kept."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
from tierzero.common.slices import Kind, Tier
from tierzero.prefetch import Mode, Phase, UnitEvent

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case  # noqa: E402

NVME = {"params": "nvme", "optimizer": "nvme"}


def _engine(
    case: Case, swap: Path, *, offload: dict[str, str], prefetch: dict[str, int] | None = None, zero: dict[str, Any] | None = None
) -> Any:
    config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": str(swap)}}}
    if prefetch is not None:
        config["prefetch"] = prefetch
    if zero is not None:
        config["zero"] = config["zero"] | zero
    return tierzero.initialize(case.model(), config)


def _train(engine: Any, case: Case, *, steps: int, skip_on_odd: bool = False) -> list[Any]:
    reports = []
    for step in range(steps):
        # TinyLM runs its first `active` blocks: an odd step leaves the last one out
        engine.module.active = 2 if skip_on_odd and step % 2 else 3
        engine.backward(engine(*case.batch(step)))
        engine.step()
        reports.append(engine.prefetch_report())
    return reports


def _case() -> Case:
    return Case(stage=3, optimizer="adamw", steps=6, dtype="bf16", accumulation=1, global_batch=4)


@pytest.mark.parametrize("params", ["device", "nvme"])
def test_order_of_step_one_is_learned_and_followed(tmp_path: Path, params: str) -> None:
    case = _case()
    offload = {} if params == "device" else {"params": "nvme"}
    # Stepped after backward: in the next forward a unit's slice would wait for its step's write.
    with _engine(case, tmp_path, offload=offload, zero={"stage": 3, "step_in_forward": False}) as engine:
        assert engine.prefetch_report() is None
        reports = _train(engine, case, steps=3)
        order = engine.stage.param_prefetch.policy.order
    blocks = [f"blocks.{i}" for i in range(3)]
    # forward: the root (the whole model) then each block
    expected = [("root", Phase.FORWARD), *((b, Phase.FORWARD) for b in blocks)]
    if params == "nvme":
        # A gather of a copy read from NVMe is freed after forward; backward gathers again: the root, then
        # the blocks last to first. A device home stays gathered for its backward ([Note: homes kept across
        # the turn] in tierzero/stages/gather_ahead.py): its backward fetches nothing.
        expected += [("root", Phase.BACKWARD), *((b, Phase.BACKWARD) for b in reversed(blocks))]
    assert order == tuple(UnitEvent(unit, phase) for unit, phase in expected)
    assert [r.mode for r in reports] == [Mode.LEARNING, Mode.FOLLOWING, Mode.FOLLOWING]
    assert reports[0].hits == 0 and reports[0].misses == len(expected)
    if params == "nvme":
        return
    # device-homed slices are "fetched" at once: from step 2 on, every unit is a hit
    for report in reports[1:]:
        assert (report.hits, report.misses, report.events) == (len(expected), 0, len(expected))
        assert report.hit_rate == 1.0


def test_hits_are_counted_with_params_on_nvme(tmp_path: Path) -> None:
    case = _case()
    with _engine(case, tmp_path, offload=NVME) as engine:
        reports = _train(engine, case, steps=4)
        # the next step's first units are already coming up, and the store counts exactly them
        ahead = engine.stage.param_prefetch.policy.ahead_bytes
        assert 0 < ahead == engine.store.report().tiers[Tier.DEVICE].current_by_kind.get(Kind.PARAM, 0)
    for report in reports[1:]:
        assert report.mode is Mode.FOLLOWING
        # every event consumed a slice, each a hit or a miss, and the bytes were fetched ahead
        assert report.hits + report.misses == report.events
        assert report.issued_bytes > 0 and report.hits > 0
        assert report.waited_s >= 0.0 and report.unused == ()


def test_order_change_falls_back_says_so_once_and_keeps_the_numbers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    case = _case()
    with _engine(case, tmp_path, offload={}) as plain:
        _train(plain, case, steps=5, skip_on_odd=True)
        expected = plain.full_state_dict()
    caplog.clear()  # the plain engine's prefetcher said it once too
    with caplog.at_level(logging.WARNING, logger="tierzero.prefetch"):
        with _engine(case, tmp_path, offload=NVME) as engine:
            reports = _train(engine, case, steps=5, skip_on_odd=True)
            params = engine.full_state_dict()
    assert [r.mode for r in reports] == [Mode.LEARNING] + [Mode.DIVERGED] * 4
    warnings = [r for r in caplog.records if "unit order changed" in r.getMessage()]
    assert len(warnings) == 1
    assert expected is not None and params is not None
    assert all(torch.equal(params[name], expected[name]) for name in expected)
    # the block left out on odd steps was not trained on them: it still moved over the run
    assert not torch.equal(params["blocks.2.up.weight"], case.model().blocks[2].up.weight.detach())


@pytest.mark.parametrize("budget_units", [1, 2])
def test_bytes_ahead_never_above_the_budget(tmp_path: Path, budget_units: int) -> None:
    case = _case()
    block = 12288  # one TinyLM block in bf16, padded to the I/O alignment
    budget = budget_units * block
    with _engine(case, tmp_path, offload=NVME, prefetch={"bytes": budget, "max_live_bytes": budget}) as engine:
        unit_bytes = engine.stage.param_prefetch.policy.unit_bytes
        assert unit_bytes["blocks.0"] == block
        _train(engine, case, steps=1)
        engine.store.reset_peaks()
        reports = _train(engine, case, steps=3)
        peak = engine.store.report().tiers[Tier.DEVICE].peak_by_kind.get(Kind.PARAM, 0)
    for report in reports:
        assert report.issued_bytes > 0
        assert report.peak_in_flight_bytes <= budget
        assert report.peak_ahead_bytes <= budget
    # By the store's accounting: the slices fetched ahead, plus those gathers read; at world size
    # 1 a forward's gather is its fetched slice, held while the unit is gathered: the root (the
    # whole forward), the block computing and the one gathered ahead of it (zero.gather_ahead 1).
    assert block <= peak <= budget + unit_bytes["root"] + 2 * block


def test_a_step_interrupted_just_after_the_policy_recorded_a_unit_closes_cleanly() -> None:
    """Ctrl-C may land inside `ParamPrefetch.acquire` once the policy has recorded the unit and before
    anything else: closing then ends the step with the policy's report, not `cancel_step`'s error."""
    from tierzero.prefetch import Prefetcher
    from tierzero.stages.param_prefetch import ParamPrefetch

    policy = Prefetcher(unit_bytes={"a": 10, "b": 10}, prefetch_bytes=20, max_live_bytes=20)
    fetches = ParamPrefetch(store=None, policy=policy)  # nothing fetched: the store is never asked
    fetches.begin_step()
    assert fetches.end_step() is None and policy.recorded == 0  # a step nothing used: cancelled
    fetches.begin_step()
    policy.record("a", Phase.FORWARD)  # acquire's first act, then the interrupt
    report = fetches.end_step(cut_short=True)
    assert report is not None and report.events == 1 and policy.recorded == 0
    assert policy.order == ()  # a step cut short teaches no order


def test_a_step_opened_early_and_never_used_leaves_no_trace() -> None:
    from tierzero.prefetch import Prefetcher

    policy = Prefetcher(unit_bytes={"a": 10, "b": 10}, prefetch_bytes=20, max_live_bytes=20)
    policy.begin_step()
    for unit in ("a", "b"):
        policy.record(unit, Phase.FORWARD)
        policy.consumed(unit, ready=False)
    assert policy.exhausted is False  # learning: nothing to be exhausted against
    first = policy.end_step()
    policy.begin_step()
    assert [r.unit for r in policy.plan()] == ["a", "b"]
    policy.cancel_step()  # e.g. the engine closed before the next forward
    assert policy.order == (UnitEvent("a", Phase.FORWARD), UnitEvent("b", Phase.FORWARD))
    policy.begin_step()
    for unit in ("a", "b"):
        assert policy.exhausted is False
        policy.record(unit, Phase.FORWARD)
        policy.consumed(unit, ready=True)
    assert policy.exhausted is True
    report = policy.end_step()
    assert (first.step, report.step, report.mode, report.hits) == (1, 2, Mode.FOLLOWING, 2)
    policy.begin_step()
    policy.record("a", Phase.FORWARD)
    with pytest.raises(RuntimeError, match="cancel_step\\(\\) after 1 recorded events: call end_step\\(\\) instead"):
        policy.cancel_step()
