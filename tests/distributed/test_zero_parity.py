"""ZeRO stages 1, 2, 3 on 1, 2 and 4 real gloo ranks against single-process torch training.

One fork per world size runs every case (stages x optimizers, plus the traffic and
memory measurements), so the whole file costs three process groups.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import Case, Reference, Traffic, check_parity, measure_case, reference_run, run_ranks, train_case

WORLD_SIZES = (1, 2, 4)
STAGES = (1, 2, 3)
OPTIMIZERS = ("sgd", "adamw")
TOLERANCE = {"sgd": 1e-5, "adamw": 2e-3}

TRAIN = [Case(stage=s, optimizer=o) for s in STAGES for o in OPTIMIZERS]
MEASURE = [Case(stage=s, optimizer="adamw", accumulation=1, global_batch=4, steps=2) for s in STAGES]
MEASURE_BF16 = [Case(stage=s, optimizer="adamw", dtype="bf16", accumulation=1, global_batch=4, steps=2) for s in STAGES]


def _rank_job(rank: int, world_size: int, _: Any) -> dict[str, list[Any]]:
    train = [train_case(c, rank=rank, world_size=world_size) for c in TRAIN]
    measure = [measure_case(c, rank=rank, world_size=world_size) for c in MEASURE]
    measure_bf16 = [measure_case(c, rank=rank, world_size=world_size) for c in MEASURE_BF16]
    return {"train": train, "measure": measure, "measure_bf16": measure_bf16}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda n: f"N{n}")
def job(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, list[Any]]]]:
    world_size = request.param
    return world_size, run_ranks(_rank_job, world_size=world_size)


@pytest.fixture(scope="module")
def references() -> dict[str, Reference]:
    # The reference does not depend on the stage: one per optimizer.
    return {o: reference_run(Case(stage=1, optimizer=o)) for o in OPTIMIZERS}


@pytest.mark.parametrize("index", range(len(TRAIN)), ids=[f"stage{c.stage}-{c.optimizer}" for c in TRAIN])
def test_matches_single_process_training(job: tuple[int, list[dict[str, list[Any]]]], references: dict[str, Reference], index: int) -> None:
    _, ranks = job
    case = TRAIN[index]
    check_parity(ranks[0]["train"][index], references[case.optimizer], tolerance=TOLERANCE[case.optimizer])
    # Only rank 0 gets the state dict; every rank saw the same losses.
    assert all(r["train"][index].params is None for r in ranks[1:])
    assert all(r["train"][index].losses == ranks[0]["train"][index].losses for r in ranks)


def test_reference_really_clips_and_accumulates(references: dict[str, Reference]) -> None:
    case = TRAIN[0]
    assert case.accumulation == 2 and case.clip > 0
    for ref in references.values():
        assert sum(n > case.clip for n in ref.norms) >= 5, ref.norms


def _padded_params(traffic: Traffic) -> int:
    """Φ, padded: fp32 elements of every unit's full buffer."""
    return sum(traffic.unit_bytes.values()) // 4


@pytest.mark.parametrize("stage", STAGES)
def test_memory_report_gives_the_fp32_formulas(job: tuple[int, list[dict[str, list[Any]]]], stage: int) -> None:
    world_size, ranks = job
    for rank in ranks:
        traffic = rank["measure"][stage - 1]
        phi, n = _padded_params(traffic), world_size
        expected = {
            1: {"param": 4 * phi, "grad": 4 * phi, "master": 0, "exp_avg": 4 * phi // n, "exp_avg_sq": 4 * phi // n},
            2: {"param": 4 * phi, "grad": 4 * phi // n, "master": 0, "exp_avg": 4 * phi // n, "exp_avg_sq": 4 * phi // n},
            3: {"param": 4 * phi // n, "grad": 4 * phi // n, "master": 0, "exp_avg": 4 * phi // n, "exp_avg_sq": 4 * phi // n},
        }[stage]
        assert traffic.kinds == expected
        total = {1: 8 * phi + 8 * phi // n, 2: 4 * phi + 12 * phi // n, 3: 16 * phi // n}[stage]
        assert sum(traffic.kinds.values()) == total


@pytest.mark.parametrize("stage", STAGES)
def test_memory_report_gives_the_mixed_precision_formulas(job: tuple[int, list[dict[str, list[Any]]]], stage: int) -> None:
    world_size, ranks = job
    for rank in ranks:
        traffic = rank["measure_bf16"][stage - 1]
        phi, n = sum(traffic.unit_bytes.values()) // 2, world_size  # bf16 elements of all unit buffers
        fp32_slice = 4 * phi // n
        expected = {
            1: {"param": 2 * phi, "grad": 2 * phi, "master": fp32_slice, "exp_avg": fp32_slice, "exp_avg_sq": fp32_slice},
            2: {"param": 2 * phi, "grad": 2 * phi // n, "master": fp32_slice, "exp_avg": fp32_slice, "exp_avg_sq": fp32_slice},
            3: {"param": 2 * phi // n, "grad": 2 * phi // n, "master": fp32_slice, "exp_avg": fp32_slice, "exp_avg_sq": fp32_slice},
        }[stage]
        assert traffic.kinds == expected
        total = {1: 4 * phi + 12 * phi // n, 2: 2 * phi + 14 * phi // n, 3: 16 * phi // n}[stage]
        assert sum(traffic.kinds.values()) == total


@pytest.mark.parametrize("stage", STAGES)
def test_comm_report_uses_ring_accounting(job: tuple[int, list[dict[str, list[Any]]]], stage: int) -> None:
    world_size, ranks = job
    for rank in ranks:
        traffic = rank["measure"][stage - 1]
        full = 4 * _padded_params(traffic)
        one_pass = (world_size - 1) * full // world_size
        gathers = 2 if stage == 3 else 1
        # gradient clipping adds one all-reduce of one fp32 scalar: 2(N-1)/N x 4 bytes
        norm = 2 * (world_size - 1) * 4 // world_size
        assert traffic.comm == {"all_gather": gathers * one_pass, "reduce_scatter": one_pass, "all_reduce": norm}


def test_stage3_sends_one_and_a_half_times_stage1(job: tuple[int, list[dict[str, list[Any]]]]) -> None:
    world_size, ranks = job
    sent = [t.comm["all_gather"] + t.comm["reduce_scatter"] for t in ranks[0]["measure"]]
    if world_size == 1:
        assert sent == [0, 0, 0]
        return
    assert sent[0] == sent[1]
    assert 2 * sent[2] == 3 * sent[0]


def test_stage3_peak_gathered_is_a_few_units(job: tuple[int, list[dict[str, list[Any]]]]) -> None:
    world, ranks = job
    for rank in ranks:
        traffic = rank["measure"][2]
        blocks = sorted((b for name, b in traffic.unit_bytes.items() if name != "root"), reverse=True)
        root = traffic.unit_bytes["root"]
        if world == 1:  # a gather of one rank is its fetched slice itself (Stage3._lends): nothing gathered
            assert traffic.peak_gathered == 0
            continue
        assert root + blocks[0] <= traffic.peak_gathered <= root + blocks[0] + blocks[1]
        assert traffic.peak_gathered < sum(traffic.unit_bytes.values())
        # stages 1 and 2 never gather: their full parameters are model state, not scratch
        assert rank["measure"][0].peak_gathered == rank["measure"][1].peak_gathered == 0
