"""A step's units in host memory stepped in one native pass ([Note: one host step] in stages/host_step.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero
from tierzero.common.slices import Kind, SliceKey
from tierzero.native.adam import AdamSlots, NativeAdam, native_adam
from tierzero.optim import flat
from tierzero.optim.base import ConvertingSlots
from tierzero.optim.flat import FlatAdam, OptimizerSpec, OptimizerType
from tierzero.stages import step_in_time
from tierzero.units.slice_layout import ParamGroup, cpu_vector_width

sys.path.insert(0, str(Path(__file__).parents[1] / "distributed"))
from harness import Case  # noqa: E402

CASE = Case(stage=3, optimizer="adamw", steps=3, clip=0.05, accumulation=1, global_batch=4)


def _run(
    monkeypatch: pytest.MonkeyPatch, *, in_place: bool, dtype: str, offload: dict[str, str], more: dict[str, Any] | None = None
) -> tuple[list[Any], dict[str, torch.Tensor], list[int]]:
    """(each step's loss and norm, the final parameters and moments, the slices of each native Adam call)."""
    calls: list[int] = []
    with monkeypatch.context() as patch:
        if not in_place:
            patch.setattr(step_in_time, "steps_in_place", lambda stage, unit: False)
        many = NativeAdam.step_many
        patch.setattr(NativeAdam, "step_many", lambda self, slots, **kw: (calls.append(len(slots)), many(self, slots, **kw))[1])
        config = CASE.config() | {"offload": offload, "precision": {"param_dtype": dtype}} | (more or {})
        engine = tierzero.initialize(CASE.model(), config)
        seen = []
        with engine:
            for step in range(CASE.steps):
                loss = engine(*CASE.batch(step))
                engine.backward(loss)
                engine.step()
                seen.append((loss.item(), engine.grad_norm))
            engine.stage.settle_step()
            in_memory = offload.get("optimizer") != "nvme"
            states = {f"{unit.name}.{kind.value}": engine.store.home_tensor(SliceKey(unit.name, kind)).clone()
                      for unit in engine.units for kind in (Kind.EXP_AVG, Kind.EXP_AVG_SQ) if in_memory}  # fmt: skip
            return seen, engine.full_state_dict() | states, calls


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_a_clipped_steps_units_step_in_one_call_with_the_pipelines_bits(monkeypatch: pytest.MonkeyPatch, dtype: str) -> None:
    if native_adam(cpu_vector_width()) is None:
        pytest.skip("the native Adam kernel is not built here")
    offload = {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"}
    ours, our_state, our_calls = _run(monkeypatch, in_place=True, dtype=dtype, offload=offload)
    theirs, their_state, their_calls = _run(monkeypatch, in_place=False, dtype=dtype, offload=offload)
    units = len(their_calls) // CASE.steps
    # One call a step for every unit, where the pipeline made one a unit.
    assert our_calls == [units] * CASE.steps and their_calls == [1] * (units * CASE.steps) and units > 2
    assert ours == theirs and all(norm > CASE.clip for _, norm in ours)  # every step clipped
    assert our_state.keys() == their_state.keys()
    assert all(torch.equal(our_state[k].view(torch.uint8), their_state[k].view(torch.uint8)) for k in our_state)


def test_units_whose_states_live_on_nvme_keep_the_pipeline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    if native_adam(cpu_vector_width()) is None:
        pytest.skip("the native Adam kernel is not built here")
    nvme = {"tiers": {"nvme": {"path": str(tmp_path)}}}
    _, _, calls = _run(monkeypatch, in_place=True, dtype="bf16", offload={"gradients": "cpu", "optimizer": "nvme"}, more=nvme)
    assert calls and set(calls) == {1}  # a unit a call: their states are read from the disk, a group at a time


def _slices(gen: torch.Generator, sizes: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], dict[Kind, torch.Tensor]]:
    n = sum(sizes) + 5  # padding past the slots
    param = torch.randn(n, generator=gen)
    grads = [torch.randn(k, generator=gen).bfloat16() for k in sizes]
    states = {Kind.EXP_AVG: torch.randn(n, generator=gen) * 1e-2, Kind.EXP_AVG_SQ: torch.rand(n, generator=gen) * 1e-4}
    return param, grads, states


@pytest.mark.parametrize("native", [True, False])
def test_step_converting_many_steps_each_unit_as_step_converting_slots_does(monkeypatch: pytest.MonkeyPatch, native: bool) -> None:
    if not native:
        monkeypatch.setattr(flat, "_native_for", lambda *args: None)
    elif native_adam(cpu_vector_width()) is None:
        pytest.skip("the native Adam kernel is not built here")
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-3, weight_decay=0.1), [ParamGroup(1e-3, 0.1), ParamGroup(3e-3, 0.0)])
    gen = torch.Generator().manual_seed(39)
    units = [_slices(gen, sizes) for sizes in ([37, 100], [64, 3, 250])]
    copies = [(p.clone(), grads, {k: s.clone() for k, s in states.items()}) for p, grads, states in units]
    casts = [torch.zeros(p.numel(), dtype=torch.bfloat16) for p, _, _ in units]
    their_casts = [c.clone() for c in casts]
    for step in (1, 2):
        many = []
        for (param, grads, states), cast in zip(units, casts, strict=True):
            slots = [(offset, g, i % 2) for i, (offset, g) in enumerate(zip(_offsets(grads), grads, strict=True))]
            many.append(ConvertingSlots(param, slots, states, cast))
        opt.step_converting_many(many, scale=0.37, step=step, lr=[1e-3, 3e-3])
        for (param, grads, states), cast in zip(copies, their_casts, strict=True):
            slots = [(offset, g, i % 2) for i, (offset, g) in enumerate(zip(_offsets(grads), grads, strict=True))]
            FlatAdam.step_converting_slots(opt, param=param, grads=slots, scale=0.37, states=states, step=step, lr=[1e-3, 3e-3], cast=cast)
    for (p, _, s), (q, _, t) in zip(units, copies, strict=True):
        assert torch.equal(p.view(torch.int32), q.view(torch.int32))
        assert all(torch.equal(s[k].view(torch.int32), t[k].view(torch.int32)) for k in s)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(casts, their_casts, strict=True))


