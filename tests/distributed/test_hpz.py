"""ZeRO++ hpZ (zero.hpz_partition_size) on 4 gloo ranks laid out as 2 nodes x 2.

Each forward gather over all 4 ranks leaves a secondary copy of the unit split over the
node's 2 ranks, and backward gathers from it inside the node ([Note: hpZ's secondary copy]
in tierzero/stages/stage3.py). The gathered bytes are the same, so the run is bitwise equal
to plain stage 3 at the same world size and data: SGD and AdamW with clipping (the
gradients, their sums and norm travel as in plain stage 3), SGD without (each unit steps
during backward, after its last gather), and GPT-2 with activation
checkpointing, whose recomputation gathers from the secondary copy too; and AdamW with every
kind, the secondary copy included, on NVMe.

Bytes of one step, Φ the padded parameter count and B = 4Φ (fp32), for every rank:
the world group sends the forward all-gather (B/4 to the node's other rank, 2 x B/4 across)
and the reduce-scatter (the same), plus the norm's all-reduce of 4 bytes (2 inside, 4 across);
the hpz group sends the backward all-gather, B/2, all inside the node. No backward
all-gather byte crosses nodes: B + 4 bytes across nodes against plain stage 3's 1.5 B + 4.
Memory: plain stage 3's 16Φ/4 bytes a rank, plus the secondary copy's 4Φ/2.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness import Case, run_ranks, train_case

HPZ = (("hpz_partition_size", 2),)
CASES = {
    (name, hpz): Case(stage=3, optimizer=o, steps=4, zero=HPZ if hpz else (), **extra)
    for name, o, extra in [
        ("sgd", "sgd", {}),
        ("adamw", "adamw", {}),
        ("sgd-step-in-backward", "sgd", {"clip": 0.0}),  # no clipping: each unit steps during backward
        ("gpt2-checkpointing", "sgd", {"model_name": "gpt2", "checkpointing": "non_reentrant"}),
    ]
    for hpz in (False, True)
}


def _traffic(rank: int, world_size: int) -> dict[str, Any]:
    import tierzero

    case = Case(stage=3, optimizer="adamw", accumulation=1, global_batch=4, steps=2, zero=HPZ)
    with tierzero.initialize(case.model(), case.config()) as engine:
        for step in range(2):
            engine.reset_comm_report()
            engine.backward(case.loss(engine, *case.micro_batch(step, micro=0, rank=rank, world_size=world_size)))
            engine.step()
        phi = sum(u.padded_numel for u in engine.units)
        return {"phi": phi, "groups": engine.comm_report(per_group=True), "kinds": engine.memory_report()["kinds"]}


def _job(rank: int, world_size: int, swap_dir: str) -> dict[str, Any]:
    import tierzero

    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "2", str(rank % 2)
    runs = {key: train_case(case, rank=rank, world_size=world_size) for key, case in CASES.items()}

    def on_nvme(model: torch.nn.Module, config: dict[str, Any]) -> Any:
        tiers = {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"}
        return tierzero.initialize(model, config | {"offload": tiers, "tiers": {"nvme": {"path": swap_dir}}})

    nvme = train_case(CASES[("adamw", True)], rank=rank, world_size=world_size, make_engine=on_nvme)
    return {"runs": runs, "nvme": nvme, "traffic": _traffic(rank, world_size)}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    pytest.importorskip("transformers")
    return run_ranks(_job, world_size=4, payload=str(tmp_path_factory.mktemp("hpz_swap")))


@pytest.mark.parametrize("name", ["sgd", "adamw", "sgd-step-in-backward", "gpt2-checkpointing"])
def test_hpz_equals_plain_stage3_bit_for_bit(results: list[dict[str, Any]], name: str) -> None:
    plain, hpz = results[0]["runs"][(name, False)], results[0]["runs"][(name, True)]
    assert plain.params is not None and hpz.params is not None and hpz.params.keys() == plain.params.keys()
    for key, value in plain.params.items():
        assert torch.equal(hpz.params[key], value), key
    assert hpz.losses == plain.losses and hpz.steps_taken == plain.steps_taken == 4
    model = CASES[(name, False)].model()
    moved = [k for k, v in model.state_dict().items() if k in plain.params and not torch.equal(v, plain.params[k])]
    assert moved  # trained: the equality is not of two untouched models


def test_no_backward_all_gather_byte_crosses_nodes(results: list[dict[str, Any]]) -> None:
    for rank in results:
        traffic = rank["traffic"]
        quarter = 4 * traffic["phi"] // 4
        assert traffic["groups"] == {
            "world": {
                "all_gather": {"intra": quarter, "inter": 2 * quarter},
                "reduce_scatter": {"intra": quarter, "inter": 2 * quarter},
                "all_reduce": {"intra": 2, "inter": 4},
            },
            "hpz": {
                "all_gather": {"intra": 2 * quarter, "inter": 0},
                "reduce_scatter": {"intra": 0, "inter": 0},
                "all_reduce": {"intra": 0, "inter": 0},
            },
        }


def test_the_secondary_copy_is_counted_in_the_memory_report(results: list[dict[str, Any]]) -> None:
    for rank in results:
        phi, kinds = rank["traffic"]["phi"], rank["traffic"]["kinds"]
        assert kinds == {
            "param": phi, "grad": phi, "master": 0, "exp_avg": phi, "exp_avg_sq": phi, "param_secondary": 2 * phi,
        }  # fmt: skip
        plain = rank["runs"][("adamw", False)].memory["kinds"]
        assert "param_secondary" not in plain


def test_a_secondary_copy_on_nvme_gives_the_same_bits(results: list[dict[str, Any]]) -> None:
    """Every kind on NVMe, the secondary copy too (written by forward, read back by backward)."""
    plain, nvme = results[0]["runs"][("adamw", False)], results[0]["nvme"]
    assert plain.params is not None and nvme.params is not None
    for key, value in plain.params.items():
        assert torch.equal(nvme.params[key], value), key
    for rank in results:
        nvme_kinds = rank["nvme"].memory["kinds"]
        assert nvme_kinds["param_secondary"] == 2 * nvme_kinds["param"] > 0
        assert rank["nvme"].memory["tiers"]["nvme"]["current"] >= sum(nvme_kinds.values())
