"""ZeRO++ at a zero.quantization_block_size other than 2048, on 2 gloo ranks laid out as 2 nodes of 1.

Training with a scale per 512 elements stays within the tolerances tests/distributed/test_qwz.py
and test_qgz.py hold at 2048. (At 8192, a bias sharing its block with far larger weights ends
1.6e-3 from plain stage 3 after 4 SGD steps of qwZ, past test_qwz.py's 1e-3; at 512, 7.6e-4.)

A block of 8192 elements is four times the 2048 the I/O alignment pads each shard to, so
every unit pads further, to 2 x 8192 elements, and each rank's shard is whole blocks
([Note: qwZ] in tierzero/comm/quantized.py). The one peer is on the other node, so every byte
a gather or the gradients' hop sends crosses: per step, 2 (s + 4 s / 8192) for the two
quantised gathers of a shard of s elements (qwZ), and s + 4 s / 8192 for the gradients' one
partial sum (qgZ int8), against plain stage 3's 3 x 4 s.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from harness import Case, measure_comm, rel_error, run_ranks, train_case

SMALL, LARGE = (("quantization_block_size", 512),), (("quantization_block_size", 8192),)
TRAIN = {
    "plain": Case(stage=3, optimizer="sgd", steps=4),
    "qwz": Case(stage=3, optimizer="sgd", steps=4, zero=(("quantized_weights", True), *SMALL)),
    "qgz": Case(stage=3, optimizer="adamw", steps=4, zero=(("quantized_gradients", "int8"), *SMALL)),
    "plain adamw": Case(stage=3, optimizer="adamw", steps=4),
}
BOTH = Case(
    stage=3, optimizer="adamw", accumulation=1, global_batch=4, steps=2, clip=0.0,
    zero=(("quantized_weights", True), ("quantized_gradients", "int8"), *LARGE),
)  # fmt: skip


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    os.environ["LOCAL_WORLD_SIZE"], os.environ["LOCAL_RANK"] = "1", "0"
    return {
        "train": {name: train_case(case, rank=rank, world_size=world_size) for name, case in TRAIN.items()},
        "measure": measure_comm(BOTH, rank=rank, world_size=world_size),
    }


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    return run_ranks(_job, world_size=2)


def test_qwz_at_512_trains_within_the_tolerance_at_2048(results: list[dict[str, Any]]) -> None:
    """test_qwz.py's: losses within 1%, parameters within 1e-3 but the LayerNorm biases, all within 5e-2."""
    plain, qwz = results[0]["train"]["plain"], results[0]["train"]["qwz"]
    assert qwz.losses != plain.losses
    assert max(abs(a - b) / b for a, b in zip(qwz.losses, plain.losses)) < 1e-2
    errors = {name: rel_error(qwz.params[name], value) for name, value in plain.params.items()}
    assert max(e for name, e in errors.items() if not name.endswith("norm.bias")) < 1e-3, errors
    assert max(errors.values()) < 5e-2, errors


def test_qgz_at_512_trains_within_the_tolerance_at_2048(results: list[dict[str, Any]]) -> None:
    """test_qgz.py's for int8: losses within 1e-3, all parameters together within 5e-3."""
    plain, qgz = results[0]["train"]["plain adamw"], results[0]["train"]["qgz"]
    assert qgz.losses != plain.losses
    assert max(abs(a - b) / b for a, b in zip(qgz.losses, plain.losses)) < 1e-3
    together = [torch.cat([params[name].flatten() for name in plain.params]) for params in (qgz.params, plain.params)]
    assert rel_error(*together) < 5e-3


def test_every_byte_crosses_as_the_formula_at_8192_says(results: list[dict[str, Any]]) -> None:
    for rank in results:
        shards, groups = rank["measure"]["shards"], rank["measure"]["groups"]
        assert all(s % 8192 == 0 for s in shards)
        q = sum(s + 4 * s // 8192 for s in shards)  # int8 and a scale per block, a shard of every unit
        assert groups["world"]["all_gather"] == {"intra": 0, "inter": 2 * q}
        assert groups["inter"]["reduce_scatter"] == {"intra": 0, "inter": q}
        inter = sum(v["inter"] for group in groups.values() for v in group.values())
        assert inter == 3 * q  # no clipping: no norm to sum
