"""Unmodified transformers models (GPT-2 with tied embeddings, Llama) under ZeRO on 2 gloo ranks."""

from __future__ import annotations

from typing import Any

import pytest
from harness import Case, Reference, reference_run, rel_error, run_ranks, train_case

pytest.importorskip("transformers")

MODELS = ("gpt2", "llama")
CASES = [Case(model_name=m, stage=s, optimizer="adamw") for m in MODELS for s in (1, 2, 3)] + [
    Case(model_name=m, stage=3, optimizer="sgd") for m in MODELS
] + [
    # activation checkpointing re-runs blocks in backward (without module hooks when non-reentrant)
    Case(model_name="gpt2", stage=3, optimizer="sgd", checkpointing="non_reentrant"),
    Case(model_name="llama", stage=3, optimizer="sgd", checkpointing="reentrant"),
]
TOLERANCE = {"sgd": 1e-5, "adamw": 2e-3}


def _rank_job(rank: int, world_size: int, _: Any) -> list[Any]:
    return [train_case(c, rank=rank, world_size=world_size) for c in CASES]


@pytest.fixture(scope="module")
def runs() -> list[Any]:
    return run_ranks(_rank_job, world_size=2)[0]


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, str], Reference]:
    return {(c.model_name, c.optimizer): reference_run(c) for c in CASES if c.stage == 3}


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{c.model_name}-stage{c.stage}-{c.optimizer}{'-' + c.checkpointing if c.checkpointing else ''}" for c in CASES])
def test_transformers_model_matches_single_process(runs: list[Any], references: dict[tuple[str, str], Reference], index: int) -> None:
    case = CASES[index]
    run, ref = runs[index], references[(case.model_name, case.optimizer)]
    assert run.steps_taken == case.steps
    assert run.params is not None and set(ref.params) <= set(run.params)
    errors = {name: rel_error(run.params[name], expected) for name, expected in ref.params.items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= TOLERANCE[case.optimizer], f"{worst}: {errors[worst]:.2e}"
    diffs = [abs(a - b) for a, b in zip(run.losses, ref.losses, strict=True)]
    assert max(diffs) <= 1e-4, diffs


def test_gpt2_lm_head_stays_tied(runs: list[Any]) -> None:
    params = runs[CASES.index(Case(model_name="gpt2", stage=3, optimizer="adamw"))].params
    assert params["lm_head.weight"].equal(params["transformer.wte.weight"])
