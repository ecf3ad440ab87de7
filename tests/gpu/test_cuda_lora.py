"""LoRA on a GPU with the frozen base on NVMe: a saved Llama streamed from its files, peft's adapters
trained at stage 3 (parameters and optimizer states on NVMe, warm-up + cosine, clipping 1.0) against
peft's LoRA trained by plain PyTorch on the same GPU, as tests/unit/test_finetune_parity.py holds
them on the host.

Skipped without CUDA; TIERZERO_GPU_TESTS_ON_CPU=1 runs it on the host (tests/gpu/cuda_or_cpu.py).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from cuda_or_cpu import needs_cuda
from test_cuda_parity import PARAM_TOLERANCE

import tierzero
from tierzero.common.slices import Kind, Tier
from tierzero.pretrained import build_meta_model
from tierzero.pretrained.lora import apply_lora

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from test_finetune_parity import STEPS, _config, _torch_optimizer  # noqa: E402
from tiny_models import tiny_llama

pytestmark = needs_cuda
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj"]
FIRST_LOSS_TOLERANCE = 1e-6
"""The first forward: the base's bits and adapters that start alike, on the same GPU."""


def _saved(root: Path) -> Path:
    tiny_llama(vocab=96, layers=3, kv_heads=1).save_pretrained(root / "llama", max_shard_size="40KB")
    (root / "swap").mkdir()
    return root / "llama"


def _batches(device: torch.device) -> list[torch.Tensor]:
    return [torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(100 + k)).to(device) for k in range(STEPS)]


def _train_engine(engine: Any, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = []
    for x in _batches(device):
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    state = engine.full_state_dict()
    assert state is not None
    return losses, state


def _train_peft(model: torch.nn.Module, device: torch.device) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer, scheduler = _torch_optimizer(model)
    losses = []
    for x in _batches(device):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(float(loss.detach()))
    return losses, {n: p.detach().cpu() for n, p in model.named_parameters()}


def test_lora_with_the_base_on_nvme_trains_as_peft_on_the_gpu(cuda: torch.device, tmp_path: Path) -> None:
    saved = _saved(tmp_path)
    model = apply_lora(build_meta_model(saved), r=4, alpha=8, target_modules=TARGETS, seed=7)
    with tierzero.initialize(model, _config(tmp_path), pretrained=saved) as engine:
        start = engine.full_state_dict()
        assert start is not None
        frozen = [unit for unit in engine.units if not unit.trainable]
        assert frozen and all(engine.plan.spec(unit.name, Kind.PARAM).home is Tier.NVME for unit in frozen)
        assert all(not any(spec.kind is Kind.EXP_AVG for spec in engine.plan.of(unit)) for unit in frozen)
        losses, state = _train_engine(engine, cuda)
    base = transformers.LlamaForCausalLM.from_pretrained(saved)
    reference = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS)).to(cuda)
    with torch.no_grad():  # the engine's seeded adapters, as peft would have made them
        for name, p in reference.named_parameters():
            if p.requires_grad:
                p.copy_(start[name])
    ref_losses, ref_state = _train_peft(reference, cuda)
    assert abs(losses[0] - ref_losses[0]) <= FIRST_LOSS_TOLERANCE
    assert losses[-1] < losses[0]
    adapters = [name for name in ref_state if "lora_" in name]
    assert len(adapters) == 2 * len(TARGETS) * 3  # A and B of each target, in each of the three layers
    errors = {n: float((state[n] - ref_state[n]).norm() / ref_state[n].norm()) for n in adapters}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= PARAM_TOLERANCE, f"{worst}: {errors[worst]:.2e}"
    # The frozen base comes back from NVMe as it went in, bit for bit.
    assert [n for n in ref_state if "lora_" not in n and not torch.equal(state[n], start[n])] == []
    assert all(torch.equal(state[n], ref_state[n]) for n in ref_state if "lora_" not in n)
