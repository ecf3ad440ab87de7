"""Loss scalers against torch's own AMP update rule; overflow checks and unscaling against plain arithmetic."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from overflow_checks import found_inf, found_inf_flag, unscale_
from torch import nn

from tierzero.units.precision import (
    LOWERED_LAYERS,
    DynamicLossScaler,
    StaticLossScaler,
    dtype_of,
    make_loss_scaler,
    reads_fp32_under_autocast,
)
from tierzero.units.unit import Binding


def test_dtype_of() -> None:
    assert dtype_of("fp32") is torch.float32
    assert dtype_of("bf16") is torch.bfloat16
    assert dtype_of("fp16") is torch.float16
    with pytest.raises(ValueError, match=r"^precision.param_dtype must be one of fp32, bf16, fp16, got 'fp64'"):
        dtype_of("fp64")


def test_dynamic_scaler_follows_torch_amp_update_rule() -> None:
    # torch._amp_update_scale_ is the rule GradScaler applies after each step.
    rng = random.Random(0)
    flags = [rng.random() < 0.15 for _ in range(400)]
    scaler = DynamicLossScaler(initial_scale=2.0**16, scale_window=7, min_scale=2.0**-30)
    ref_scale, ref_tracker = torch.tensor([2.0**16]), torch.zeros(1, dtype=torch.int32)
    for flag in flags:
        skip = scaler.update(flag)
        torch._amp_update_scale_(ref_scale, ref_tracker, torch.tensor([float(flag)]), 2.0, 0.5, 7)
        assert skip is flag
        assert scaler.scale == ref_scale.item()
        assert scaler.clean_steps == ref_tracker.item()
    assert min(flags) is False and max(flags) is True


def test_dynamic_scaler_sequence_and_floor() -> None:
    scaler = DynamicLossScaler(initial_scale=8.0, scale_window=2, min_scale=2.0)
    seen = []
    for flag in [True, True, True, False, False, False, True, False]:
        seen.append((scaler.update(flag), scaler.scale))
    assert seen == [
        (True, 4.0),
        (True, 2.0),
        (True, 2.0),  # floor: stays at min_scale, still skips
        (False, 2.0),
        (False, 4.0),  # grows after 2 clean steps
        (False, 4.0),
        (True, 2.0),
        (False, 2.0),
    ]


def test_dynamic_scaler_state_round_trip() -> None:
    a = DynamicLossScaler(initial_scale=1024.0, scale_window=3)
    for flag in [False, True, False, False]:
        a.update(flag)
    b = DynamicLossScaler(initial_scale=1.0, scale_window=3)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == {"scale": 512.0, "clean_steps": 2}
    assert (a.update(False), a.scale) == (b.update(False), b.scale) == (False, 1024.0)
    expected = r"loss scaler state has keys \['scale'\], expected \['clean_steps', 'scale'\]"
    with pytest.raises(ValueError, match=expected):
        b.load_state_dict({"scale": 2.0})


def test_static_scaler() -> None:
    scaler = StaticLossScaler(128.0)
    assert [scaler.update(f) for f in (False, True, False)] == [False, True, False]
    assert scaler.scale == 128.0
    other = StaticLossScaler()
    other.load_state_dict(scaler.state_dict())
    assert other.scale == 128.0


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: DynamicLossScaler(initial_scale=0.0), r"precision.initial_scale must be a finite number > 0, got 0.0"),
        (
            lambda: DynamicLossScaler(min_scale=4.0, initial_scale=2.0),
            r"precision.min_scale \(4.0\) is above precision.initial_scale \(2.0\)",
        ),
        (lambda: DynamicLossScaler(scale_window=0), r"precision.scale_window must be an integer >= 1, got 0"),
        (lambda: DynamicLossScaler(growth=1.0), r"loss scale growth must be > 1, got 1.0"),
        (lambda: DynamicLossScaler(backoff=1.0), r"loss scale backoff must be in \(0, 1\), got 1.0"),
        (lambda: StaticLossScaler(float("inf")), r"precision.loss_scale must be a finite number > 0, got inf"),
    ],
)
def test_scaler_validation(make, message) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def precision_cfg(**kw) -> SimpleNamespace:
    base = dict(param_dtype="fp16", loss_scale="dynamic", initial_scale=2.0**12, scale_window=50, min_scale=1.0)
    return SimpleNamespace(**(base | kw))


def test_make_loss_scaler() -> None:
    dyn = make_loss_scaler(precision_cfg())
    assert isinstance(dyn, DynamicLossScaler)
    assert (dyn.scale, dyn.scale_window, dyn.min_scale) == (2.0**12, 50, 1.0)
    assert make_loss_scaler(precision_cfg(param_dtype="bf16")).scale == 1.0
    assert make_loss_scaler(precision_cfg(param_dtype="fp32")).scale == 1.0
    static = make_loss_scaler(precision_cfg(loss_scale=256.0))
    assert isinstance(static, StaticLossScaler) and static.scale == 256.0
    with pytest.raises(ValueError, match=r"precision.loss_scale must be 'dynamic' or a positive number, got 'auto'"):
        make_loss_scaler(precision_cfg(loss_scale="auto"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_found_inf_detects_each_non_finite(dtype, bad) -> None:
    clean = [torch.randn(1000).to(dtype), torch.randn(7, 3).to(dtype)]
    assert found_inf(clean) is False
    for which in range(2):
        tensors = [t.clone() for t in clean]
        tensors[which].view(-1)[5] = bad
        assert found_inf(tensors) is True
        flag = found_inf_flag(tensors)
        assert flag.dtype == torch.float32 and flag.shape == () and flag.item() == 1.0


def test_found_inf_has_no_false_positive_from_large_finite_values() -> None:
    # A sum of these would overflow fp16 (and fp32 for the second); the values are finite.
    big16 = torch.full((100_000,), 60000.0, dtype=torch.float16)
    big32 = torch.full((10,), 3e38, dtype=torch.float32)
    assert found_inf([big16, big32]) is False


def test_found_inf_on_nothing() -> None:
    assert found_inf([]) is False
    assert found_inf([torch.empty(0)]) is False


def test_unscale_matches_multiplying_by_the_reciprocal() -> None:
    g = torch.Generator().manual_seed(3)
    fp32 = [torch.randn(1000, generator=g) * 1000, torch.randn(33, generator=g)]
    bf16 = [torch.randn(100, generator=g).to(torch.bfloat16)]
    scale = 3.0 * 2**10  # not a power of two: exercises the reciprocal's rounding
    inv = torch.tensor(1.0 / scale, dtype=torch.float32)
    expected = [t * inv for t in fp32] + [(t.float() * inv).to(torch.bfloat16) for t in bf16]
    tensors = [t.clone() for t in fp32 + bf16]
    assert unscale_(tensors, scale) is False
    for got, want in zip(tensors, expected, strict=True):
        assert torch.equal(got, want)


def test_unscale_reports_overflow() -> None:
    tensors = [torch.ones(10), torch.tensor([1.0, float("inf")], dtype=torch.float16)]
    assert unscale_(tensors, 4.0) is True
    assert torch.equal(tensors[0], torch.full((10,), 0.25))
    with pytest.raises(ValueError, match=r"loss scale must be a finite number > 0, got 0"):
        unscale_(tensors, 0)


def test_the_layers_kept_in_bf16_are_those_autocast_lowers() -> None:
    """Each lowered layer's output under CPU autocast is bf16 (its weights were rounded to it);
    a bilinear layer's stays fp32, so its parameters are kept in fp32."""
    torch.manual_seed(0)
    layers = {
        nn.Linear(4, 3): (torch.randn(2, 4),),
        nn.Conv1d(2, 2, 3): (torch.randn(1, 2, 5),),
        nn.Conv2d(2, 2, 3): (torch.randn(1, 2, 5, 5),),
        nn.Conv3d(2, 2, 3): (torch.randn(1, 2, 5, 5, 5),),
        nn.ConvTranspose1d(2, 2, 3): (torch.randn(1, 2, 5),),
        nn.ConvTranspose2d(2, 2, 3): (torch.randn(1, 2, 5, 5),),
        nn.ConvTranspose3d(2, 2, 3): (torch.randn(1, 2, 5, 5, 5),),
        nn.Bilinear(4, 4, 3): (torch.randn(2, 4), torch.randn(2, 4)),
        nn.LayerNorm(4): (torch.randn(2, 4),),
    }
    assert {type(layer) for layer in layers} >= set(LOWERED_LAYERS)
    for layer, inputs in layers.items():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lowered = layer(*inputs).dtype == torch.bfloat16
        bindings = [Binding(module=layer, attr=name, name=name) for name, _ in layer.named_parameters()]
        assert reads_fp32_under_autocast(bindings) is not lowered, type(layer).__name__
