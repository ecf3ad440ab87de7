"""The engine on a GPU: a materialised model reaches the device a unit at a time, never whole; a
placement that splits units between the GPU, host memory and NVMe trains as one that keeps them all
on the GPU.

Skipped without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import tierzero
from tierzero.comm import dist as D
from tierzero.common.slices import Tier
from tierzero.config import load_config
from tierzero.engine.engine import Engine
from tierzero.engine.micro_step import micro_step
from tierzero.models.builtin import GPT, ModelSpec, build_model
from tierzero.stages.plan import Homes

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_a_materialised_model_is_streamed_to_the_device_unit_by_unit() -> None:
    model = GPT(ModelSpec(n_layer=8, n_head=4, d_model=512, d_ff=2048, max_seq_len=64, vocab_size=256))
    whole = sum(p.numel() * 4 for p in model.parameters())
    block = sum(p.numel() * 4 for p in model.blocks[0].parameters())
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    engine = tierzero.initialize(
        model, {"zero": {"stage": 3}, "offload": {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}}
    )
    try:
        peak = torch.cuda.max_memory_allocated() - before
        # One unit's full fp32 buffer and its casts at a time, never the model.
        assert peak < whole / 2, (peak, whole, block)
        x = torch.randint(0, 256, (2, 64), device="cuda")
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)
    finally:
        engine.close()


def _trained(tmp_path: Path, homes: Homes) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, int]]]:
    """Three steps of a small GPT at stage 3 placed by `homes`; the weights after, and the bytes by home."""
    swap = tmp_path / "swap"
    swap.mkdir(parents=True, exist_ok=True)
    cfg = load_config({
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-3},
        "model": {"type": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "d_ff": 1024, "max_seq_len": 64},
        "train": {"micro_batch_size": 2, "seq_len": 64},
        "tiers": {"nvme": {"path": str(swap)}},
    })  # fmt: skip
    model = build_model(cfg.model, device="meta", seed=0)
    ctx = D.DistContext(rank=0, world_size=1, local_rank=0, device=torch.device("cuda"), created_group=False)
    batches = torch.randint(0, cfg.model.vocab_size, (3, 2, 2, 64), generator=torch.Generator().manual_seed(0))
    with Engine(model, cfg, ctx=ctx, homes=homes) as engine:
        for x, y in batches:
            micro_step(engine, x.cuda(), y.cuda(), is_hf=False)
        state = engine.full_state_dict()
        placed = engine.memory_report()["placement"]
    assert state is not None
    return state, placed


def test_units_split_between_the_gpu_host_memory_and_nvme_train_as_all_on_the_gpu(tmp_path: Path) -> None:
    """The planner's split placements on a GPU: blocks 0 and 2 wholly on the device (their optimizer
    states step there), block 1's in host memory, the rest on NVMe, in one step pipeline."""
    device = Homes(params=Tier.DEVICE, grads=Tier.DEVICE, optimizer=Tier.DEVICE)
    fields = ("params", "grads", "optimizer")
    units = {(f"blocks.{i}", what): Tier.DEVICE for i in (0, 2) for what in fields}
    units |= {("blocks.1", what): Tier.CPU for what in fields}
    split = Homes(params=Tier.NVME, grads=Tier.NVME, optimizer=Tier.NVME, units=units)
    whole, _ = _trained(tmp_path / "whole", device)
    mixed, placed = _trained(tmp_path / "split", split)
    assert all(placed[tier] for tier in ("device", "cpu", "nvme")), placed
    for name, value in whole.items():
        # A unit stepped on the host runs torch's CPU AdamW kernel, one on the device the CUDA one.
        relative = float((mixed[name] - value).norm() / value.norm())
        assert relative <= 2e-3, (name, relative)
