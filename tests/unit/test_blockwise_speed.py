"""The table lookup of tierzero/units/code_tables.py gives torch.bucketize's codes, exactly, and far faster.

[Note: code tables] replaces a binary search per element with two lookups on the ratio's
high 16 bits. The reference here is the search itself: `torch.bucketize` of each ratio
against the midpoints of neighbouring codes rounded down to fp32, computed in this file from
the public code books. Ratios are fed with a 1.0 in their block, so the absmax is 1 and each
ratio is the element itself.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from tierzero.units.blockwise import NF4_CODE, dynamic_code, quantize_dynamic, quantize_nf4

CODES = {"signed": dynamic_code(signed=True), "unsigned": dynamic_code(signed=False), "nf4": NF4_CODE}


def _midpoints(code: tuple[float, ...]) -> torch.Tensor:
    """Each midpoint of neighbouring codes (exact in float64) rounded down to fp32."""
    exact = [(a + b) / 2 for a, b in zip(code[:-1], code[1:])]
    mids = np.array(exact, dtype=np.float32)
    below = np.where(mids.astype(np.float64) > np.array(exact), np.nextafter(mids, np.float32(-np.inf)), mids)
    return torch.from_numpy(below.astype(np.float32))


def _from_bits(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.float32).copy())


def _candidates(code: tuple[float, ...], *, signed: bool, seed: int) -> torch.Tensor:
    """Every table cell's two edges, every midpoint and 4 ulps either side, and 2M random bit patterns in [-1, 1]."""
    cells = np.arange(1 << 16, dtype=np.uint64) << 16
    edges = _from_bits(np.concatenate((cells, cells | 0xFFFF)))
    near = [_midpoints(code)]
    for direction in (-np.inf, np.inf):
        step = near[0].numpy()
        for _ in range(4):
            step = np.nextafter(step, np.float32(direction))
            near.append(torch.from_numpy(step.copy()))
    rng = np.random.default_rng(seed)
    magnitudes = rng.integers(0, 0x3F800001, size=2_000_000, dtype=np.uint64)  # 0x3F800000 is 1.0
    noise = _from_bits(magnitudes | rng.integers(0, 2, size=2_000_000, dtype=np.uint64) << 31)
    values = torch.cat([edges, *near, noise, torch.from_numpy(rng.uniform(-1, 1, 1_000_000).astype(np.float32))])
    values = values[torch.isfinite(values) & (values.abs() <= 1)]
    return values if signed else values[values >= 0]


def _quantized(name: str, ratios: torch.Tensor) -> torch.Tensor:
    """Code indices of `ratios`, all in one block with a 1.0 so that the absmax is 1."""
    x = torch.cat([torch.ones(1), ratios])
    if name == "nf4":
        x = torch.cat([x, torch.zeros(x.numel() % 2)])
        packed = quantize_nf4(x, block=x.numel()).codes
        return torch.stack((packed >> 4, packed & 0x0F), dim=1).reshape(-1)[1 : ratios.numel() + 1].long()
    codes, absmax = quantize_dynamic(x, signed=name == "signed", block=x.numel())
    assert absmax.tolist() == [1.0]
    return codes[1:].long()


@pytest.mark.parametrize("name", sorted(CODES))
def test_table_lookup_equals_bucketize(name: str) -> None:
    ratios = _candidates(CODES[name], signed=name != "unsigned", seed=len(name))
    assert ratios.numel() > (2_900_000 if name != "unsigned" else 1_450_000)
    expected = torch.bucketize(ratios, _midpoints(CODES[name]))
    got = _quantized(name, ratios)
    wrong = (got != expected).nonzero().reshape(-1)
    assert wrong.numel() == 0, [(float(ratios[i]), int(got[i]), int(expected[i])) for i in wrong[:5]]


def test_ratios_of_real_blocks_equal_bucketize() -> None:
    """Blocks with their own absmax: the codes are bucketize's of fl32(x / absmax), ties and all."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(1 << 20, generator=gen) * torch.exp(torch.randn(1 << 20, generator=gen) * 4)
    block = 2048
    codes, absmax = quantize_dynamic(x, signed=True, block=block)
    assert torch.equal(absmax, x.view(-1, block).abs().amax(dim=1))
    ratios = (x.view(-1, block) / absmax[:, None]).reshape(-1)
    assert torch.equal(codes.long(), torch.bucketize(ratios, _midpoints(CODES["signed"])))


def _cpu_seconds(fn) -> float:
    fn()
    times = []
    for _ in range(5):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return min(times)


def test_lookup_is_far_cheaper_than_the_search() -> None:
    """CPU time, not wall time, so a busy host slows both alike; the lookup measures 15x faster."""
    x = torch.randn(1 << 20)
    mids = _midpoints(CODES["signed"])

    def search() -> None:
        absmax = x.view(-1, 2048).abs().amax(dim=1)
        torch.bucketize(x.view(-1, 2048) / absmax[:, None], mids).to(torch.uint8)

    lookup = _cpu_seconds(lambda: quantize_dynamic(x, signed=True, block=2048))
    assert lookup * 4 < _cpu_seconds(search), (lookup, _cpu_seconds(search))
