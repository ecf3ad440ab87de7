"""The landing's and the norm's native conversions (tierzero/native/convert.py): torch's bits for every
bf16 value and for fp32's special ones, and torch's op wherever they decline."""

from __future__ import annotations

import shutil

import pytest
import torch

from tierzero.native import convert
from tierzero.native.convert import plus_zero_into, widen_into
from tierzero.stages.grads.landing import add_into
from tierzero.stages.grads.norm import SquareSum

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

EVERY_BF16 = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


def test_zero_plus_every_bf16_value_is_torchs() -> None:
    out = torch.empty_like(EVERY_BF16)
    assert plus_zero_into(EVERY_BF16, out)
    assert torch.equal(out.view(torch.int16), torch.add(EVERY_BF16, 0.0).view(torch.int16))
    assert int(out.view(torch.int16)[EVERY_BF16.view(torch.int16) == -(1 << 15)]) == 0  # -0.0 lands as +0.0


def test_zero_plus_fp32_is_torchs_and_widening_is_exact() -> None:
    g = torch.Generator().manual_seed(1)
    values = torch.randn(300_001, generator=g) * torch.logspace(-40, 38, 300_001).clamp(max=3e38)
    values[:5] = torch.tensor([-0.0, 0.0, float("inf"), float("-inf"), float("nan")])
    out = torch.full_like(values, 7.0)
    assert plus_zero_into(values, out)
    assert torch.equal(out.view(torch.int32), torch.add(values, 0.0).view(torch.int32))
    wide = torch.empty(EVERY_BF16.numel())
    assert widen_into(EVERY_BF16, wide)
    assert torch.equal(wide.view(torch.int32), EVERY_BF16.float().view(torch.int32))


def test_what_they_are_not_built_for_is_declined_untouched() -> None:
    src = torch.randn(64)
    out = torch.full((64,), 5.0)
    assert not plus_zero_into(src.half(), out.half())  # another dtype
    assert not plus_zero_into(src, out.bfloat16())  # a conversion
    assert not plus_zero_into(src[::2], out[:32])  # strided
    assert not plus_zero_into(src[:10], out)  # other sizes
    assert not widen_into(src, out)  # not from bf16
    assert torch.equal(out, torch.full((64,), 5.0))


def test_the_landing_and_the_norm_give_the_same_bits_without_the_library(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(2)
    pieces = [(3, torch.randn(5000, generator=g).bfloat16()), (6000, torch.randn(300_000, generator=g).bfloat16())]
    pieces[1][1][::5] = -0.0

    def land() -> tuple[torch.Tensor, torch.Tensor]:
        shard = torch.full((400_000,), float("nan"), dtype=torch.bfloat16)
        squares = SquareSum(torch.bfloat16, device=shard.device)
        add_into(shard, pieces, fresh=True, squares=squares)
        return shard, squares.total

    native = land()
    monkeypatch.setattr(convert, "_checked", lambda: None)
    torch_ops = land()
    assert torch.equal(native[0].view(torch.int16), torch_ops[0].view(torch.int16))
    assert torch.equal(native[1], torch_ops[1])
