"""engine.generate on 2 gloo ranks: transformers' greedy tokens at stages 1 and 3 on every placement,
ranks kept in step when their rows stop at different times, and one seed giving one sample everywhere."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from generate_cases import (
    MODELS,
    NEW_TOKENS,
    PAD,
    PLACEMENTS,
    PROMPT_LENGTHS,
    engine_config,
    engine_generate,
    hf_model,
    prompts,
    reference,
    stopping_token,
)  # fmt: skip
from harness import run_ranks

pytest.importorskip("transformers")

WIDTH = max(PROMPT_LENGTHS)
CASES = [(m, s, p) for m in MODELS for s in (1, 3) for p in PLACEMENTS]
ROWS = ([1], [0, 2, 3])
"""Each rank's rows of the batch in the EOS case: rank 0's one row stops a few steps in."""
SAMPLE = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "temperature": 1.5, "top_p": 0.9, "seed": 11}


def _rank_job(rank: int, world_size: int, payload: tuple[str, int]) -> dict[str, Any]:
    swap, eos = payload
    ids, mask = prompts()
    greedy = [engine_generate(hf_model(m), engine_config(s, p, swap), ids, mask, max_new_tokens=NEW_TOKENS) for m, s, p in CASES]
    mine = ROWS[rank]
    stopped = engine_generate(
        hf_model("llama"), engine_config(3, "nvme", swap), ids[mine], mask[mine], max_new_tokens=NEW_TOKENS, eos_token_id=eos
    )
    sampled = engine_generate(hf_model("gpt2"), engine_config(3, "cpu", swap), ids, mask, **SAMPLE)
    return {"greedy": greedy, "stopped": stopped, "sampled": sampled}


@pytest.fixture(scope="module")
def expected() -> dict[str, Any]:
    ids, mask = prompts()
    models = {name: hf_model(name) for name in MODELS}
    greedy = {name: reference(model, ids, mask, max_new_tokens=NEW_TOKENS) for name, model in models.items()}
    eos = stopping_token(greedy["llama"], WIDTH)
    stopped = [reference(models["llama"], ids[rows], mask[rows], max_new_tokens=NEW_TOKENS, eos_token_id=eos) for rows in ROWS]
    return {"greedy": greedy, "eos": eos, "stopped": stopped}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, expected: dict[str, Any]) -> list[dict[str, Any]]:
    swap: Path = tmp_path_factory.mktemp("swap")
    results = run_ranks(_rank_job, world_size=2, payload=(str(swap), expected["eos"]))
    assert list(swap.iterdir()) == []  # every engine's close removed its swap file
    return results


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"{m}-stage{s}-{p}" for m, s, p in CASES])
def test_each_rank_gets_transformers_greedy_tokens(runs: list[dict[str, Any]], expected: dict[str, Any], index: int) -> None:
    name = CASES[index][0]
    for rank, run in enumerate(runs):
        assert torch.equal(run["greedy"][index], expected["greedy"][name]), f"rank {rank}"


def test_a_rank_whose_rows_all_stopped_steps_on_with_the_other(runs: list[dict[str, Any]], expected: dict[str, Any]) -> None:
    alone, other = expected["stopped"]  # transformers on each rank's rows alone: rank 0's stops sooner
    assert alone.shape[1] < other.shape[1] == runs[1]["stopped"].shape[1]
    assert torch.equal(runs[1]["stopped"], other)
    # rank 0 went on with the gathers rank 1 needed, its stopped row emitting the pad token
    padded = torch.cat([alone, torch.full((1, other.shape[1] - alone.shape[1]), PAD)], dim=1)
    assert torch.equal(runs[0]["stopped"], padded)


def test_one_seed_samples_the_same_tokens_on_every_rank_and_alone(runs: list[dict[str, Any]], tmp_path: Path) -> None:
    ids, mask = prompts()
    alone = engine_generate(hf_model("gpt2"), engine_config(3, "cpu", tmp_path), ids, mask, **SAMPLE)
    assert torch.equal(runs[0]["sampled"], alone) and torch.equal(runs[1]["sampled"], alone)
    greedy = reference(hf_model("gpt2"), ids, mask, max_new_tokens=NEW_TOKENS)
    assert not torch.equal(alone, greedy)  # it did sample
