"""LoRA on an NF4 base at two gloo ranks, stages 1 to 3, against peft in plain PyTorch on the dequantized base.

Each rank quantizes and keeps only its own piece of each frozen unit (stage 3) or all the pieces
(stages 1, 2); a gather moves the codes and dequantizes after. The reference is peft's LoRA on the
same model whose base weights are the dequantized NF4 values, trained by torch's SGD on the whole
global batch; every weight is a whole number of 64-element blocks, so the rank pieces' blocks are
the weights' own and the base is the same bits at any world size.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from harness import rel_error, run_ranks

import tierzero
from tierzero.units.blockwise import nf4_nbytes

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "unit"))
from test_qlora import _batch, _pair, _train_reference  # noqa: E402

pytest.importorskip("peft")

STEPS = 3
CASES = [(1, "device"), (2, "device"), (3, "cpu"), (3, "nvme")]


def _rank_job(rank: int, world_size: int, swap_dir: str) -> list[Any]:
    results = []
    for stage, params in CASES:
        config = {
            "zero": {"stage": stage},
            "optimizer": {"type": "sgd", "lr": 0.1},
            "precision": {"param_dtype": "fp32"},
            "model": {"lora": {"r": 4, "alpha": 8, "base_dtype": "nf4"}},
            "offload": {"params": params},
            "tiers": {"nvme": {"path": swap_dir}},
        }
        x = _batch()[rank : rank + 1]  # this rank's half of the global batch
        with tierzero.initialize(_pair()[0], config) as engine:
            losses = []
            for _ in range(STEPS):
                loss = engine(input_ids=x, labels=x).loss
                losses.append(loss.item())
                engine.backward(loss)
                engine.step()
            frozen = [u for u in engine.units if not u.trainable]
            pieces = 1 if stage == 3 else world_size
            base = sum(pieces * nf4_nbytes(u.shard_numel) for u in frozen)
            adapters = sum(4 * (u.shard_numel if stage == 3 else u.padded_numel) for u in engine.units if u.trainable)
            stored = engine.memory_report()["placement"][params]["param"]
            results.append({"losses": losses, "params": engine.full_state_dict(), "stored": stored, "expected": base + adapters})
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[list[Any]]:
    return run_ranks(_rank_job, world_size=2, payload=str(tmp_path_factory.mktemp("swap")))


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    return _train_reference(_pair()[1], steps=STEPS)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"stage{s}-{p}" for s, p in CASES])
def test_lora_on_an_nf4_base_at_two_ranks_trains_as_peft_on_the_dequantized_base(
    runs: list[list[Any]], reference: tuple[list[float], dict[str, torch.Tensor]], index: int
) -> None:
    ref_losses, ref_params = reference
    zero, one = runs[0][index], runs[1][index]
    # each rank's bytes: its pieces of the base (codes + fp32 absmax) and its adapters, exactly
    assert zero["stored"] == zero["expected"] and one["stored"] == one["expected"]
    first = (zero["losses"][0] + one["losses"][0]) / 2
    assert abs(first - ref_losses[0]) <= 1e-6
    params = zero["params"]
    for name, expected in ref_params.items():
        if "lora_" in name:
            assert rel_error(params[name], expected) <= 1e-5, name
        else:
            assert torch.equal(params[name], expected), name  # the dequantized base, bit for bit
