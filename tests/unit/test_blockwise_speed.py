"""The table lookup of tierzero/units/code_tables.py gives torch.bucketize's codes, exactly.

How much faster it is belongs to the benchmarks (docs/benchmarks-journal.md, sessions 29 and 30),
not to a timed test: under a parallel suite the OpenMP threads' spinning swamps it.

[Note: code tables] replaces a binary search per element with one lookup on the high 16 bits
of the ratio's bits (flipped when negative). The reference here is the search itself:
`torch.bucketize` of each ratio against the midpoints of neighbouring codes rounded down to
fp32, computed in this file from the public code books. Ratios are fed with a 1.0 in their
block, so the absmax is 1 and each ratio is the element itself. Then the int8 moments' host
step, window by window ([Note: stepping in the cache]): its buffers are the slice's, never
a window's, and each window gathers once per moment and direction.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import tierzero.optim.flat as flat
import tierzero.optim.windows as windows
from tierzero.optim.flat import FlatAdam, OptimizerSpec, OptimizerType
from tierzero.optim.moments import StateDtype
from tierzero.units.blockwise import NF4_CODE, dequantize_dynamic, dynamic_code, quantize_dynamic, quantize_nf4

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


def _special_blocks(signed: bool) -> torch.Tensor:
    """Blocks of 2048 that corner the ratio: zeros, negative zeros, subnormals only, one subnormal absmax
    among zeros, huge values, and mixed magnitudes; exp_avg_sq's are the magnitudes."""
    gen = torch.Generator().manual_seed(11)
    noise = torch.randn(2048, generator=gen)
    blocks = [
        torch.zeros(2048),
        -torch.zeros(2048),
        noise * 1e-41,
        torch.cat([torch.full((1,), 1e-45), torch.zeros(2047)]),
        noise / noise.abs().max() * 3e38,
        noise * torch.exp(torch.randn(2048, generator=gen) * 6),
    ]
    x = torch.cat(blocks)
    return x if signed else x.abs()


@pytest.mark.parametrize("signed", [True, False])
def test_corner_blocks_equal_bucketize(signed: bool) -> None:
    x = _special_blocks(signed)
    codes, absmax = quantize_dynamic(x, signed=signed, block=2048)
    blocks = x.view(-1, 2048)
    assert torch.equal(absmax, blocks.abs().amax(dim=1))
    ratios = torch.where(absmax[:, None] > 0, blocks / absmax[:, None], torch.zeros_like(blocks)).reshape(-1)
    name = "signed" if signed else "unsigned"
    assert torch.equal(codes.long(), torch.bucketize(ratios, _midpoints(CODES[name])))
    zero = CODES[name].index(0.0)
    assert codes[: 2 * 2048].eq(zero).all() and codes[3 * 2048 + 1 : 4 * 2048].eq(zero).all()


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("bad", [float("nan"), -float("nan"), float("inf"), -float("inf")])
def test_non_finite_ratios_stay_in_the_table_and_are_refused(signed: bool, bad: float) -> None:
    """inf / inf makes a NaN of either sign: refused by its absmax, before any lookup (not an IndexError)."""
    x = torch.ones(5000)
    x[4097] = bad
    with pytest.raises(ValueError, match="1 inf/NaN of 5000"):
        quantize_dynamic(x, signed=signed, block=2048)


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("numel", [4096, 4095, 1])
def test_dequantize_two_codes_a_lookup_or_one(offset: int, numel: int) -> None:
    """Pairs where the codes and the output start even, single codes elsewhere: the values either way."""
    x = torch.randn(numel + offset, generator=torch.Generator().manual_seed(numel))
    codes, absmax = quantize_dynamic(x[offset:], signed=True, block=256)
    shifted = torch.cat([torch.zeros(offset, dtype=torch.uint8), codes])[offset:]
    assert shifted.storage_offset() == offset
    expected = torch.tensor(CODES["signed"])[codes.long()] * absmax.repeat_interleave(256)[:numel]
    out = torch.empty(numel + offset)[offset:]
    assert torch.equal(dequantize_dynamic(shifted, absmax, signed=True, block=256, out=out), expected)
    assert torch.equal(dequantize_dynamic(codes, absmax, signed=True, block=256), expected)


class _Calls(TorchDispatchMode):
    """Each aten op's name, and the numel of each tensor it returned in storage none of its arguments holds."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.allocated: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        held = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        out = func(*args, **kwargs)
        self.ops.append(func.overloadpacket.__name__)
        fresh = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in held]
        self.allocated += [t.numel() for t in fresh]
        return out


def _torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The windows in torch ops, as they run without the native kernels (tests/unit/test_native_moments.py checks those)."""
    monkeypatch.setattr(flat, "_native_for", lambda *args, **kwargs: None)
    monkeypatch.setattr(flat, "native_moments_checked", lambda: None)


def _int8_step_calls(windows_per_slice: int) -> _Calls:
    window = windows.WINDOW
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-3, weight_decay=0.1, state_dtype=StateDtype.INT8))
    param = torch.randn(windows_per_slice * window)
    states = opt.new_states(param.numel())
    grad = torch.randn(param.numel()).bfloat16()
    with _Calls() as calls:
        opt.step_converting(param=param, grad=grad, scale=0.5, states=states, step=1, lr=1e-3)
    return calls


def test_the_int8_window_step_allocates_once_a_slice_and_gathers_once_a_moment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(windows, "WINDOW", 8 * 2048)
    _torch_path(monkeypatch)  # whose calls are counted here
    two, five = _int8_step_calls(2), _int8_step_calls(5)
    for calls, n in ((two, 2), (five, 5)):
        assert calls.ops.count("index_select") == 4 * n  # per window: two dequantizes, two quantizes
        assert calls.ops.count("_fused_adamw_") == n
    big = [[numel for numel in calls.allocated if numel >= 2048] for calls in (two, five)]
    assert big[0] == big[1] and len(big[0]) >= 6  # two moments, the grad and three scratch buffers


def test_the_host_windows_run_on_one_thread_and_give_the_setting_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Short ops wait on a busy second core more than they gain from it ([Note: stepping in the cache])."""
    seen: list[int] = []
    pieces = windows.window_pieces
    monkeypatch.setattr(windows, "window_pieces", lambda *args: seen.append(torch.get_num_threads()) or pieces(*args))
    monkeypatch.setattr(windows, "WINDOW", 2048)
    _torch_path(monkeypatch)
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-3, state_dtype=StateDtype.INT8))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        opt.step(param=torch.randn(5000), grad=torch.randn(5000), states=opt.new_states(5000), step=1, lr=1e-3)
        assert seen == [1, 1, 1] and torch.get_num_threads() == 2
        grad = torch.randn(5000)
        grad[4500] = float("nan")
        with pytest.raises(ValueError, match="1 of the exp_avg values of elements 4096-5000"):
            opt.step(param=torch.randn(5000), grad=grad, states=opt.new_states(5000), step=1, lr=1e-3)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
