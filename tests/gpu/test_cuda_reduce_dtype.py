"""bf16 with `precision.reduce_dtype: fp32` on a GPU: bf16 gradients accumulated over micro-batches in
fp32 GRAD slices, as plain PyTorch under torch.autocast(bf16) accumulates its fp32 parameters'
gradients, against plain PyTorch on the same GPU; the same run reduced in bf16 rounds its sums.

Skipped without CUDA; TIERZERO_GPU_TESTS_ON_CPU=1 runs it on the host (tests/gpu/cuda_or_cpu.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_or_cpu import needs_cuda
from test_cuda_parity import PARAM_TOLERANCE

from tierzero.cli.bench.contenders import LR, PARITY_WEIGHT_DECAY, PLACEMENTS, EngineTraining, engine_config, gpt, token_batch
from tierzero.common.slices import Kind

pytestmark = needs_cuda

STEPS, ACCUMULATION = 4, 2
CASES = [(2, "cpu"), (3, "params-optimizer-nvme")]
"""Stage 2 with gradients and optimizer states in host memory; stage 3 with parameters and optimizer on NVMe."""


def _config(stage: int, placement: str, swap: Path, reduce_dtype: str | None) -> dict[str, Any]:
    cfg = engine_config(
        stage=stage, placement=PLACEMENTS[placement], nvme_path=swap, dtype="bf16", autocast=True, weight_decay=PARITY_WEIGHT_DECAY
    )
    cfg["precision"]["reduce_dtype"] = reduce_dtype
    return cfg | {"gradient_accumulation_steps": ACCUMULATION}


def _micro_batches(step: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens, targets = token_batch(step, batch=2 * ACCUMULATION, seq=32, device=device)
    return list(zip(tokens.chunk(ACCUMULATION), targets.chunk(ACCUMULATION), strict=True))


def _plain(device: torch.device) -> dict[str, torch.Tensor]:
    """fp32 parameters and fused AdamW, each micro-batch's loss under autocast(bf16), gradients summed in fp32."""
    model = gpt("tiny").to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=PARITY_WEIGHT_DECAY, fused=True)
    for step in range(STEPS):
        for tokens, targets in _micro_batches(step, device):
            with torch.autocast(device.type, dtype=torch.bfloat16):
                _, loss = model(tokens, targets)
            (loss / ACCUMULATION).backward()  # halving is exact: the engine scales the sum at the step
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {name: p.detach().cpu() for name, p in model.named_parameters()}


def _engine(config: dict[str, Any], device: torch.device) -> tuple[dict[str, torch.Tensor], dict[Kind, set[torch.dtype]]]:
    run = EngineTraining("tiny", config)
    try:
        for step in range(STEPS):
            for tokens, targets in _micro_batches(step, device):
                run.step(tokens, targets)
        dtypes: dict[Kind, set[torch.dtype]] = {}
        for spec in run.engine.plan.all():
            dtypes.setdefault(spec.kind, set()).add(spec.dtype)
        state = run.engine.full_state_dict()
    finally:
        run.close()
    assert state is not None
    return state, dtypes


def _worst(state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    return max(float((state[name] - p).norm() / p.norm()) for name, p in reference.items())


@pytest.mark.parametrize(("stage", "placement"), CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_bf16_gradients_accumulate_in_fp32_as_plain_autocast(cuda: torch.device, tmp_path: Path, stage: int, placement: str) -> None:
    reference = _plain(cuda)
    fp32, dtypes = _engine(_config(stage, placement, tmp_path, "fp32"), cuda)
    bf16, bf16_dtypes = _engine(_config(stage, placement, tmp_path, None), cuda)
    # The linear layers compute in bf16; their gradients are kept in fp32, or in bf16 without reduce_dtype.
    assert torch.bfloat16 in dtypes[Kind.PARAM] and dtypes[Kind.GRAD] == {torch.float32}
    assert bf16_dtypes[Kind.GRAD] == {torch.bfloat16, torch.float32}  # the fp32 units' (embeddings, norms) stay fp32
    exact = _worst(fp32, reference)
    assert exact <= PARAM_TOLERANCE
    # Sums rounded to bf16 land farther from plain autocast than fp32 sums.
    assert _worst(bf16, reference) > exact
