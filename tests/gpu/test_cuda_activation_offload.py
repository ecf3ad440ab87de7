"""`activations.offload: cpu` on a GPU: the tensors autograd saves wait in pinned host memory and
come back for backward; the run trains as one that keeps them on the device, and the device's
peak (torch.cuda.max_memory_allocated) falls by the bytes parked.

Skipped without CUDA; TIERZERO_GPU_TESTS_ON_CPU=1 runs it on the host (tests/gpu/cuda_or_cpu.py),
where the device's allocator cannot be asked and the store's accounting alone is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_or_cpu import ON_CPU, needs_cuda
from test_cuda_parity import PARAM_TOLERANCE

import tierzero
from tierzero.models.builtin import GPT, ModelSpec

pytestmark = needs_cuda

SPEC = ModelSpec(vocab_size=256, n_layer=4, n_head=2, d_model=128, d_ff=512, max_seq_len=128)
BATCH, STEPS = 8, 3
"""Activations (about 20 MiB a block) well above the model's state (about 13 MiB with AdamW's)."""
LOSS_TOLERANCE = 1e-5
"""Relative: a tensor may come back with other strides, and the GPU's backward then pick another
kernel for it (other rounding); on the host the losses are the same bits."""


@dataclass(frozen=True, slots=True)
class Run:
    losses: list[float]
    state: dict[str, torch.Tensor]
    device_peak: int
    """The allocator's peak over the last step, above what was allocated before it (0 on the host)."""
    booked: dict[str, int]
    """The store's peak ACTIVATION bytes by tier in the last step."""


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(SPEC)


def _run(cuda: torch.device, stage: int, activations: dict[str, Any], swap: Path) -> Run:
    config: dict[str, Any] = {"zero": {"stage": stage}, "optimizer": {"type": "adamw", "lr": 1e-3}, "activations": activations}
    if stage == 3:
        config |= {"offload": {"params": "nvme", "optimizer": "nvme"}, "tiers": {"nvme": {"path": str(swap)}}}
    losses, peak = [], 0
    with tierzero.initialize(_model(), config) as engine:
        for step in range(STEPS):
            tokens = torch.randint(0, SPEC.vocab_size, (BATCH, SPEC.max_seq_len + 1), generator=torch.Generator().manual_seed(step))
            tokens = tokens.to(cuda)
            engine.store.reset_peaks()
            if cuda.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(cuda)
                before = torch.cuda.memory_allocated(cuda)
            _, loss = engine(tokens[:, :-1], tokens[:, 1:])
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            if cuda.type == "cuda":
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated(cuda) - before
        booked = dict(engine.memory_report()["activations"])
        state = engine.full_state_dict()
    assert state is not None
    return Run(losses=losses, state=state, device_peak=peak, booked=booked)


@pytest.mark.parametrize("stage", [1, 3], ids=["stage1-on-device", "stage3-params-optimizer-nvme"])
@pytest.mark.parametrize("checkpoint", [0, 1], ids=["kept", "checkpointed"])
def test_parked_activations_train_alike_and_lower_the_device_peak(cuda: torch.device, tmp_path: Path, stage: int, checkpoint: int) -> None:
    kept = _run(cuda, stage, {"checkpoint": checkpoint}, tmp_path)
    parked = _run(cuda, stage, {"checkpoint": checkpoint, "offload": "cpu"}, tmp_path)
    assert parked.losses[0] == kept.losses[0]  # the first forward reads nothing parked
    assert parked.losses == pytest.approx(kept.losses, rel=LOSS_TOLERANCE)
    worst = max(float((parked.state[n] - v).norm() / v.norm()) for n, v in kept.state.items())
    assert worst <= PARAM_TOLERANCE
    # The store books the parked tensors in the cpu tier and none on the device (it books the kept
    # ones only when it handles them, for checkpointing).
    assert parked.booked["device"] == 0 and parked.booked["cpu"] > 0 and kept.booked["cpu"] == 0
    if checkpoint:
        assert parked.booked["cpu"] == kept.booked["device"]
    if ON_CPU:
        return  # no device allocator to ask on the host
    # The device's peak falls by at least half of what was parked (the other half: a block's
    # tensors come back for its backward, and the allocator rounds).
    assert kept.device_peak - parked.device_peak >= parked.booked["cpu"] // 2, (kept.device_peak, parked.device_peak, parked.booked)
