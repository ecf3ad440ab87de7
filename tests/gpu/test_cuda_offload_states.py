"""`engine.offload_states()` / `reload_states()` on a GPU: the device's allocator gives back the bytes of
the slices moved to host memory (torch.cuda.memory_allocated), takes them again on reload, and
training goes on with the bits of an engine that never offloaded ([Note: offloaded states] in
tierzero/engine/states.py).

Skipped without CUDA; TIERZERO_GPU_TESTS_ON_CPU=1 runs it on the host (tests/gpu/cuda_or_cpu.py),
where the store's accounting stands in for the allocator's.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_or_cpu import needs_cuda

import tierzero
from tierzero.common.slices import Tier
from tierzero.store.ledger import Use

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_no_grad_read_ahead import wide_gpt  # noqa: E402
from test_offload_states import AFTER, BEFORE, SPEC, _config, _home_bytes  # noqa: E402

pytestmark = needs_cuda

ALLOCATOR_ROUNDING = 512
"""The CUDA caching allocator rounds each block up to a multiple of 512 bytes."""
# (stage, param dtype, offload): everything on the device at stages 1 and 3, or the grads alone there.
CASES = [(1, "fp32", {}), (3, "bf16", {}), (3, "fp32", {"params": "nvme", "optimizer": "nvme"})]


def _train(engine: Any, steps: range, device: torch.device) -> list[torch.Tensor]:
    losses = []
    for step in steps:
        ids = torch.randint(0, SPEC.vocab_size, (4, 12), generator=torch.Generator().manual_seed(step)).to(device)
        _, loss = engine(ids, ids.roll(-1, 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().cpu())
    return losses


def _allocated(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device)


def _rounded(engine: Any) -> int:
    """The device-homed slices' bytes as the allocator holds them."""
    sizes = [spec.nbytes for spec in engine.plan.all() if spec.home is Tier.DEVICE]
    return sum(-(-n // ALLOCATOR_ROUNDING) * ALLOCATOR_ROUNDING for n in sizes)


@pytest.mark.parametrize(("stage", "dtype", "offload"), CASES, ids=[f"stage{s}-{d}-{'-'.join(o.values()) or 'device'}" for s, d, o in CASES])
def test_the_gpu_gives_back_the_slices_bytes_and_training_goes_on_with_the_same_bits(
    cuda: torch.device, tmp_path: Path, stage: int, dtype: str, offload: dict[str, str]
) -> None:
    config = _config(stage, tmp_path, precision={"param_dtype": dtype}, offload=offload)
    with tierzero.initialize(wide_gpt(SPEC), copy.deepcopy(config)) as engine:
        expected_losses = _train(engine, range(BEFORE + AFTER), cuda)
        expected = engine.full_state_dict()
    with tierzero.initialize(wide_gpt(SPEC), config) as engine:
        losses = _train(engine, range(BEFORE), cuda)
        on_device = _home_bytes(engine, Tier.DEVICE)
        assert on_device > 0
        before = _allocated(cuda)
        engine.offload_states()
        device, cpu = engine.store.report().tiers[Tier.DEVICE], engine.store.report().tiers[Tier.CPU]
        assert device.current == 0 and cpu.current_by_use[Use.HOME] == on_device
        freed = before - _allocated(cuda)
        engine.reload_states()
        taken = _allocated(cuda) - (before - freed)
        assert engine.store.report().tiers[Tier.DEVICE].current == on_device
        if cuda.type == "cuda":  # the host has no device allocator to ask
            # The slices' bytes, and no more than the allocator's rounding of them (and what stage 3
            # had read ahead for the next forward, given back too).
            slack = _rounded(engine) - on_device + (1 << 20)
            assert on_device <= freed <= on_device + slack, (freed, on_device)
            assert on_device <= taken <= on_device + slack, (taken, on_device)
        losses += _train(engine, range(BEFORE, BEFORE + AFTER), cuda)
        state = engine.full_state_dict()
    assert state is not None and expected is not None
    assert [name for name in expected if not torch.equal(state[name], expected[name])] == []
    assert all(torch.equal(a, b) for a, b in zip(losses, expected_losses, strict=True))
