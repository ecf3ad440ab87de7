"""Adam over compact moments in one native pass ([Note: one pass over compact moments] in
tierzero/native/moments.py): the bits of the torch window path (optim/windows.py) for int8 and bf16
moments, every gradient, scale, cast, group and tail, non-finite moments refused in the same words,
and the torch path where the kernel is missing or gives other bits."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable

import pytest
import torch

import tierzero.optim.flat as flat
import tierzero.optim.windows as windows
from tierzero.common.slices import Kind
from tierzero.native import build
from tierzero.native import moments as native_module
from tierzero.native.moments import NativeMoments, StoredMoment
from tierzero.optim.flat import FlatAdam, OptimizerSpec, OptimizerType
from tierzero.optim.moments import MOMENT_BLOCK, StateDtype
from tierzero.units.slice_layout import ParamGroup, SliceLayout

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

BLOCK = MOMENT_BLOCK
NUMELS = [37, 65, 1029, 7, 192, 1, 1023, 4096, 255, 1023, 120, 2 * BLOCK + 9]
"""A unit's tensors: tails of many lengths, tensors across blocks (12953 elements)."""
GROUPS = [0, 1, 0, 1, 1, 0, 0, 1, 0, 1, 0, 1]
HYPERS = [ParamGroup(lr=1e-2, weight_decay=0.1), ParamGroup(lr=3e-3, weight_decay=0.0)]
Run = tuple[torch.Tensor, dict[Kind, torch.Tensor], torch.Tensor | None]


def _kernel() -> NativeMoments:
    kernel = flat.native_moments_checked()
    assert kernel is not None, "the library is built and gives the torch path's bits on this machine"
    return kernel


def _grads(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * 0.1
    if n > 3 * BLOCK:
        g[BLOCK : 2 * BLOCK] = 0  # a block whose moments stay zero
        g[:5] = torch.tensor([-0.0, 1e-40, -3e-39, 1e15, -2e-20])  # signed zero, subnormals, a huge and a tiny value
    return g.to(dtype)


def _train(
    native: bool, *, n: int, dtype: StateDtype, adamw: bool, layout: SliceLayout | None, grad_dtype: torch.dtype,
    scale: float, cast: bool, steps: int = 3, grads: Callable[[int, int, torch.dtype], torch.Tensor] = _grads,
) -> Run:
    """`steps` steps of one slice through the optimizer's own routing; without the kernel where not `native`."""
    with pytest.MonkeyPatch.context() as mp:
        if not native:
            mp.setattr(flat, "native_moments_checked", lambda: None)
        return _steps(n=n, dtype=dtype, adamw=adamw, layout=layout, grad_dtype=grad_dtype, scale=scale, cast=cast, steps=steps, grads=grads)


def _steps(
    *, n: int, dtype: StateDtype, adamw: bool, layout: SliceLayout | None, grad_dtype: torch.dtype, scale: float, cast: bool,
    steps: int, grads: Callable[[int, int, torch.dtype], torch.Tensor],
) -> Run:
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW if adamw else OptimizerType.ADAM, lr=1e-2, state_dtype=dtype), HYPERS)
    param = torch.randn(n, generator=torch.Generator().manual_seed(n))
    states, out = opt.new_states(n), torch.zeros(n, dtype=torch.bfloat16) if cast else None
    for step in range(1, steps + 1):
        grad = grads(n, step, grad_dtype)
        if grad_dtype == torch.float32 and scale == 1.0 and not cast:
            opt.step(param=param, grad=grad, states=states, step=step, lr=[1e-2, 3e-3], layout=layout)
        else:
            opt.step_converting(param=param, grad=grad, scale=scale, states=states, step=step, lr=[1e-2, 3e-3], layout=layout, cast=out)
    return param, states, out


def _assert_same(ours: Run, theirs: Run) -> None:
    assert torch.equal(ours[0].view(torch.int32), theirs[0].view(torch.int32))
    for kind in theirs[1]:
        assert torch.equal(ours[1][kind].view(torch.uint8), theirs[1][kind].view(torch.uint8)), kind
    if theirs[2] is not None:
        assert ours[2] is not None and torch.equal(ours[2].view(torch.int16), theirs[2].view(torch.int16))


GRADIENTS = [(torch.float32, 1.0, False), (torch.bfloat16, 0.37, True), (torch.float32, 2.5, False), (torch.bfloat16, 1.0, True)]


