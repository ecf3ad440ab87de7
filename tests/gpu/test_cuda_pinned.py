"""Pinned host memory on a real GPU ([Note: pinned registrations] in offload/pinned.py): thousands of
pinned slices allocated, freed and allocated again, and two engines in one process, one after the
other and side by side, with the freed heap kept (`tiers.cpu.keep_freed`), never hit cudaError 712.

Skipped without CUDA.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

import tierzero
from tierzero.config import load_config
from tierzero.models.builtin import build_model
from tierzero.offload.cpu import CpuTier
from tierzero.offload.pinned import pinned_registry

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CONFIG = {
    "zero": {"stage": 3},
    "optimizer": {"type": "adamw", "lr": 1e-3},
    "model": {"type": "gpt", "n_layer": 4, "n_head": 4, "d_model": 256, "d_ff": 1024, "max_seq_len": 64},
    "offload": {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"},
    "tiers": {"cpu": {"keep_freed": "512MiB"}},
}


def _engine() -> tierzero.Engine:
    cfg = load_config(CONFIG)
    return tierzero.initialize(build_model(cfg.model, device="meta", seed=0), cfg)


def _train(engine: tierzero.Engine, steps: int = 2) -> float:
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0)).cuda()
    for _ in range(steps):
        _, loss = engine(x, x)
        engine.backward(loss)
        engine.step()
    return float(loss)


def test_pinned_slices_allocated_freed_and_reallocated_thousands_of_times() -> None:
    rng = random.Random(0)
    before = len(pinned_registry().live())
    tier, live = CpuTier(pin_memory=True, reuse_limit=4 << 20), []
    assert tier.pinned
    for _ in range(3000):
        if live and rng.random() < 0.5:
            tier.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(tier.allocate(rng.choice([4096, 65536, 1 << 20, 3 << 20]) + rng.randrange(3) * 4096, label="x"))
    device = torch.empty((3 << 20) + 3 * 4096, dtype=torch.uint8, device="cuda")
    for region in live[:50]:
        device[: region.nbytes].copy_(region.buffer, non_blocking=True)
    torch.cuda.synchronize()
    for region in live:
        tier.free(region)
    tier.close()
    assert len(pinned_registry().live()) == before


def test_two_engines_one_after_the_other_and_side_by_side() -> None:
    first = _engine()
    loss = _train(first)
    first.close()
    del first
    gc.collect()
    second = _engine()
    assert _train(second) == loss  # same seed, same bits: nothing of the first engine is in the way
    third = _engine()  # side by side with the second
    assert _train(third) == loss
    _train(second)
    for engine in (second, third):
        engine.close()
