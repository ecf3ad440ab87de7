"""bf16 and fp16 compute with fp32 master weights, on 2 gloo ranks, against fp32 torch training."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Case, Reference, reference_run, run_ranks, train_case

STAGES = (1, 2, 3)
BF16 = [Case(stage=s, optimizer="adamw", dtype="bf16", steps=20) for s in STAGES]
FP16 = [
    Case(stage=3, optimizer="adamw", dtype="fp16", steps=20, initial_scale=2.0**8),
    # an absurd starting scale overflows until it has been halved below ~2**16
    Case(stage=2, optimizer="adamw", dtype="fp16", steps=20, initial_scale=2.0**24),
]
WORLD_SIZE = 2


def _rank_job(rank: int, world_size: int, _: Any) -> dict[str, list[Any]]:
    return {
        "bf16": [train_case(c, rank=rank, world_size=world_size) for c in BF16],
        "fp16": [train_case(c, rank=rank, world_size=world_size) for c in FP16],
    }


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, list[Any]]]:
    return run_ranks(_rank_job, world_size=WORLD_SIZE)


@pytest.fixture(scope="module")
def reference() -> Reference:
    return reference_run(Case(stage=1, optimizer="adamw", steps=20))


def _relative_loss_gaps(losses: list[float], ref: Reference) -> list[float]:
    return [abs(a - b) / abs(b) for a, b in zip(losses, ref.losses, strict=True)]


@pytest.mark.parametrize("index", range(len(BF16)), ids=[f"stage{c.stage}" for c in BF16])
def test_bf16_losses_track_fp32(ranks: list[dict[str, list[Any]]], reference: Reference, index: int) -> None:
    run = ranks[0]["bf16"][index]
    assert run.steps_taken == 20
    gaps = _relative_loss_gaps(run.losses, reference)
    # bf16 keeps 8 bits of mantissa (relative rounding 2**-9 ~ 0.2%); over 20 steps the
    # trajectories drift apart by a few of those, never by a wrong update's worth.
    assert gaps[0] < 5e-3, gaps
    assert max(gaps) < 2e-2, gaps
    assert run.losses[-1] < 0.5 * run.losses[0]


def test_fp16_with_dynamic_scaling_tracks_fp32(ranks: list[dict[str, list[Any]]], reference: Reference) -> None:
    run = ranks[0]["fp16"][0]
    assert run.steps_taken == 20
    gaps = _relative_loss_gaps(run.losses, reference)
    assert max(gaps) < 1e-2, gaps


def test_fp16_overflow_skips_the_step_on_every_rank(ranks: list[dict[str, list[Any]]]) -> None:
    runs = [r["fp16"][1] for r in ranks]
    skipped = 20 - runs[0].steps_taken
    # 2**24 overflows until halved to about 2**16 / |grad|; then no more overflows
    assert 4 <= skipped <= 16
    assert all(r.steps_taken == runs[0].steps_taken and r.losses == runs[0].losses for r in runs)
    # the skipped steps were the first ones and changed nothing: the run then matches
    # fp32 training that starts at the first step that did not overflow
    ref = reference_run(FP16[1], first_step=skipped)
    gaps = _relative_loss_gaps(runs[0].losses[skipped:], ref)
    assert max(gaps) < 1e-2, gaps
