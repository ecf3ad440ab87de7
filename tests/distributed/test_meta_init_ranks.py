"""A meta-built model gets the same initial weights on every rank, whatever the world size."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_ranks

import tierzero
from tierzero.models.builtin import GPT, ModelSpec

SPEC = ModelSpec(n_layer=2, n_head=2, d_model=32, d_ff=64, max_seq_len=16)
# unit_classes [Linear] as configs/oversized.yaml: the root then holds the embeddings and every norm.
CONFIG: dict[str, Any] = {
    "zero": {"stage": 3, "unit_classes": ["Linear"]},
    "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.0},
    "train": {"seed": 11},
}


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, SPEC.vocab_size, (2, SPEC.max_seq_len + 1), generator=torch.Generator().manual_seed(3))
    return idx[:, :-1], idx[:, 1:]


def _meta_job(rank: int, world_size: int, _payload: Any) -> dict[str, Any]:
    # Each rank draws its own global RNG differently: the init must not depend on it.
    torch.manual_seed(1000 + rank)
    with torch.device("meta"):
        model = GPT(SPEC)
    with tierzero.initialize(model, CONFIG) as engine:
        with torch.no_grad():
            _, loss = engine(*_batch())
        state = engine.full_state_dict()
    return {"state": state, "loss": loss.item()}


def test_meta_built_gpt_is_identical_on_two_ranks_and_equals_one_rank() -> None:
    single = _meta_job(0, 1, None)
    ranks = run_ranks(_meta_job, world_size=2)
    assert ranks[1]["state"] is None
    gathered = ranks[0]["state"]
    assert gathered is not None and list(gathered) == list(single["state"])
    # full_state_dict assembles each unit from both ranks' slices: any rank drawing other
    # weights would show here.
    for name, value in single["state"].items():
        assert torch.equal(gathered[name], value), name
    assert ranks[0]["loss"] == ranks[1]["loss"] == pytest.approx(single["loss"], rel=1e-6)
