"""The gradient norm for clipping is summed as gradients land: the step reads each gradient once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import tierzero
from tierzero.common.slices import Kind
from tierzero.native.squares import Squares
from tierzero.stages.grads.norm import GradNorm
from tierzero.stages.step import ForwardStep
from tierzero.stages.step_pipeline import MAX_RESIDENT_GROUPS


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(64, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32)) for _ in range(3))
        self.head = nn.Linear(32, 64)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return F.cross_entropy(self.head(x).flatten(0, 1), tokens.flatten())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_clipping_reads_each_gradient_once_and_clips_as_torch(stage: int, tmp_path: Path) -> None:
    offload = {"gradients": "nvme", "optimizer": "nvme"} if stage > 1 else {"optimizer": "nvme"}
    cfg = {
        "zero": {"stage": stage},
        "optimizer": {"type": "sgd", "lr": 0.1},
        "gradient_clipping": 0.05,
        "gradient_accumulation_steps": 2,
        "offload": offload,
        "tiers": {"nvme": {"path": str(tmp_path)}},
    }
    reference = Stack()
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(i)) for i in range(4)]
    with tierzero.initialize(Stack(), cfg) as engine:
        fetched: Counter[Kind] = Counter()
        fetch = engine.store.fetch

        def counting(key: Any, **kwargs: Any) -> Any:
            fetched[key.kind] += 1
            return fetch(key, **kwargs)

        engine.store.fetch = counting
        for step in range(2):
            for micro in range(2):
                tokens = batches[2 * step + micro]
                loss = engine(tokens)
                engine.backward(loss)
                if micro == 1:
                    fetched.clear()
                engine.step()
                (reference(tokens) / 2).backward()
            norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.05)
            assert norm > 0.05  # the clip binds
            optimizer.step()
            optimizer.zero_grad()
            # The step fetched each unit's gradient once, for its update; the norm read none.
            assert fetched[Kind.GRAD] == len(engine.units), fetched
        state = engine.full_state_dict()
    for name, value in reference.named_parameters():
        torch.testing.assert_close(state[name], value.detach(), rtol=1e-5, atol=1e-6)


def test_with_clipping_stage_3_steps_each_unit_in_the_next_forward(tmp_path: Path) -> None:
    cfg = {
        "zero": {"stage": 3, "step_in_forward": True},
        "optimizer": {"type": "adamw", "lr": 1e-2},
        "gradient_clipping": 1.0,
        "offload": {"params": "nvme", "optimizer": "nvme"},
        "tiers": {"nvme": {"path": str(tmp_path)}},
    }
    with tierzero.initialize(Stack(), cfg) as engine:
        stage = engine.stage
        for step in range(4):
            tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
            loss = engine(tokens)
            if step > 0:
                # the forward stepped every unit on its way; the prefetcher still fetched ahead
                # (how many in time is timing: `bench train --clip` measures the hit rate)
                assert stage._forward_step is not None and not any(stage._forward_step.pending(u) for u in engine.units)
                if step > 1:
                    assert engine.prefetch_report().issued_bytes > 0
            engine.backward(loss)
            assert stage._forward_step is None  # backward settles what the forward did not reach
            engine.step()
            # the step waits for the next forward: only its first units stepped already
            assert sum(stage._forward_step.pending(u) for u in engine.units) == len(engine.units) - 1 - ForwardStep.LOOKAHEAD
        before = engine.full_state_dict()  # settles: the last step is in what it returns
        assert stage._forward_step is None
        with torch.no_grad():
            engine(tokens)
        assert all(torch.equal(before[n], v) for n, v in engine.full_state_dict().items())


@pytest.mark.parametrize("in_forward", [False, True], ids=["after-backward", "in-forward"])
def test_the_first_units_states_are_read_while_backward_ends_with_the_same_bits(tmp_path: Path, in_forward: bool) -> None:
    def train(overlap: bool) -> tuple[dict[str, torch.Tensor], list[int]]:
        cfg = {
            "zero": {"stage": 3, "overlap_step": overlap, "step_in_forward": in_forward},
            "optimizer": {"type": "adamw", "lr": 1e-2},
            "gradient_clipping": 1.0,
            "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
            "tiers": {"nvme": {"path": str(tmp_path)}},
        }
        read_in_backward: list[int] = []
        with tierzero.initialize(Stack(), cfg) as engine:
            fetch, reads = engine.store.fetch, Counter[Kind]()

            def counting(key: Any, **kwargs: Any) -> Any:
                reads[key.kind] += 1
                return fetch(key, **kwargs)

            engine.store.fetch = counting
            for step in range(4):
                loss = engine(torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step)))
                reads.clear()
                engine.backward(loss)
                read_in_backward.append(reads[Kind.EXP_AVG])
                engine.step()
            state = engine.full_state_dict()
        assert state is not None
        return state, read_in_backward

    reference, none_ahead = train(overlap=False)
    state, ahead = train(overlap=True)
    assert none_ahead == [0] * 4  # without the overlap, every state is read after backward
    # From the second step on (the first learns the order) the step's first blocks, not the
    # root, have their states read as their backward starts: at most the pipeline's bound.
    assert all(1 <= n <= MAX_RESIDENT_GROUPS for n in ahead[1:]), ahead
    assert [name for name in reference if not torch.equal(state[name], reference[name])] == []


def test_held_pieces_squares_counted_at_the_take_sum_as_counted_when_held() -> None:
    """`GradNorm.add_later` (a held unit's pieces, counted when the norm is taken, every unit's in one call)
    gives the sum of counting each unit as it came: the units' sums added in the same order."""
    gen = torch.Generator().manual_seed(5)
    units = [[(0, torch.randn(n, generator=gen).bfloat16()), (n + 3, torch.randn(7, generator=gen).bfloat16())] for n in (50, 70_000, 9)]
    landed = torch.randn(33, generator=gen)
    now, later = GradNorm(), GradNorm()
    for i, pieces in enumerate(units):
        squares = Squares()
        for at, values in pieces:
            squares.add(values, at)
        now.add_sum(f"u{i}", squares.total)
        later.add_later(f"u{i}", pieces)
        if i == 1:  # a unit that landed, between held ones
            now.add("landed", landed)
            later.add("landed", landed)
    assert later.counted("u2") and later.counted("landed") and not later.counted("u3")
    ours = later.take(device=torch.device("cpu"))
    assert torch.equal(ours, now.take(device=torch.device("cpu"))) and float(ours) > 0
    later.add_later("u0", units[0])
    later.reset()  # dropped gradients: nothing left to count
    assert float(later.take(device=torch.device("cpu"))) == 0.0 and not later.counted("u0")