def _offsets(grads: list[torch.Tensor]) -> list[int]:
    return [sum(g.numel() for g in grads[:i]) for i in range(len(grads))]


def test_step_many_steps_slots_of_separate_tensors_as_torch_steps_each_alone() -> None:
    kernel = native_adam(cpu_vector_width())
    if kernel is None:
        pytest.skip("the native Adam kernel is not built here")
    gen = torch.Generator().manual_seed(40)
    params = [torch.randn(n, generator=gen) for n in (70, 129)]
    moments = [(torch.randn(p.numel(), generator=gen) * 1e-2, torch.rand(p.numel(), generator=gen) * 1e-4) for p in params]
    grads = [[torch.randn(30, generator=gen), torch.randn(40, generator=gen)], [torch.randn(129, generator=gen)]]
    theirs = [(p.clone(), m.clone(), v.clone()) for p, (m, v) in zip(params, moments, strict=True)]
    rates = [[1e-3, 2e-3], [3e-3]]
    kernel.step_many(
        [AdamSlots(p, g, _offsets(g), m, v, lrs, [0.1] * len(g)) for p, g, (m, v), lrs in zip(params, grads, moments, rates, strict=True)],
        step=3, betas=(0.9, 0.999), eps=1e-8, adamw=True, lanes=cpu_vector_width(), scale=0.5,
    )  # fmt: skip
    for (p, m, v), g, lrs in zip(theirs, grads, rates, strict=True):
        for offset, grad, lr in zip(_offsets(g), g, lrs, strict=True):
            part = slice(offset, offset + grad.numel())
            torch._fused_adamw_(
                [p[part]], [grad * 0.5], [m[part]], [v[part]], [], [torch.tensor(3.0)], lr=lr, beta1=0.9, beta2=0.999,
                weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
            )  # fmt: skip
    for p, (m, v), (q, n, w) in zip(params, moments, theirs, strict=True):
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in ((p, q), (m, n), (v, w)))
    with pytest.raises(ValueError, match="must be contiguous host fp32"):
        kernel.step_many([AdamSlots(params[0].double(), grads[0], [0, 30], *moments[0], [1e-3] * 2, [0.1] * 2)],
                         step=1, betas=(0.9, 0.999), eps=1e-8, adamw=True, lanes=cpu_vector_width())  # fmt: skip
