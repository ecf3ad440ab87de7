"""The host's passes over a step's gradients and parameters ([Note: the squares' order] in
native/squares.py, [Note: the converting step] in optim/flat.py): the landing sums the norm's
squares as it writes each piece, with the bits of summing the landed slice afterwards; and a
host-memory PARAM home takes the step's cast in place, with the bits of a write-back."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
import tierzero.optim.flat as flat
from tierzero.common.slices import Kind
from tierzero.native.squares import BLOCK, Squares
from tierzero.stages.grads.held import HeldGrads
from tierzero.stages.grads.landing import add_into
from tierzero.stages.grads.norm import square_sum

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case  # noqa: E402

CHUNK = 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_landing_writes_zeros_plus_each_piece_and_sums_its_squares_as_it_writes(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # Pieces that start and end inside lanes' rows and blocks, one across three blocks, gaps between, and -0.0s.
    layout = [(3, 37), (50, 200), (300, 3 * BLOCK), (3 * BLOCK + 400, 1), (3 * BLOCK + 900, 61)]
    pieces = [(offset, torch.randn(n, generator=g).to(dtype)) for offset, n in layout]
    pieces[1][1][::7] = -0.0
    size = 3 * BLOCK + 1000
    shard = torch.full((size,), float("nan"), dtype=dtype)  # fresh: garbage before the landing
    squares = Squares()
    add_into(shard, list(reversed(pieces)), fresh=True, squares=squares)

    expected = torch.zeros(size, dtype=dtype)
    for offset, piece in pieces:
        expected[offset : offset + piece.numel()] += piece  # zeros plus each: -0.0 lands as +0.0
    assert torch.equal(shard.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       expected.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))  # fmt: skip
    assert torch.equal(squares.total, square_sum(shard))  # the bits of counting it after the landing
    exact = sum(float(p.double().square().sum()) for _, p in pieces)
    rel = 1e-5 if dtype == torch.bfloat16 else 1e-7  # bf16 squares add up in fp32 lanes ([Note: the squares' order])
    assert float(squares.total) == pytest.approx(exact, rel=rel)


def test_a_landing_without_a_sum_writes_the_same_bits() -> None:
    g = torch.Generator().manual_seed(1)
    pieces = [(10, torch.randn(100, generator=g).bfloat16()), (200, torch.randn(30, generator=g).bfloat16())]
    counted, plain = torch.full((256,), 7.0, dtype=torch.bfloat16), torch.full((256,), 3.0, dtype=torch.bfloat16)
    add_into(counted, pieces, fresh=True, squares=Squares())
    add_into(plain, pieces, fresh=True)
    assert torch.equal(counted, plain)
    with pytest.raises(AssertionError, match="only a fresh shard's landing counts it"):
        add_into(plain, pieces, fresh=False, squares=Squares())


def test_a_host_slice_is_summed_in_the_squares_order_and_a_device_slice_in_one_dot() -> None:
    t = torch.randn(2 * BLOCK + 13, generator=torch.Generator().manual_seed(2))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        squares = Squares()
        squares.add(t.to(dtype)[:5], 0)
        squares.add(t.to(dtype)[5:], 5)
        assert torch.equal(square_sum(t.to(dtype)), squares.total)
        rel = 1e-7 if dtype == torch.float32 else 1e-5  # 16-bit squares add up in fp32 lanes
        assert float(squares.total) == pytest.approx(float(t.to(dtype).double().square().sum()), rel=rel)
    meta = square_sum(torch.empty(10, dtype=torch.bfloat16, device="meta"))
    assert meta.device.type == "meta" and meta.dtype == torch.float32 and meta.dim() == 0


def _train(offload: dict[str, str], swap: Path) -> tuple[list[float], dict[str, torch.Tensor], list[Kind], list[float]]:
    """Stage 3, bf16, AdamW, clipping that binds: (losses, parameters, the kinds written home during
    the steps, the norms the engine clipped by)."""
    case = Case(stage=3, optimizer="adamw", steps=4, dtype="bf16", clip=0.05, accumulation=1, global_batch=4)
    config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": str(swap)}}}
    losses, written, norms = [], [], []
    with tierzero.initialize(case.model(), config) as engine:
        write_back = engine.store.write_back

        def counting(key: Any, src: Any = None) -> Any:
            written.append(key.kind)
            return write_back(key, src)

        for step in range(case.steps):
            loss = engine(*case.batch(step))
            engine.backward(loss)
            engine.store.write_back = counting
            engine.step()
            engine.store.write_back = write_back
            losses.append(loss.item())
            norms.append(engine.grad_norm)
        params = engine.full_state_dict()
    assert params is not None
    return losses, params, written, norms


def test_a_host_param_home_takes_the_cast_in_place_with_the_bits_of_a_write_back(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks far smaller than the model's units: every pass crosses chunk and tensor boundaries.
    monkeypatch.setattr(flat, "STEP_CHUNK", 2 * CHUNK)
    in_place = _train({"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}, tmp_path)
    written_home = _train({"params": "nvme", "gradients": "cpu", "optimizer": "cpu"}, tmp_path)
    assert in_place[0] == written_home[0]
    assert all(torch.equal(in_place[1][name], value) for name, value in written_home[1].items())
    assert in_place[3] == written_home[3] and all(n > 0.05 for n in in_place[3])  # the clip binds
    assert Kind.PARAM not in in_place[2]  # the step wrote its new parameters into the home itself
    assert Kind.PARAM in written_home[2]


@pytest.mark.parametrize("held", [False, True])
def test_each_units_gradients_are_freed_once_the_next_units_have_landed(monkeypatch: pytest.MonkeyPatch, held: bool) -> None:
    """[Note: gradients freed a unit late]: a unit's gradients live until the next unit's land, none past the
    backward; pieces held for the clipped step ([Note: held gradient pieces]) live until it, none past it."""
    if not held:
        monkeypatch.setattr(HeldGrads, "hold", lambda self, unit, pieces: False)
    case = Case(stage=3, optimizer="adamw", steps=2, dtype="bf16", clip=0.05, accumulation=1, global_batch=4)
    config = case.config() | {"offload": {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}}
    with tierzero.initialize(case.model(), config) as engine:
        stage, alive, memory = engine.stage, [], {}
        reduce_grads = stage.reduce_grads

        def watching(unit: Any, grads: list[torch.Tensor]) -> None:
            assert held or not alive or all(ref() is not None for ref in alive[-1])  # the last unit's, kept
            reduce_grads(unit, grads)
            alive.append([weakref.ref(g) for g in grads])
            memory[unit.name] = [g.data_ptr() for g in grads]

        stage.reduce_grads = watching
        for step in range(case.steps):
            alive.clear()
            memory.clear()
            engine.backward(engine(*case.batch(step)))
            assert len(alive) == len(engine.units) > 2 and stage._landed_late is None
            pieces = {unit.name: stage.held_grads.get(unit.name) for unit in engine.units}
            if held:  # each unit's pieces are autograd's own memory, kept for the step
                assert {name: [t.data_ptr() for t in p.tensors] for name, p in pieces.items() if p is not None} == memory
            else:
                assert set(pieces.values()) == {None} and all(ref() is None for refs in alive for ref in refs)
            del pieces
            engine.step()
            stage.settle_step()  # the units the next forward would step, stepped now
            assert all(ref() is None for refs in alive for ref in refs)
            assert all(stage.held_grads.get(unit.name) is None for unit in engine.units)
        stage.reduce_grads = reduce_grads
