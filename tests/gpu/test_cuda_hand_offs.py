"""The step's host-device hand-offs on a GPU, against plain PyTorch on the same GPU: the gradients
computed on the device land in host memory (their GRAD slices homed on the cpu tier) with plain's
values, the optimizer steps there, and the new parameters come back up to the device as the
masters' bits, step after step.

Skipped without CUDA; TIERZERO_GPU_TESTS_ON_CPU=1 runs it on the host (tests/gpu/cuda_or_cpu.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_or_cpu import needs_cuda
from test_cuda_parity import LOSS_TOLERANCE, PARAM_TOLERANCE
from torch import nn

import tierzero
from tierzero.cli.bench.contenders import LR, PARITY_WEIGHT_DECAY, gpt, token_batch
from tierzero.common.slices import Kind, Tier

pytestmark = needs_cuda

STEPS, ACCUMULATION, CLIP = 3, 2, 1.0
GRAD_TOLERANCE = 1e-5
"""Norm-relative, per parameter: the same model's backward on the same GPU, its kernels picked per
buffer (cuBLAS may choose another algorithm for another alignment)."""
# (stage, offload): gradients and optimizer states homed in host memory, parameters on the device,
# in host memory, or on NVMe.
PLACEMENTS = [
    (2, {"gradients": "cpu", "optimizer": "cpu"}),
    (3, {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}),
    (3, {"params": "nvme", "gradients": "cpu", "optimizer": "cpu"}),
]


def _config(stage: int, offload: dict[str, str], swap: Path) -> dict[str, Any]:
    optimizer = {"type": "adamw", "lr": LR, "weight_decay": PARITY_WEIGHT_DECAY, "no_decay": [], "no_decay_modules": []}
    return {
        "zero": {"stage": stage},
        "optimizer": optimizer,
        "gradient_clipping": CLIP,
        "gradient_accumulation_steps": ACCUMULATION,
        "offload": offload,
        "tiers": {"nvme": {"path": str(swap)}},
    }


def _micro_batches(step: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tokens, targets = token_batch(step, batch=2 * ACCUMULATION, seq=32, device=device)
    return list(zip(tokens.chunk(ACCUMULATION), targets.chunk(ACCUMULATION), strict=True))


def _landed_grads(engine: Any) -> dict[str, torch.Tensor]:
    """Each parameter's gradient as its unit's GRAD slice holds it (one rank: the slice is the whole unit)."""
    out = {}
    for unit in engine.units:
        with engine.stage.slice(unit, Kind.GRAD, write=False) as flat:
            for slot in unit.slots:
                for binding in slot.bindings:
                    out[binding.name] = slot.view(flat).to("cpu", copy=True)
    return out


def _bound_params(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """Record, as each leaf module runs, the weight and bias it computes with (the engine binds them per forward)."""
    seen: dict[str, torch.Tensor] = {}
    handles = []
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):

            def record(module: nn.Module, _: Any, prefix: str = name) -> None:
                for attr in ("weight", "bias"):
                    value = getattr(module, attr, None)
                    if isinstance(value, torch.Tensor):
                        seen[f"{prefix}.{attr}"] = value.detach().to("cpu", copy=True)
                        seen[f"{prefix}.{attr}@device"] = torch.tensor(value.device.type == "cuda")

            handles.append(module.register_forward_pre_hook(record))
    return seen, handles


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize(("stage", "offload"), PLACEMENTS, ids=[f"stage{s}-{'-'.join(f'{k}:{v}' for k, v in o.items())}" for s, o in PLACEMENTS])
def test_gradients_land_in_host_memory_step_there_and_come_back_as_plain_pytorchs(
    cuda: torch.device, tmp_path: Path, stage: int, offload: dict[str, str]
) -> None:
    plain = gpt("tiny").to(cuda)
    opt = torch.optim.AdamW(plain.parameters(), lr=LR, weight_decay=PARITY_WEIGHT_DECAY, fused=True)
    engine = tierzero.initialize(gpt("tiny"), _config(stage, offload, tmp_path))
    try:
        for step in range(STEPS):
            plain_losses, engine_losses = [], []
            for micro, (tokens, targets) in enumerate(_micro_batches(step, cuda)):
                _, loss = plain(tokens, targets)
                (loss / ACCUMULATION).backward()  # halving is exact: the engine scales the sum at the step
                plain_losses.append(float(loss.detach()))
                _, loss = engine(tokens, targets)
                engine.backward(loss)
                engine.step()
                engine_losses.append(float(loss.detach()))
                if micro == 0:
                    # Between micro-steps the first micro-batch's gradients sit at their home, in host memory.
                    grads = _landed_grads(engine)
                    assert all(g.device.type == "cpu" for g in grads.values())
                    held = engine.store.report().tiers[Tier.CPU].current_by_kind.get(Kind.GRAD, 0)
                    assert held >= sum(spec.nbytes for spec in engine.plan.all() if spec.kind is Kind.GRAD) > 0
                    for name, p in plain.named_parameters():
                        expected = p.grad.detach().cpu() * ACCUMULATION
                        assert _relative(grads[name], expected) <= GRAD_TOLERANCE, name
            norm = float(torch.nn.utils.clip_grad_norm_(plain.parameters(), CLIP))
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert max(abs(a - b) for a, b in zip(plain_losses, engine_losses, strict=True)) <= LOSS_TOLERANCE
            assert engine.grad_norm == pytest.approx(norm, rel=GRAD_TOLERANCE)  # the norm of the landed gradients
        masters = engine.full_state_dict()
        assert masters is not None
        worst = max(_relative(masters[name], p.detach().cpu()) for name, p in plain.named_parameters())
        assert worst <= PARAM_TOLERANCE
        # The next forward computes on the device with the stepped values the host sent up, bit for bit.
        seen, handles = _bound_params(engine.module)
        with torch.no_grad():
            engine(*_micro_batches(STEPS, cuda)[0])
        for handle in handles:
            handle.remove()
        names = [name for name in seen if not name.endswith("@device")]
        assert sorted(names) == sorted(masters)
        assert all(bool(seen[f"{name}@device"]) == (cuda.type == "cuda") for name in names)
        assert [name for name in names if not torch.equal(seen[name], masters[name])] == []
    finally:
        engine.close()