@pytest.mark.parametrize("dtype", [StateDtype.INT8, StateDtype.BF16])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize(("grad_dtype", "scale", "cast"), GRADIENTS)
@pytest.mark.parametrize("window", [BLOCK, windows.WINDOW])
@pytest.mark.parametrize("offset", [None, 0, 41, 2 * BLOCK])
def test_the_kernel_gives_the_window_paths_bits(
    monkeypatch: pytest.MonkeyPatch, dtype: StateDtype, adamw: bool, grad_dtype: torch.dtype, scale: float, cast: bool,
    window: int, offset: int | None,
) -> None:
    """Slices cut anywhere in the unit, windows cut inside tensors: every element on the torch path's lane or tail."""
    monkeypatch.setattr(windows, "WINDOW", window)
    _kernel()
    total = sum(NUMELS)
    n = total + 31 - (offset or 0)  # padding past the last tensor
    layout = None if offset is None else SliceLayout.of(NUMELS, offset=offset, groups=GROUPS)
    args = {"n": n, "dtype": dtype, "adamw": adamw, "layout": layout, "grad_dtype": grad_dtype, "scale": scale, "cast": cast}
    _assert_same(_train(True, **args), _train(False, **args))


@pytest.mark.parametrize("n", [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, 3 * 65536 + 77])
@pytest.mark.parametrize("dtype", [StateDtype.INT8, StateDtype.BF16])
def test_any_length_and_threads(n: int, dtype: StateDtype) -> None:
    """Partial last blocks, a slice shorter than a vector, and one the kernel splits between three threads."""
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        args = {"n": n, "dtype": dtype, "adamw": True, "layout": None, "grad_dtype": torch.bfloat16, "scale": 0.5, "cast": True}
        _assert_same(_train(True, **args), _train(False, **args))
    finally:
        torch.set_num_threads(threads)


def test_bf16_moments_keep_the_torch_paths_nan_and_inf() -> None:
    def poisoned(n: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
        g = _grads(n, seed, torch.float32)
        g[[9, 100, 4000, 5001]] = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf")])
        return g.to(dtype)

    for grad_dtype, scale, cast in GRADIENTS:
        args = {"n": 9000, "dtype": StateDtype.BF16, "adamw": True, "layout": None, "grad_dtype": grad_dtype, "scale": scale, "cast": cast}
        ours, theirs = _train(True, grads=poisoned, **args), _train(False, grads=poisoned, **args)
        _assert_same(ours, theirs)
        assert bool(ours[0].isnan().any())  # the test compares non-finite bits


@pytest.mark.parametrize(
    ("where", "value"),
    [([7], float("nan")), ([3 * BLOCK + 5, 3 * BLOCK + 6, 5 * BLOCK], float("inf")), ([4 * BLOCK + 1], 1e30), ([2, 5 * BLOCK], -1e30)],
)
def test_non_finite_int8_moments_are_refused_in_the_torch_paths_words(
    monkeypatch: pytest.MonkeyPatch, where: list[int], value: float
) -> None:
    """NaN, inf (both moments), and 1e30 (exp_avg_sq alone overflows): the first window the torch path meets."""
    monkeypatch.setattr(windows, "WINDOW", 2 * BLOCK)
    messages, kernel = [], _kernel()
    for native in (True, False):
        monkeypatch.setattr(flat, "native_moments_checked", lambda use=native: kernel if use else None)
        opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-2, state_dtype=StateDtype.INT8))
        grad = torch.randn(6 * BLOCK + 3) * 0.1
        grad[where] = value
        with pytest.raises(ValueError, match="cannot be quantized") as info:
            opt.step(param=torch.zeros(grad.numel()), grad=grad, states=opt.new_states(grad.numel()), step=1, lr=1e-2)
        messages.append(str(info.value))
    assert messages[0] == messages[1]


