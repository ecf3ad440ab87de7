"""Pretrained weights at two ranks: stage 3's ranks each read only their own slices of the files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from harness import run_ranks
from tiny_models import tiny_llama

transformers = pytest.importorskip("transformers")


def _job(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    import tierzero
    from tierzero.pretrained import PretrainedWeights, build_meta_model

    read = [0]
    real = PretrainedWeights.read_range

    def counting(self: Any, names: Any, *, shape: Any, start: int, end: int, out: Any = None) -> torch.Tensor:
        read[0] += end - start
        return real(self, names, shape=shape, start=start, end=end, out=out)

    PretrainedWeights.read_range = counting  # type: ignore[method-assign]
    model = build_meta_model(directory).eval()
    cfg = {"zero": {"stage": 3, "unit_classes": ["LlamaDecoderLayer"]}}
    with tierzero.initialize(model, cfg, pretrained=directory) as engine:
        padded = sum(unit.padded_numel for unit in engine.units)
        return {"read": read[0], "padded": padded, "numel": sum(u.numel for u in engine.units), "state": engine.full_state_dict()}


def test_each_rank_reads_its_own_slices_and_the_model_is_whole(tmp_path: Path) -> None:
    reference = tiny_llama(vocab=64, layers=3)
    reference.save_pretrained(tmp_path, safe_serialization=True)
    ranks = run_ranks(_job, world_size=2, payload=str(tmp_path))
    # Each rank reads the real elements of its half of every unit (padding is never read).
    assert sum(r["read"] for r in ranks) == ranks[0]["numel"]
    assert all(r["read"] <= r["padded"] // 2 for r in ranks)
    state = ranks[0]["state"]
    for name, value in reference.state_dict().items():
        if name in state:
            assert torch.equal(state[name], value), name
