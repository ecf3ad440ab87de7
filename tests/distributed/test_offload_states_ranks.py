"""engine.offload_states / reload_states on 2 gloo ranks, stages 1, 2 and 3: each rank's device tier empties to
the byte, and training goes on with the bits of the same 2-rank run that never offloaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_ranks

import tierzero
from tierzero.common.slices import Tier
from tierzero.models.builtin import GPT, ModelSpec

SPEC = ModelSpec(vocab_size=64, n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=64)
STAGES = (1, 2, 3)
BEFORE, AFTER = 2, 2


def _train(engine: Any, steps: range, rank: int) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        ids = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2 * step + rank))
        _, loss = engine(ids, ids.roll(-1, 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    return losses


def _run(stage: int, swap: str, rank: int, *, offload: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    config = {"zero": {"stage": stage}, "optimizer": {"type": "adamw", "lr": 1e-2}, "tiers": {"nvme": {"path": swap}}}
    with tierzero.initialize(GPT(SPEC), config) as engine:
        losses = _train(engine, range(BEFORE), rank)
        held = engine.store.report().tiers[Tier.DEVICE].current
        if offload:
            engine.offload_states()
            held = (held, engine.store.report().tiers[Tier.DEVICE].current, engine.store.report().tiers[Tier.CPU].current)
            engine.reload_states()
        losses += _train(engine, range(BEFORE, BEFORE + AFTER), rank)
        return {"losses": losses, "weights": engine.full_state_dict(), "held": held}


def _rank_job(rank: int, world_size: int, swap: str) -> dict[int, Any]:
    return {
        stage: {"plain": _run(stage, swap, rank, offload=False), "offloaded": _run(stage, swap, rank, offload=True)} for stage in STAGES
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[int, Any]]:
    swap: Path = tmp_path_factory.mktemp("swap")
    return run_ranks(_rank_job, world_size=2, payload=str(swap))


@pytest.mark.parametrize("stage", STAGES)
def test_each_rank_offloads_everything_and_trains_on_with_the_same_bits(runs: list[dict[int, Any]], stage: int) -> None:
    for rank, run in enumerate(runs):
        plain, offloaded = run[stage]["plain"], run[stage]["offloaded"]
        before, after, cpu = offloaded["held"]
        assert before == plain["held"] > 0 and (after, cpu) == (0, before), f"rank {rank}"
        assert all(torch.equal(a, b) for a, b in zip(offloaded["losses"], plain["losses"], strict=True)), f"rank {rank}"
    weights, expected = runs[0][stage]["offloaded"]["weights"], runs[0][stage]["plain"]["weights"]
    assert expected is not None and weights.keys() == expected.keys()
    assert all(torch.equal(weights[name], expected[name]) for name in expected)
    # each rank trained on batches of its own
    assert not torch.equal(runs[0][stage]["plain"]["losses"][0], runs[1][stage]["plain"]["losses"][0])