def test_without_the_kernel_the_windows_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """TIERZERO_NATIVE=0, no compiler, or other bits: the torch path runs, to the same bits."""
    calls: list[int] = []
    step_windows = windows.step_windows

    def counted(*args: object, **kwargs: object) -> None:
        calls.append(1)
        step_windows(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(flat, "step_windows", counted)
    args = {"n": 5000, "dtype": StateDtype.INT8, "adamw": True, "layout": None, "grad_dtype": torch.bfloat16, "scale": 0.5, "cast": True}
    native = _train(True, **args)
    assert calls == []
    monkeypatch.setattr(flat, "native_moments", lambda: None)  # what the getter gives without a library
    monkeypatch.setattr(flat, "native_moments_checked", flat.native_moments_checked.__wrapped__)
    assert flat.native_moments_checked() is None
    fallback = _train(True, **args)  # the routing as it is: no kernel
    assert len(calls) == 3
    _assert_same(native, fallback)


def test_a_kernel_with_other_bits_is_not_used(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    kernel = _kernel()
    step: Callable[..., torch.Tensor | None] = NativeMoments.step

    def off_by_one_ulp(self: NativeMoments, param: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor | None:
        out = step(self, param, *args, **kwargs)
        param.view(torch.int32)[-1] += 1
        return out

    monkeypatch.setattr(NativeMoments, "step", off_by_one_ulp)
    with caplog.at_level(logging.INFO):
        assert flat.native_moments_checked.__wrapped__() is None
    assert "the native kernel for compact moments gives other bits than the torch path" in caplog.text
    monkeypatch.setattr(NativeMoments, "step", step)
    assert flat.native_moments_checked.__wrapped__() is kernel


def test_the_kernel_refuses_what_would_write_out_of_bounds() -> None:
    kernel = _kernel()
    n = 100
    fmt_args = {
        "lrs": [1e-3], "weight_decays": [0.0], "step": 1, "betas": (0.9, 0.999), "eps": 1e-8, "adamw": True,
        "block": BLOCK, "window": BLOCK,
    }  # fmt: skip
    param, grad = torch.zeros(n), torch.zeros(n)
    bf16 = StoredMoment(torch.zeros(n, dtype=torch.bfloat16))
    good = torch.tensor([[0, n, 96, 0]])
    kernel.step(param, grad, bf16, bf16, ranges=good, **fmt_args)
    for ranges, match in [
        (torch.tensor([[0, n + 1, 96, 0]]), "in order inside"),
        (torch.tensor([[50, n, 96, 0], [0, 50, 48, 0]]), "in order inside"),
        (torch.tensor([[0, n, 96, 1]]), "groups below 1"),
        (torch.tensor([[0, n, 96]]), "rows of 4"),
    ]:
        with pytest.raises(ValueError, match=match):
            kernel.step(param, grad, bf16, bf16, ranges=ranges, **fmt_args)
    with pytest.raises(ValueError, match="stored must be contiguous host torch.bfloat16 of 100 elements"):
        kernel.step(param, grad, StoredMoment(torch.zeros(99, dtype=torch.bfloat16)), bf16, ranges=good, **fmt_args)
    with pytest.raises(ValueError, match="offsets must be contiguous host torch.int32 of 32768"):
        codes, offsets = torch.zeros(n, dtype=torch.uint8), torch.zeros(5, dtype=torch.int32)
        int8 = StoredMoment(codes, absmax=torch.zeros(1), values=torch.zeros(256), offsets=offsets)
        kernel.step(param, grad, int8, int8, ranges=good, **fmt_args)
    assert not NativeMoments.supports(param, grad.half(), beta1=0.9)
    assert not NativeMoments.supports(param, grad, beta1=0.3)  # torch's other lerp form
    assert not NativeMoments.supports(param[::2], grad[::2], beta1=0.9)
    assert NativeMoments.supports(param, grad.bfloat16(), beta1=0.9, cast=torch.empty(n, dtype=torch.bfloat16))


def test_native_kernels_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERZERO_NATIVE", "0")
    build.library.cache_clear()
    native_module.native_moments.cache_clear()
    try:
        assert native_module.native_moments() is None
    finally:
        build.library.cache_clear()
        native_module.native_moments.cache_clear()


@pytest.mark.parametrize("n", [7, 13, 47, 1001])
def test_fp32_moments_converted_without_a_layout_keep_torchs_tail(monkeypatch: pytest.MonkeyPatch, n: int) -> None:
    """The native fp32 step of a slice without a layout: the last `n % width` elements in torch's scalar tail."""
    runs = []
    for native in (True, False):
        if not native:
            monkeypatch.setattr(flat, "native_adam", lambda lanes: None)
        opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=1e-2, weight_decay=0.1))
        gen = torch.Generator().manual_seed(n)
        param, states = torch.randn(n, generator=gen), opt.new_states(n)
        for step in (1, 2, 3):
            grad = torch.randn(n, generator=gen).bfloat16()
            opt.step_converting(param=param, grad=grad, scale=0.5, states=states, step=step, lr=1e-2)
        runs.append((param, states, None))
    _assert_same(*runs)
