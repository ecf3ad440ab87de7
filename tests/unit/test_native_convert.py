"""The landing's native pass (tierzero/native/convert.py): torch's bits for every bf16 value and for
fp32's special ones, and torch's op wherever it declines."""

from __future__ import annotations

import shutil

import pytest
import torch

from tierzero.native.convert import plus_zero_into

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

EVERY_BF16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_zero_plus_every_bf16_value_is_torchs() -> None:
    out = torch.empty_like(EVERY_BF16)
    assert plus_zero_into(EVERY_BF16, out)
    assert torch.equal(out.view(torch.int16), torch.add(EVERY_BF16, 0.0).view(torch.int16))
    assert int(out.view(torch.int16)[EVERY_BF16.view(torch.int16) == -(1 << 15)]) == 0  # -0.0 lands as +0.0


def test_zero_plus_fp32_is_torchs() -> None:
    g = torch.Generator().manual_seed(1)
    values = torch.randn(300_001, generator=g) * torch.logspace(-40, 38, 300_001).clamp(max=3e38)
    values[:5] = torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), float("nan")])
    out = torch.full_like(values, 7.0)
    assert plus_zero_into(values, out)
    assert torch.equal(out.view(torch.int32), torch.add(values, 0.0).view(torch.int32))


def test_what_it_is_not_built_for_is_declined_untouched() -> None:
    src = torch.randn(64)
    out = torch.full((64,), 5.0)
    assert not plus_zero_into(src.half(), out.half())  # another dtype
    assert not plus_zero_into(src, out.bfloat16())  # a conversion
    assert not plus_zero_into(src[::2], out[:32])  # strided
    assert not plus_zero_into(src[:10], out)  # other sizes
    assert torch.equal(out, torch.full((64,), 5.0))
