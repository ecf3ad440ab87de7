"""Fine-tuning a saved Llama as people run it, against plain PyTorch: stage 3 with parameters and
optimizer states on NVMe, warm-up + cosine, no-decay groups, gradient clipping 1.0; and the same
as LoRA against peft. Per-tensor norm-relative difference <= 2e-3 after 8 steps, first loss
within 1e-6."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tiny_models import tiny_llama
from torch import nn

import tierzero
from tierzero.pretrained import build_meta_model
from tierzero.pretrained.lora import apply_lora

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

STEPS, LR, DECAY, WARMUP = 8, 3e-3, 0.1, 3


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    tiny_llama(vocab=96, layers=3, kv_heads=1).save_pretrained(tmp_path / "llama", max_shard_size="40KB")
    (tmp_path / "swap").mkdir()
    return tmp_path


def _config(root: Path) -> dict[str, Any]:
    return {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": LR, "weight_decay": DECAY},
        "scheduler": {"type": "cosine", "warmup_steps": WARMUP, "total_steps": STEPS},
        "gradient_clipping": 1.0,
        "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
        "tiers": {"nvme": {"path": str(root / "swap")}},
    }


def _torch_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW with the Trainer's groups (no decay on biases and norm weights) and its cosine schedule."""
    norms = {id(p) for m in model.modules() if "Norm" in type(m).__name__ for p in m.parameters()}
    decay, exempt = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (exempt if name.endswith("bias") or id(p) in norms else decay).append(p)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": DECAY}, {"params": exempt, "weight_decay": 0.0}], lr=LR)
    return optimizer, transformers.get_cosine_schedule_with_warmup(optimizer, WARMUP, STEPS)


def _batches() -> list[torch.Tensor]:
    return [torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(100 + k)) for k in range(STEPS)]


def _train_reference(model: nn.Module) -> tuple[list[float], dict[str, torch.Tensor]]:
    optimizer, scheduler = _torch_optimizer(model)
    losses = []
    for x in _batches():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def _train_engine(engine: Any) -> tuple[list[float], dict[str, torch.Tensor]]:
    losses = []
    for x in _batches():
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def _compare(run: tuple[list[float], dict[str, torch.Tensor]], ref: tuple[list[float], dict[str, torch.Tensor]]) -> None:
    (losses, state), (ref_losses, ref_params) = run, ref
    assert abs(losses[0] - ref_losses[0]) <= 1e-6
    errors = {n: float((state[n] - p).norm() / p.norm()) for n, p in ref_params.items() if p.norm() > 0}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= 2e-3, f"{worst}: {errors[worst]:.2e}"
    assert losses[-1] < losses[0]


def test_full_fine_tuning_from_files_matches_plain_pytorch(saved: Path) -> None:
    reference = transformers.LlamaForCausalLM.from_pretrained(saved / "llama")
    ref = _train_reference(reference)
    with tierzero.initialize(build_meta_model(saved / "llama"), _config(saved), pretrained=saved / "llama") as engine:
        _compare(_train_engine(engine), ref)


def test_lora_fine_tuning_from_files_matches_peft(saved: Path) -> None:
    model = apply_lora(build_meta_model(saved / "llama"), r=4, alpha=8, target_modules=["q_proj", "v_proj"], seed=7)
    with tierzero.initialize(model, _config(saved), pretrained=saved / "llama") as engine:
        start = engine.full_state_dict()
        run = _train_engine(engine)
    base = transformers.LlamaForCausalLM.from_pretrained(saved / "llama")
    reference = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # the same starting adapters as the engine's seeded init
        for name, p in reference.named_parameters():
            if p.requires_grad:
                p.copy_(start[name])
    _compare(run, _train_reference(reference))
