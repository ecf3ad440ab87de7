"""The engine on one GPU against plain PyTorch, stages 1-3, its state on the device, in host memory and on NVMe.

Skipped without CUDA. The helpers it drives (tierzero.cli.bench.contenders) run on the CPU
in tests/unit/test_gpu_check.py. The reference is `torch.optim.AdamW(fused=True)` on the
same model, seed and batches, as the CPU parity tests hold the engine to plain training.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierzero.cli.bench.contenders import PLACEMENTS, Placement, placement_matrix, run_parity
from tierzero.common.slices import Tier

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = placement_matrix()
PARAM_TOLERANCE = 2e-3
"""Norm-relative, per tensor, as tests/distributed allows AdamW: the same fused kernel on gradients that
may differ in the last bits (cuBLAS picks its algorithm per buffer alignment; a step on the cpu tier
runs torch's CPU kernel, not the CUDA one)."""
LOSS_TOLERANCE = 1e-4


def _case_id(case: tuple[int, Placement]) -> str:
    stage, placement = case
    params, grads, optimizer = (tier.value for tier in placement.homes())
    return f"stage{stage}-params:{params}-grads:{grads}-optimizer:{optimizer}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(case) for case in CASES])
def test_engine_on_the_gpu_matches_plain_pytorch(case: tuple[int, Placement], tmp_path: Path) -> None:
    stage, placement = case
    result = run_parity(stage=stage, placement=placement, nvme_path=tmp_path, device="cuda", steps=4)
    assert result.max_loss_difference <= LOSS_TOLERANCE, (result.plain_losses, result.engine_losses)
    assert result.max_param_difference <= PARAM_TOLERANCE
    tiers = result.memory["tiers"]
    for tier in set(placement.homes()) - {Tier.DEVICE}:
        assert tiers[tier.value]["current"] > 0, f"nothing lives on {tier.value}: {tiers}"
    assert list(tmp_path.iterdir()) == []  # close() removed the swap files


@pytest.mark.parametrize("stage", [1, 3])
def test_autocast_on_the_gpu_matches_plain_autocast(stage: int, tmp_path: Path) -> None:
    """`precision.autocast` beside plain PyTorch under torch.autocast(bf16), its state on NVMe at stage 3."""
    placement = PLACEMENTS["params-optimizer-nvme" if stage == 3 else "device"]
    result = run_parity(stage=stage, placement=placement, nvme_path=tmp_path, device="cuda", steps=4, dtype="bf16")
    assert result.max_loss_difference <= LOSS_TOLERANCE, (result.plain_losses, result.engine_losses)
    assert result.max_param_difference <= PARAM_TOLERANCE
