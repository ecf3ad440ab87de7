"""Learning-rate schedules: transformers' shapes, stepped per optimizer step, bitwise as torch's LambdaLR."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import tierzero
from tierzero.common.slices import Kind
from tierzero.optim.flat import FlatAdam, OptimizerSpec, OptimizerType, SliceLayout
from tierzero.optim.schedule import Schedule, lr_lambda

transformers = pytest.importorskip("transformers")


def _transformers_rates(kind: str, *, base: float, warmup: int, total: int, steps: int) -> list[float]:
    """The rate of each optimizer step in the usual loop: optimizer.step(); scheduler.step()."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=base)
    make = {
        "constant": lambda: transformers.get_constant_schedule_with_warmup(optimizer, warmup),
        "linear": lambda: transformers.get_linear_schedule_with_warmup(optimizer, warmup, total),
        "cosine": lambda: transformers.get_cosine_schedule_with_warmup(optimizer, warmup, total),
    }
    scheduler = make[kind]()
    rates = []
    for _ in range(steps):
        rates.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return rates


@pytest.mark.parametrize("kind", ["constant", "linear", "cosine"])
@pytest.mark.parametrize(("warmup", "total"), [(0, 10), (3, 10), (5, 5), (7, 30)])
def test_the_shapes_are_transformers_own(kind: str, warmup: int, total: int) -> None:
    f = lr_lambda(Schedule(type=kind, warmup_steps=warmup, total_steps=total, min_lr_ratio=0.0))
    expected = _transformers_rates(kind, base=3e-4, warmup=warmup, total=total, steps=total + 5)
    assert [3e-4 * f(k) for k in range(total + 5)] == expected


def test_min_lr_ratio_is_the_floor_of_the_decay() -> None:
    f = lr_lambda(Schedule(type="cosine", warmup_steps=2, total_steps=12, min_lr_ratio=0.1))
    assert f(0) == 0.0 and f(2) == 1.0
    assert f(12) == pytest.approx(0.1) and min(f(k) for k in range(2, 40)) == pytest.approx(0.1)
    g = lr_lambda(Schedule(type="linear", warmup_steps=0, total_steps=4, min_lr_ratio=0.5))
    assert [g(k) for k in range(6)] == [1.0, 0.875, 0.75, 0.625, 0.5, 0.5]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))


def test_scheduled_flat_adamw_is_adamw_with_lambdalr_bit_for_bit() -> None:
    """The optimizer half of the engine's step, at the rates the schedule gives, on the same gradients."""
    shapes, steps = [(16, 8), (16,), (4, 16), (4,)], 12
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(shape, generator=g) for shape in shapes]
    reference = [p.clone().requires_grad_() for p in params]
    optimizer = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.01, fused=True)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, 3, steps)
    f = lr_lambda(Schedule(type="cosine", warmup_steps=3, total_steps=steps, min_lr_ratio=0.0))
    numels = [p.numel() for p in params]
    flat = torch.cat([p.reshape(-1) for p in params])
    states = {Kind.EXP_AVG: torch.zeros_like(flat), Kind.EXP_AVG_SQ: torch.zeros_like(flat)}
    adamw = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-2, weight_decay=0.01))
    for k in range(steps):
        grads = [torch.randn(shape, generator=g) for shape in shapes]
        for tensor, grad in zip(reference, grads, strict=True):
            tensor.grad = grad.clone()
        optimizer.step()
        scheduler.step()
        flat_grad = torch.cat([grad.reshape(-1) for grad in grads])
        adamw.step(param=flat, grad=flat_grad, states=states, step=k + 1, lr=1e-2 * f(k), layout=SliceLayout.of(numels, offset=0))
    for mine, theirs in zip(flat.split(numels), reference, strict=True):
        assert torch.equal(mine, theirs.detach().reshape(-1))


def test_the_engine_steps_as_adamw_with_lambdalr_bit_for_bit_and_resumes_the_rates(tmp_path: Path) -> None:
    base, steps = 1e-2, 7
    cfg = {
        "zero": {"stage": 1},
        # one group, as the reference's: every parameter decays (tests/unit/test_groups.py has groups)
        "optimizer": {"type": "adamw", "lr": base, "weight_decay": 0.01, "no_decay": []},
        "scheduler": {"type": "cosine", "warmup_steps": 3, "total_steps": steps},
        "train": {"steps": steps},
    }
    reference = _model()
    optimizer = torch.optim.AdamW(reference.parameters(), lr=base, weight_decay=0.01, fused=True)
    scheduler = transformers.get_cosine_schedule_with_warmup(optimizer, 3, steps)
    f = lr_lambda(Schedule(type="cosine", warmup_steps=3, total_steps=steps, min_lr_ratio=0.0))
    with tierzero.initialize(_model(), cfg) as engine:
        for k in range(steps):
            assert engine.lr == optimizer.param_groups[0]["lr"] == base * f(k)
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(k))
            engine.backward(engine(x).square().mean())
            engine.step()
            reference(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            scheduler.step()
        state = engine.full_state_dict()
        engine.save_checkpoint(tmp_path / "ck")
        assert engine.lr == optimizer.param_groups[0]["lr"]
    for name, value in reference.state_dict().items():
        assert torch.equal(state[name], value), name
    # The position is in the checkpoint: a fresh engine resumes at the same rate.
    with tierzero.initialize(_model(), cfg) as resumed:
        assert resumed.lr == 0.0  # warm-up starts at zero
        resumed.load_checkpoint(tmp_path / "ck")
        assert (resumed.global_step, resumed.lr) == (steps, optimizer.param_groups[0]["lr"])


def test_a_python_lambda_replaces_the_configured_schedule() -> None:
    with tierzero.initialize(_model(), {"zero": {"stage": 3}, "optimizer": {"lr": 0.5}}, lr_lambda=lambda k: 0.5**k) as engine:
        rates = []
        for k in range(3):
            rates.append(engine.lr)
            x = torch.randn(2, 8)
            engine.backward(engine(x).sum())
            engine.step()
    assert rates == [0.5, 0.25, 0.125]
