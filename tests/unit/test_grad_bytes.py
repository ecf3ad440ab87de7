"""Gradients homed on NVMe cross the disk twice a step: the reduce writes them, the step reads
them. The step leaves the used slice on the disk rather than writing zeros over it, and the next
reduce starts from zeros instead of reading it back."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from test_grad_norm import Stack

import tierzero
from tierzero.common.slices import Kind, SliceKey, Tier


def _train(tmp_path: Path, *, grads: str, accumulation: int, clip: float) -> tuple[dict[str, torch.Tensor], list[Counter[str]]]:
    cfg = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-2},
        "gradient_clipping": clip,
        "gradient_accumulation_steps": accumulation,
        "offload": {"params": "nvme", "gradients": grads, "optimizer": "nvme"},
        "tiers": {"nvme": {"path": str(tmp_path)}},
    }
    per_step: list[Counter[str]] = []
    with tierzero.initialize(Stack(), cfg) as engine:
        store, moved = engine.store, Counter[str]()
        fetch, write_back = store.fetch, store.write_back

        def counting_fetch(key: SliceKey, *, to: Tier) -> Any:
            if key.kind is Kind.GRAD and store.at_home(key):
                moved["read"] += 1
            return fetch(key, to=to)

        def counting_write(key: SliceKey, src: torch.Tensor | None = None) -> Any:
            if key.kind is Kind.GRAD:
                moved["written"] += 1
            return write_back(key, src)

        store.fetch, store.write_back = counting_fetch, counting_write
        for step in range(4):
            moved.clear()
            for micro in range(accumulation):
                tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + micro))
                engine.backward(engine(tokens))
                engine.step()
            engine.stage.settle_step()
            per_step.append(Counter(moved))
        state = engine.full_state_dict()
    assert state is not None
    return state, per_step


@pytest.mark.parametrize("clip", [0.0, 1.0], ids=["in-backward", "clipped"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_each_gradient_crosses_the_disk_once_each_way_per_micro_step(tmp_path: Path, accumulation: int, clip: float) -> None:
    reference, _ = _train(tmp_path, grads="cpu", accumulation=accumulation, clip=clip)
    state, per_step = _train(tmp_path, grads="nvme", accumulation=accumulation, clip=clip)
    units = 4  # the root and three blocks
    # Each micro-step's reduce writes each unit's slice; all but the first read it to add to it;
    # the step reads it once. Nothing writes zeros. A step run in backward takes the last
    # micro-step's sum from memory: neither written nor read back.
    handed = units if clip == 0.0 else 0
    expected = Counter({"written": units * accumulation - handed, "read": units * accumulation - handed})
    assert per_step[1:] == [+expected] * 3, per_step
    assert [name for name in reference if not torch.equal(state[name], reference[name])] == []
