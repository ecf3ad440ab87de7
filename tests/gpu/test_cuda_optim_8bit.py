"""`optimizer.state_dtype: int8` on a GPU: Adam's moments stored as 8-bit block-wise codes with an fp32
absmax per block of 2048 ([Note: compact moments] in tierzero/optim/moments.py), 2.004 bytes a
parameter for both, and the losses of 20 steps within 1% of fp32 moments'.

Skipped without CUDA; TIERZERO_GPU_TESTS_ON_CPU=1 runs it on the host (tests/gpu/cuda_or_cpu.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_or_cpu import needs_cuda

import tierzero
from tierzero.cli.bench.contenders import gpt, token_batch
from tierzero.common.slices import Kind, SliceKey, Tier

pytestmark = needs_cuda

STEPS = 20
BYTES_PER_PARAMETER = 2 * (1 + 4 / 2048)
"""Both moments: a byte a parameter each, and an fp32 absmax per 2048 (every shard is whole blocks)."""
LOSS_TOLERANCE = 0.01
CASES = [(2, "fp32", {}), (3, "bf16", {"params": "nvme", "optimizer": "cpu"})]
"""Stepped on the device, and in host memory with the parameters on NVMe."""


def _config(stage: int, dtype: str, offload: dict[str, str], swap: Path, state_dtype: str) -> dict[str, Any]:
    return {
        "zero": {"stage": stage},
        "precision": {"param_dtype": dtype},
        "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.01, "state_dtype": state_dtype},
        "gradient_clipping": 1.0,
        "offload": offload,
        "tiers": {"nvme": {"path": str(swap)}},
    }


def _losses(engine: Any, device: torch.device) -> list[float]:
    losses = []
    for step in range(STEPS):
        tokens, targets = token_batch(step, batch=4, seq=32, device=device)
        _, loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.parametrize(("stage", "dtype", "offload"), CASES, ids=[f"stage{s}-{d}-{'-'.join(o.values()) or 'device'}" for s, d, o in CASES])
def test_int8_moments_take_2_004_bytes_a_parameter_and_train_as_fp32_moments(
    cuda: torch.device, tmp_path: Path, stage: int, dtype: str, offload: dict[str, str]
) -> None:
    with tierzero.initialize(gpt("tiny"), _config(stage, dtype, offload, tmp_path, "fp32")) as engine:
        reference = _losses(engine, cuda)
    with tierzero.initialize(gpt("tiny"), _config(stage, dtype, offload, tmp_path, "int8")) as engine:
        losses = _losses(engine, cuda)
        parameters = sum(unit.shard_numel for unit in engine.units)
        kinds = engine.memory_report()["kinds"]
        assert (kinds["exp_avg"] + kinds["exp_avg_sq"]) / parameters == BYTES_PER_PARAMETER
        home = Tier.CPU if offload.get("optimizer") == "cpu" else Tier.DEVICE
        held = engine.store.report().tiers[home].current_by_kind
        assert held[Kind.EXP_AVG] == kinds["exp_avg"] and held[Kind.EXP_AVG_SQ] == kinds["exp_avg_sq"]
        # The codes come up to the device as bytes.
        key = SliceKey(engine.units[0].name, Kind.EXP_AVG)
        codes = engine.store.fetch(key, to=Tier.DEVICE).wait()
        assert codes.dtype == torch.uint8 and codes.device.type == cuda.type and bool(codes.any())
        engine.store.release(key)
    gaps = [abs(a - b) / b for a, b in zip(losses, reference, strict=True)]
    assert max(gaps) <= LOSS_TOLERANCE, gaps
    assert losses[-1] < losses[0]
