"""Hybrid sharding (zero.shard_group_size) on 4 gloo ranks laid out as 2 nodes x 2: ZeRO-3 inside
each node, the two nodes replicas of each other.

Bitwise equal to plain stage 3 at the same world size and data, SGD and AdamW: the replicas
add their partial sums in a chain that reproduces plain ZeRO's rank-order sum ([Note: the
replicas' sum in rank order] in tierzero/comm/replicated.py). Clipping is off in these runs: the
norm is summed over other slices (2 halves instead of 4 quarters), so its last bits, and the
clipped step's, may differ; every other number is the same.

Bytes, one micro-step, Φ the padded parameter count (padded for 2 shards) and B = 4Φ: the
shard group (one node) all-gathers twice and reduce-scatters once, B/2 each, all inside the
node; the replica group sends each rank's half of the summed gradient once, B/2, all across
nodes; plain stage 3 sends 1.5 B across nodes (tests/distributed/test_comm_links.py).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness import Case, rel_error, run_ranks, train_case

HYBRID = (("shard_group_size", 2),)
CASES = {
    (o, hybrid): Case(stage=3, optimizer=o, clip=0.0, steps=4, zero=HYBRID if hybrid else ())
    for o in ("sgd", "adamw")
    for hybrid in (False, True)
}


CLIPPED = {hybrid: Case(stage=3, optimizer="sgd", steps=4, zero=HYBRID if hybrid else ()) for hybrid in (False, True)}


def _traffic(rank: int, world_size: int) -> dict[str, Any]:
    import tierzero

    case = Case(stage=3, optimizer="adamw", clip=0.0, accumulation=1, global_batch=4, steps=2, zero=HYBRID)
    engine = tierzero.initialize(case.model(), case.config())
    with engine:
        for step in range(2):
            engine.reset_comm_report()
            engine.backward(case.loss(engine, *case.micro_batch(step, micro=0, rank=rank, world_size=world_size)))
            engine.step()
        phi = sum(u.padded_numel for u in engine.units)
        return {"phi": phi, "shards": engine.units[0].world_size, "groups": engine.comm_report(per_group=True)}


def _train_steps(engine: Any, case: Case, steps: range, *, rank: int, world_size: int) -> None:
    for step in steps:
        for micro in range(case.accumulation):
            engine.backward(case.loss(engine, *case.micro_batch(step, micro=micro, rank=rank, world_size=world_size)))
            engine.step()


def _resumed(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """The AdamW hybrid run saved after 2 of its 4 steps, then a new engine loads and trains the other 2."""
    import tierzero

    case = CASES[("adamw", True)]
    with tierzero.initialize(case.model(), case.config()) as engine:
        _train_steps(engine, case, range(2), rank=rank, world_size=world_size)
        saved = engine.save_checkpoint(root)
    with tierzero.initialize(case.model(), case.config()) as engine:
        loaded = engine.load_checkpoint(root)
        _train_steps(engine, case, range(2, 4), rank=rank, world_size=world_size)
        return {"saved": saved, "loaded": loaded, "params": engine.full_state_dict(), "step": engine.global_step}


def _job(rank: int, world_size: int, root: str) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "2", str(rank % 2)
    runs = {key: train_case(case, rank=rank, world_size=world_size) for key, case in CASES.items()}
    clipped = {key: train_case(case, rank=rank, world_size=world_size) for key, case in CLIPPED.items()}
    traffic, resumed = _traffic(rank, world_size), _resumed(rank, world_size, root)
    return {"runs": runs, "clipped": clipped, "traffic": traffic, "resumed": resumed}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_ranks(_job, world_size=4, payload=str(tmp_path_factory.mktemp("hybrid_ckpt")))


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_hybrid_sharding_equals_plain_stage3_bit_for_bit(results: list[dict[str, Any]], optimizer: str) -> None:
    plain, hybrid = results[0]["runs"][(optimizer, False)], results[0]["runs"][(optimizer, True)]
    assert plain.params is not None and hybrid.params is not None
    assert hybrid.params.keys() == plain.params.keys()
    for name, value in plain.params.items():
        assert torch.equal(hybrid.params[name], value), name
    assert hybrid.losses == plain.losses
    assert plain.steps_taken == hybrid.steps_taken == 4
    # training moved the weights: the equality is not of two untouched models
    first = Case(stage=3, optimizer=optimizer).model()
    assert not torch.equal(first.state_dict()["blocks.0.up.weight"], plain.params["blocks.0.up.weight"])
    for rank in results[1:]:
        assert rank["runs"][(optimizer, True)].params is None  # only rank 0 returns the state dict


def test_hybrid_with_clipping_stays_within_rounding_of_plain_stage3(results: list[dict[str, Any]]) -> None:
    """The norm is summed over 2 halves instead of 4 quarters: the same up to fp32 rounding."""
    plain, hybrid = results[0]["clipped"][False], results[0]["clipped"][True]
    for name, value in plain.params.items():
        assert rel_error(hybrid.params[name], value) < 1e-6, name
    assert max(abs(a - b) for a, b in zip(hybrid.losses, plain.losses)) < 1e-5


def test_hybrid_memory_is_stage3_over_the_shard_group(results: list[dict[str, Any]]) -> None:
    for rank in results:
        kinds = rank["runs"][("adamw", True)].memory["kinds"]
        phi = rank["traffic"]["phi"]
        # fp32 AdamW: 16 bytes a parameter over 2 shards, not 4
        assert kinds == {"param": 2 * phi, "grad": 2 * phi, "master": 0, "exp_avg": 2 * phi, "exp_avg_sq": 2 * phi}


def test_hybrid_sends_only_the_replicas_sum_across_nodes(results: list[dict[str, Any]]) -> None:
    for rank in results:
        traffic = rank["traffic"]
        assert traffic["shards"] == 2
        half = 4 * traffic["phi"] // 2
        assert traffic["groups"] == {
            "shard": {
                "all_gather": {"intra": 2 * half, "inter": 0},
                "reduce_scatter": {"intra": half, "inter": 0},
                "all_reduce": {"intra": 0, "inter": 0},
            },
            "replica": {
                "all_gather": {"intra": 0, "inter": 0},
                "reduce_scatter": {"intra": 0, "inter": 0},
                "all_reduce": {"intra": 0, "inter": half},
            },
        }


def test_a_hybrid_run_resumes_from_its_checkpoint_bit_for_bit(results: list[dict[str, Any]]) -> None:
    """The first replica (ranks 0, 1) writes the checkpoint; every rank loads its shard of it."""
    saved = results[0]["resumed"]["saved"]
    assert all(r["resumed"]["saved"] == saved and r["resumed"]["loaded"] == saved for r in results)
    files = sorted(p.name for p in saved.glob("rank-*.safetensors"))
    assert files == ["rank-00000.safetensors", "rank-00001.safetensors"]
    resumed, unbroken = results[0]["resumed"]["params"], results[0]["runs"][("adamw", True)].params
    assert results[0]["resumed"]["step"] == 4
    for name, value in unbroken.items():
        assert torch.equal(resumed[name], value), name
