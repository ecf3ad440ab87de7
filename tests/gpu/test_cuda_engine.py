"""The engine on a GPU: a materialised model reaches the device a unit at a time, never whole.

Skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch

import tierzero
from tierzero.models import GPT, ModelSpec

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
