"""Frozen parameters at one rank: released after their backward, bound without autograd, never stepped."""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

import tierzero

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from harness import Block  # noqa: E402


class Stack(nn.Module):
    def __init__(self, *, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(layers))
        self.head = nn.Linear(width, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


def _config(stage: int = 3) -> dict[str, Any]:
    return {"zero": {"stage": stage}, "optimizer": {"type": "adamw", "lr": 1e-2}, "gradient_clipping": 1.0}


def _frozen_model() -> Stack:
    torch.manual_seed(0)
    model = Stack()
    for p in model.blocks[1].parameters():
        p.requires_grad_(False)
    model.blocks[2].up.weight.requires_grad_(False)
    return model


def test_a_frozen_unit_is_released_once_its_backward_is_done() -> None:
    events: list[str] = []
    with tierzero.initialize(_frozen_model(), _config()) as engine:
        stage = engine.stage
        reshard, pre_backward = stage.reshard, stage.pre_backward

        def log_reshard(unit: Any) -> None:
            if unit.gathered is not None:
                events.append(f"release {unit.name}")
            reshard(unit)

        def log_pre_backward(unit: Any) -> None:
            events.append(f"backward {unit.name}")
            pre_backward(unit)

        stage.reshard, stage.pre_backward = log_reshard, log_pre_backward
        tokens = torch.randint(0, 32, (2, 8))
        loss = engine(tokens)
        events.clear()
        engine.backward(loss)
        backward = events[: events.index("release root")]
        # block 1 is all frozen: its unit comes back for backward and goes as soon as its input's
        # gradient is complete, the moment block 0's backward starts (whose output that input is)
        assert backward.index("backward blocks.1:frozen") < backward.index("release blocks.1:frozen")
        assert backward.index("release blocks.1:frozen") == backward.index("backward blocks.0") + 1
        # block 2's frozen weight stays until block 2's input gradient is complete too
        assert backward.index("release blocks.2:frozen") == backward.index("backward blocks.1:frozen") + 1
        gathered = [u.name for u in engine.units if u.gathered is not None]
        assert gathered == []


def test_a_steps_graph_is_freed_once_its_backward_ends() -> None:
    # The frozen units' release hooks hold their inputs' grad_fns: left on the graph, they kept each
    # step's graph alive, with the activations it saved, for the life of the process.
    with tierzero.initialize(_frozen_model(), _config()) as engine:
        for step in range(3):
            tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step))
            engine.backward(engine(tokens))
            engine.step()
        gc.collect()
        units = set(map(id, engine.units))
        nodes = [o for o in gc.get_objects() if issubclass(type(o), torch.autograd.function.BackwardCFunction)]
        assert [o.unit.name for o in nodes if id(getattr(o, "unit", None)) in units] == []


def test_frozen_parameters_get_no_gradient_and_stay_bitwise() -> None:
    model = _frozen_model()
    before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with tierzero.initialize(model, _config(stage=2)) as engine:
        for step in range(3):
            tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(step))
            engine.backward(engine(tokens))
            engine.step()
        after = engine.full_state_dict()
        frozen_units = [u for u in engine.units if not u.trainable]
        assert sorted(u.name for u in frozen_units) == ["blocks.1:frozen", "blocks.2:frozen"]
        assert all(spec.kind.value == "param" for u in frozen_units for spec in engine.plan.of(u))
    for name, value in before.items():
        assert torch.equal(after[name], value), name
