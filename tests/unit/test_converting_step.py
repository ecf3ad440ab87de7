"""`FlatAdam.step_converting` ([Note: the converting step] in optim/flat.py): a bf16 or fp32 gradient
converted and scaled a chunk at a time gives the bits of the whole-slice copy, multiply and step."""

from __future__ import annotations

import pytest
import torch

import tierzero.optim.flat as flat
from tierzero.common.slices import Kind
from tierzero.optim.flat import FlatAdam, FlatSGD, OptimizerSpec, OptimizerType
from tierzero.units.slice_layout import ParamGroup, SliceLayout

NUMELS = [1000, 37, 4096, 515, 3, 2048 + 17]
"""Tensors of a unit: tails of every length, and one a whole number of vectors."""


def _slice(offset: int, numel: int, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=g)
    grad = torch.randn(numel, generator=g).to(torch.bfloat16)
    m, v = torch.randn(numel, generator=g) * 0.1, torch.rand(numel, generator=g) * 0.01
    return param, grad, m, v


@pytest.mark.parametrize("chunk", [64, 128, 1 << 18])
@pytest.mark.parametrize("kind", [OptimizerType.ADAMW, OptimizerType.ADAM])
@pytest.mark.parametrize(("offset", "grad_dtype"), [(0, torch.bfloat16), (333, torch.bfloat16), (1021, torch.float32)])
def test_the_converting_step_gives_the_bits_of_the_whole_slice(
    chunk: int, kind: OptimizerType, offset: int, grad_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flat, "STEP_CHUNK", chunk)
    groups = [ParamGroup(lr=1e-2, weight_decay=0.1), ParamGroup(lr=3e-3, weight_decay=0.0)]
    opt = FlatAdam(OptimizerSpec(type=kind, lr=1e-2, weight_decay=0.1), groups)
    numel = sum(NUMELS) - offset - 50  # a slice cut inside its first and its last tensor
    layout = SliceLayout.of(NUMELS, offset=offset, groups=[0, 1, 1, 0, 1, 0])
    param, grad, m, v = _slice(offset, numel, seed=offset)
    grad = grad.to(grad_dtype)
    scale = 0.3713
    for step in (1, 2, 7):
        a = [t.clone() for t in (param, m, v)]
        b = [t.clone() for t in (param, m, v)]
        whole = grad.to(torch.float32, copy=True).mul_(scale)
        opt.step(param=a[0], grad=whole, states={Kind.EXP_AVG: a[1], Kind.EXP_AVG_SQ: a[2]}, step=step, lr=[1e-2, 3e-3], layout=layout)
        cast = torch.full((numel,), float("nan"), dtype=torch.bfloat16)
        opt.step_converting(
            param=b[0], grad=grad, scale=scale, states={Kind.EXP_AVG: b[1], Kind.EXP_AVG_SQ: b[2]}, step=step,
            lr=[1e-2, 3e-3], layout=layout, cast=cast,
        )  # fmt: skip
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x, y)
        assert torch.equal(cast, a[0].to(torch.bfloat16))  # every element cast, scratch runs too
        assert not torch.equal(a[0], param)  # it stepped
    assert grad.dtype == grad_dtype  # the gradient is only read


def test_without_a_layout_or_a_scale_it_is_the_plain_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flat, "STEP_CHUNK", 192)
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-3, weight_decay=0.01))
    param, grad, m, v = _slice(0, 1000, seed=3)
    a, b = [t.clone() for t in (param, m, v)], [t.clone() for t in (param, m, v)]
    opt.step(param=a[0], grad=grad.float(), states={Kind.EXP_AVG: a[1], Kind.EXP_AVG_SQ: a[2]}, step=1, lr=1e-3)
    opt.step_converting(param=b[0], grad=grad, scale=1.0, states={Kind.EXP_AVG: b[1], Kind.EXP_AVG_SQ: b[2]}, step=1, lr=1e-3)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_sgd_steps_fp32_gradients_only() -> None:
    opt = FlatSGD(OptimizerSpec(type=OptimizerType.SGD, lr=0.1))
    assert not opt.converts_gradients and FlatAdam.converts_gradients
    with pytest.raises(NotImplementedError, match="FlatSGD steps fp32 gradients only"):
        opt.step_converting(param=torch.zeros(4), grad=torch.zeros(4), scale=1.0, states={}, step=1, lr=0.1)


def test_a_gradient_of_another_size_is_refused() -> None:
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-3))
    states = {Kind.EXP_AVG: torch.zeros(8), Kind.EXP_AVG_SQ: torch.zeros(8)}
    with pytest.raises(ValueError, match=r"a converted gradient must be a float slice of the param's size"):
        opt.step_converting(param=torch.zeros(8), grad=torch.zeros(7), scale=1.0, states=states, step=1, lr=1e-3)
