"""A unit's gradient handed to its step as autograd's own tensors ([Note: gradient pieces])."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import tierzero
from tierzero.common.slices import Kind, Tier
from tierzero.optim.flat import FlatAdam, OptimizerSpec, OptimizerType
from tierzero.stages.grads import pieces as grad_pieces
from tierzero.stages.grads.held import HeldGrads
from tierzero.stages.grads.pieces import GradPieces, step_pieces
from tierzero.units.slice_layout import ParamGroup, SliceLayout
from tierzero.units.unit import plan_units

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case  # noqa: E402


def _unit(*shapes: tuple[int, ...]) -> Any:
    """A one-rank unit whose slots have `shapes` (odd sizes: vector tails, and padding after the last)."""
    module = nn.Module()
    for i, shape in enumerate(shapes):
        module.register_parameter(f"p{i}", nn.Parameter(torch.zeros(shape)))
    (unit,) = plan_units(module, world_size=1)
    assert unit.padded_numel > unit.numel
    return unit


def _take(unit: Any, grads: list[torch.Tensor]) -> GradPieces | None:
    return GradPieces.take(unit, grads, tier=Tier.CPU, nbytes=unit.padded_numel * 4)


def test_pieces_are_taken_only_where_the_step_can_use_them_in_place() -> None:
    unit = _unit((7, 5), (19,))
    fresh = [torch.randn(7, 5), torch.randn(19)]
    assert _take(unit, fresh) is not None
    assert _take(unit, fresh[:1]) is None  # a slot without its gradient
    assert _take(unit, [fresh[0].bfloat16(), fresh[1]]) is None  # not fp32
    # A bf16 GRAD slice stepped by a converting step takes bf16 pieces, and only those.
    halves = [g.bfloat16() for g in fresh]
    assert GradPieces.take(unit, halves, tier=Tier.CPU, nbytes=unit.padded_numel * 2, dtype=torch.bfloat16) is not None
    assert GradPieces.take(unit, fresh, tier=Tier.CPU, nbytes=unit.padded_numel * 2, dtype=torch.bfloat16) is None
    assert _take(unit, [torch.randn(5, 7).t(), fresh[1]]) is None  # not contiguous
    whole = torch.randn(35 + 19)
    assert _take(unit, [whole[:35].view(7, 5), whole[35:]]) is None  # one memory, shared
    assert _take(unit, [fresh[0], torch.randn(40)[:19]]) is None  # part of a larger tensor
    twins, same = _unit((4,), (4,)), torch.randn(4)
    assert _take(twins, [same, same]) is None  # one tensor for two slots
    assert _take(twins, [same, same.clone()]) is not None
    # The estimate's dry run takes pieces too: its meta tensors are told apart by storage, not by
    # address (every meta tensor's is 0).
    one_meta = torch.empty(4, device="meta")
    assert _take(twins, [one_meta, torch.empty(4, device="meta")]) is not None
    assert _take(twins, [one_meta, one_meta]) is None


@pytest.mark.parametrize("converting", [False, True])
@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_stepping_each_slot_gives_the_flat_steps_bits(scale: float, converting: bool) -> None:
    # Two groups (decay and none), slots whose sizes leave vector tails, padding at the end, and the
    # slots listed out of their offsets' order (each steps by its offset, whatever the list's order).
    unit = _unit((7, 5), (19,), (33,))
    unit.slots = tuple(dataclasses.replace(slot, group=1) if i == 1 else slot for i, slot in enumerate(unit.slots))[::-1]
    groups = (ParamGroup(lr=1e-2, weight_decay=0.1), ParamGroup(lr=1e-2, weight_decay=0.0))
    optimizer = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-2, betas=(0.9, 0.95)), groups)
    torch.manual_seed(0)
    n = unit.padded_numel
    pad = slice(unit.numel, n)
    param, m, v = torch.randn(n), torch.randn(n) * 0.1, torch.rand(n) * 0.01
    for t in (param, m, v):
        t[pad] = 0.0
    grads = [torch.randn(slot.shape) for slot in unit.slots]
    flat = torch.zeros(n)
    for slot, grad in zip(unit.slots, grads, strict=True):
        slot.view(flat).copy_(grad)

    expected = {"param": param.clone(), "m": m.clone(), "v": v.clone()}
    flat.mul_(scale)
    ordered = sorted(unit.slots, key=lambda s: s.offset)  # the flat slice's tensors, as they lie in it
    layout = SliceLayout.of([s.numel for s in ordered], groups=[s.group for s in ordered])
    states = {Kind.EXP_AVG: expected["m"], Kind.EXP_AVG_SQ: expected["v"]}
    optimizer.step(param=expected["param"], grad=flat, states=states, step=3, lr=[1e-2, 1e-2], layout=layout)

    pieces = _take(unit, [g.clone() for g in grads])
    assert pieces is not None
    # Converting, the step also casts the new parameters, gaps and padding included (garbage before).
    cast = torch.full((n,), float("nan"), dtype=torch.bfloat16) if converting else None
    step_pieces(optimizer, unit, master=param, pieces=pieces, states={Kind.EXP_AVG: m, Kind.EXP_AVG_SQ: v},
                scale=scale, step=3, lrs=[1e-2, 1e-2], converting=converting, cast=cast)  # fmt: skip
    assert torch.equal(param, expected["param"])
    assert torch.equal(m, expected["m"]) and torch.equal(v, expected["v"])
    assert not param[pad].any() and not m[pad].any()  # the padding keeps its zeros, as a step over it would
    if cast is not None:
        assert torch.equal(cast, expected["param"].bfloat16())


def _train(
    offload: dict[str, str],
    swap: Path,
    *,
    pieces: bool,
    monkeypatch: pytest.MonkeyPatch,
    reduce: str | None = None,
    param_dtype: str | None = None,
    clip: float = 0.0,
) -> Any:
    taken: list[str] = []
    take = GradPieces.take.__func__  # type: ignore[attr-defined]

    def counted(cls: type[GradPieces], unit: Any, grads: Any, *, tier: Tier, nbytes: int, dtype: torch.dtype) -> GradPieces | None:
        got = take(cls, unit, grads, tier=tier, nbytes=nbytes, dtype=dtype) if pieces else None
        if got is not None:
            taken.append(unit.name)
        return got

    with monkeypatch.context() as patch:
        patch.setattr(grad_pieces.GradPieces, "take", classmethod(counted))
        case = Case(stage=3, optimizer="adamw", steps=5, clip=clip, accumulation=1, global_batch=4)
        config = case.config() | {"offload": offload, "tiers": {"nvme": {"path": str(swap)}}}
        if reduce is not None:
            config["precision"] = config.get("precision", {}) | {"reduce_dtype": reduce}
        if param_dtype is not None:
            config["precision"] = config.get("precision", {}) | {"param_dtype": param_dtype}
        engine = tierzero.initialize(case.model(), config)
        losses = []
        with engine:
            for step in range(case.steps):
                loss = engine(*case.batch(step))
                engine.backward(loss)
                engine.step()
                losses.append((loss.item(), engine.grad_norm))  # the norm: None without clipping
                if step == 0:
                    engine.store.reset_peaks()  # the first step lands its gradients in flat slices
            params = engine.full_state_dict()
            report = engine.store.report()
            units = {unit.name: unit for unit in engine.units}
            homes_zero = True
            for unit in engine.units:
                with engine.stage.slice(unit, Kind.GRAD, write=False) as grads:
                    homes_zero = homes_zero and not grads.any()
    return losses, params, report, taken, units, homes_zero


@pytest.mark.parametrize(
    ("offload", "first_step"),
    [
        ({"gradients": "nvme", "optimizer": "cpu"}, False),
        ({"gradients": "nvme", "optimizer": "nvme"}, False),
        ({"gradients": "cpu", "optimizer": "nvme"}, True),
        ({"gradients": "device", "optimizer": "cpu"}, True),
    ],
)
def test_a_step_on_pieces_gives_the_bits_of_one_on_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, offload: dict[str, str], first_step: bool
) -> None:
    """NVMe homes take pieces from the second step (the first lands in a flat slice, which the step
    leaves stale); memory homes from the first, as registered homes hold zeros, and are left so."""
    copied = _train(offload, tmp_path, pieces=False, monkeypatch=monkeypatch)
    losses, params, report, taken, units, homes_zero = _train(offload, tmp_path, pieces=True, monkeypatch=monkeypatch)
    assert copied[3] == [] and len(taken) == len(units) * (5 if first_step else 4)
    assert losses == copied[0]
    assert [name for name in params if not torch.equal(params[name], copied[1][name])] == []
    assert homes_zero and copied[5]  # nothing added into a home; the copy's step zeroed its own
    # The ledger counted each unit's pieces while its step held them, beside the homes in memory,
    # and no more after.
    tier = Tier.DEVICE if offload["gradients"] == "device" else Tier.CPU
    grads = report.tiers[tier]
    homes = 0 if offload["gradients"] == "nvme" else sum(unit.padded_numel * 4 for unit in units.values())
    largest = max(unit.numel * 4 for unit in units.values())
    assert grads.peak_by_kind[Kind.GRAD] >= homes + largest and grads.current_by_kind[Kind.GRAD] == homes


def test_gradients_a_bf16_slice_would_round_are_copied(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    offload = {"gradients": "nvme", "optimizer": "cpu"}
    losses, params, _, taken, _, _ = _train(offload, tmp_path, pieces=True, monkeypatch=monkeypatch, reduce="bf16")
    assert taken == []  # fp32 parameters, bf16 GRAD slices: the step takes the rounded copy
    copied = _train(offload, tmp_path, pieces=False, monkeypatch=monkeypatch, reduce="bf16")
    assert losses == copied[0] and all(torch.equal(params[name], copied[1][name]) for name in params)


@pytest.mark.parametrize("gradients", ["cpu", "nvme"])
def test_a_bf16_models_gradients_are_stepped_as_autograd_made_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gradients: str) -> None:
    """Without a GPU, a bf16 model's gradients are the GRAD slices' own dtype: the converting step widens
    them as it reads them, with the bits of a step on the landed copy, and casts the new parameters."""
    offload = {"gradients": gradients, "optimizer": "cpu"}
    losses, params, _, taken, units, _ = _train(offload, tmp_path, pieces=True, monkeypatch=monkeypatch, param_dtype="bf16")
    copied = _train(offload, tmp_path, pieces=False, monkeypatch=monkeypatch, param_dtype="bf16")
    assert len(taken) == len(units) * (5 if gradients == "cpu" else 4)
    assert losses == copied[0]
    assert [name for name in params if not torch.equal(params[name], copied[1][name])] == []


@pytest.mark.parametrize("param_dtype", ["fp32", "bf16"])
def test_pieces_held_for_a_clipped_step_give_the_bits_of_landed_gradients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, param_dtype: str
) -> None:
    """Clipping steps after backward: each unit's pieces are held for it, their squares counted for the
    norm in the slice's order ([Note: held gradient pieces]); the clipped steps' bits are those of
    gradients landed in the homes and summed there."""
    offload = {"gradients": "cpu", "optimizer": "cpu"}
    held: list[str] = []
    hold = HeldGrads.hold

    def counted(self: HeldGrads, unit: str, pieces: GradPieces) -> bool:
        kept = hold(self, unit, pieces)
        held.extend([unit] if kept else [])
        return kept

    monkeypatch.setattr(HeldGrads, "hold", counted)
    losses, params, report, taken, units, homes_zero = _train(
        offload, tmp_path, pieces=True, monkeypatch=monkeypatch, param_dtype=param_dtype, clip=0.05
    )
    assert len(held) == len(units) * 5 and len(taken) == len(held)
    assert all(norm > 0.05 for _, norm in losses)  # every step clipped, by a norm summed from the pieces
    assert homes_zero  # the homes were never written
    assert report.tiers[Tier.CPU].current_by_kind[Kind.GRAD] == sum(unit.padded_numel for unit in units.values()) * (
        2 if param_dtype == "bf16" else 4
    )  # nothing held is booked after the step
    copied = _train(offload, tmp_path, pieces=False, monkeypatch=monkeypatch, param_dtype=param_dtype, clip=0.05)
    assert len(held) == len(units) * 5  # the copying run held none
    assert losses == copied[0]
    assert [name for name in params if not torch.equal(params[name], copied[1][name])] == []
