"""The native host Adam ([Note: native kernels, torch's bits] in tierzero/native/adam.py): the bits of
torch's fused CPU kernel for every variant the engine runs, the engine's training the same with the
library and without it, and a library that cannot be built or trusted never loaded."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from test_no_grad_read_ahead import SPEC, wide_gpt

import tierzero
import tierzero.optim.flat as flat
from tierzero.native import build
from tierzero.native.adam import NativeAdam, native_adam
from tierzero.units.slice_layout import cpu_vector_width

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")

LANES = cpu_vector_width()
HYPERS = {"lr": 3e-3, "eps": 1e-8}


def _kernel() -> NativeAdam:
    kernel = native_adam(LANES)
    assert kernel is not None, "the library is built and passes its bit check on this machine"
    return kernel


def _inputs(n: int, seed: int, grad_dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    p, m = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1
    v = torch.rand(n, generator=g) * 0.01
    grad = torch.randn(n, generator=g)
    if n > 8:  # the values a gradient may hold beyond the normal ones
        grad[:4] = torch.tensor([-0.0, 0.0, float("inf"), float("nan")])
        grad[5] = 1e-40  # subnormal
    return p, grad.to(grad_dtype), m, v


@pytest.mark.parametrize("n", [1, LANES - 1, LANES, LANES + 1, 1000, 2 * 65536 + 1, 4 * 65536 + 3])
@pytest.mark.parametrize("adamw", [True, False])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
@pytest.mark.parametrize(("grad_dtype", "scale"), [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.bfloat16, 0.3713), (torch.float32, 2.5)])
def test_the_kernel_gives_the_bits_of_torchs_fused_kernel(
    n: int, adamw: bool, weight_decay: float, grad_dtype: torch.dtype, scale: float
) -> None:
    kernel = _kernel()
    p, grad, m, v = _inputs(n, seed=n, grad_dtype=grad_dtype)
    start = p.clone()
    ours, theirs = [p.clone(), m.clone(), v.clone()], [p, m, v]
    torch_kernel = torch._fused_adamw_ if adamw else torch._fused_adam_
    for step in (1, 2, 9):
        cast = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        kernel.step(
            ours[0], grad, ours[1], ours[2], step=step, betas=(0.9, 0.999), weight_decay=weight_decay, adamw=adamw,
            lanes=LANES, scale=scale, cast=cast, **HYPERS,
        )  # fmt: skip
        wide = grad.to(torch.float32, copy=True)
        if scale != 1.0:
            wide.mul_(scale)
        torch_kernel(
            [theirs[0]], [wide], [theirs[1]], [theirs[2]], [], [torch.tensor(float(step))], beta1=0.9, beta2=0.999,
            weight_decay=weight_decay, amsgrad=False, maximize=False, **HYPERS,
        )  # fmt: skip
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        assert torch.equal(cast.view(torch.int16), theirs[0].to(torch.bfloat16).view(torch.int16))
    assert not torch.equal(ours[0], start)  # it stepped


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cast", [False, True])
def test_a_units_slots_in_one_call_give_the_bits_of_torchs_kernel_on_each_slot(grad_dtype: torch.dtype, cast: bool) -> None:
    """Slots of odd sizes, one across the threads' split, each with its learning rate and weight decay
    (two parameter groups), stepped by `step_slots` against torch's kernel on each slot alone."""
    kernel = _kernel()
    sizes = [LANES + 3, 1, 3 * 65536 + 5, 7, 1000]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    p, _, m, v = _inputs(sum(sizes) + 11, seed=7, grad_dtype=torch.float32)  # 11 elements of padding after the slots
    grads = [_inputs(k, seed=100 + k, grad_dtype=grad_dtype)[1] for k in sizes]
    lrs, decays = [3e-3, 1e-3, 3e-3, 1e-3, 3e-3], [0.1, 0.0, 0.1, 0.0, 0.1]
    ours, theirs = [p.clone(), m.clone(), v.clone()], [p.clone(), m.clone(), v.clone()]
    out = torch.full(p.shape, float("nan"), dtype=torch.bfloat16) if cast else None
    for step in (1, 2):
        kernel.step_slots(
            ours[0], grads, offsets, ours[1], ours[2], step=step, lrs=lrs, weight_decays=decays, betas=(0.9, 0.999),
            eps=1e-8, adamw=True, lanes=LANES, scale=0.37, cast=out,
        )  # fmt: skip
        for offset, grad, lr, decay in zip(offsets, grads, lrs, decays, strict=True):
            part = slice(offset, offset + grad.numel())
            torch._fused_adamw_(
                [theirs[0][part]], [grad.to(torch.float32, copy=True).mul_(0.37)], [theirs[1][part]], [theirs[2][part]], [],
                [torch.tensor(float(step))], lr=lr, beta1=0.9, beta2=0.999, weight_decay=decay, eps=1e-8, amsgrad=False,
                maximize=False,
            )  # fmt: skip
        for a, b in zip(ours, theirs, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert torch.equal(ours[0][-11:], p[-11:]), "the padding after the slots is left alone"
    if out is not None:
        stepped = sum(sizes)
        assert torch.equal(out[:stepped].view(torch.int16), theirs[0][:stepped].to(torch.bfloat16).view(torch.int16))
        assert out[stepped:].isnan().all()


def test_the_slots_call_refuses_mixed_gradients_and_slots_outside_the_parameter() -> None:
    kernel = _kernel()
    p, grad, m, v = _inputs(100, seed=0, grad_dtype=torch.float32)
    common = {"step": 1, "lrs": [1e-3] * 2, "weight_decays": [0.0] * 2, "betas": (0.9, 0.999), "eps": 1e-8, "adamw": True, "lanes": LANES}
    with pytest.raises(ValueError, match="must share one dtype"):
        kernel.step_slots(p, [grad[:50], grad[50:].bfloat16()], [0, 50], m, v, **common)
    with pytest.raises(ValueError, match="a slot of 60 elements at 50 outside a parameter of 100"):
        kernel.step_slots(p, [grad[:50], grad[:60]], [0, 50], m, v, **common)
    with pytest.raises(ValueError, match="2 gradients, 1 offsets"):
        kernel.step_slots(p, [grad[:50], grad[50:]], [0], m, v, **common)


def test_it_refuses_tensors_of_other_sizes_and_declines_what_it_does_not_build() -> None:
    kernel = _kernel()
    p, grad, m, v = _inputs(100, seed=0, grad_dtype=torch.float32)
    with pytest.raises(ValueError, match="a tensor of 99 elements beside a parameter of 100"):
        kernel.step(p, grad[:99], m, v, step=1, betas=(0.9, 0.999), weight_decay=0.0, adamw=True, lanes=LANES, **HYPERS)
    with pytest.raises(ValueError, match="moments must be contiguous host fp32"):
        kernel.step(p, grad, m.double(), v, step=1, betas=(0.9, 0.999), weight_decay=0.0, adamw=True, lanes=LANES, **HYPERS)
    assert not NativeAdam.supports(p, grad, beta1=0.3)  # torch's other lerp form
    assert not NativeAdam.supports(p.double(), grad, beta1=0.9)
    assert not NativeAdam.supports(p[::2], grad[::2], beta1=0.9)
    assert not NativeAdam.supports(p, grad.half(), beta1=0.9)
    assert NativeAdam.supports(p, grad.bfloat16(), beta1=0.9, cast=torch.empty(100, dtype=torch.bfloat16))


def _train(steps: int = 3) -> tuple[dict[str, torch.Tensor], int]:
    """A few clipped bf16 steps of a small GPT with every state in host memory; the weights and the
    number of native calls."""
    calls = 0

    def counted(method: Any) -> Any:
        def call(self: NativeAdam, *args: object, **kwargs: object) -> None:
            nonlocal calls
            calls += 1
            method(self, *args, **kwargs)

        return call

    cfg = {
        "zero": {"stage": 3}, "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.1}, "gradient_clipping": 0.5,
        "precision": {"param_dtype": "bf16"}, "offload": {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"},
    }  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(NativeAdam, "step", counted(NativeAdam.step))
        mp.setattr(NativeAdam, "step_many", counted(NativeAdam.step_many))
        with tierzero.initialize(wide_gpt(), cfg) as engine:
            for i in range(steps):
                ids = torch.randint(0, SPEC.vocab_size, (2, 12), generator=torch.Generator().manual_seed(i))
                _, loss = engine(ids, ids)
                engine.backward(loss)
                engine.step()
            return engine.full_state_dict(), calls


def test_the_engine_trains_to_the_same_bits_with_the_library_and_without(monkeypatch: pytest.MonkeyPatch) -> None:
    native, calls = _train()
    assert calls > 0, "the engine stepped through the native kernel"
    monkeypatch.setattr(flat, "native_adam", lambda lanes: None)
    fallback, none = _train()
    assert none == 0
    assert native.keys() == fallback.keys()
    for name, value in native.items():
        assert torch.equal(value, fallback[name]), name


def test_native_kernels_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERZERO_NATIVE", "0")
    build.library.cache_clear()
    native_adam.cache_clear()
    try:
        assert build.library() is None
        assert native_adam(LANES) is None
    finally:
        build.library.cache_clear()
        native_adam.cache_clear()


def test_a_failed_build_is_said_once_and_the_step_runs_torchs_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    failing = tmp_path / "cxx"
    failing.write_text("#!/bin/sh\necho 'cxx: error: out of luck' >&2\nexit 1\n")
    failing.chmod(0o755)
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_compiler", lambda: str(failing))
    build.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING):
            assert build.library() is None
        assert "native host kernels unavailable (cxx failed: ['cxx: error: out of luck'])" in caplog.text
        assert not list((tmp_path / "cache").rglob("*.so*"))  # nothing half-written left behind
        assert [p.name for p in (tmp_path / "cache" / "native").iterdir()] == []  # nor the objects' directory
    finally:
        build.library.cache_clear()


def test_a_library_others_may_write_is_never_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(tmp_path))
    first = build._built()
    assert first.parent == tmp_path / "native" and first.stat().st_mode & 0o777 == 0o700
    assert build._built() == first  # found, not built again
    os.chmod(first, 0o777)
    planted = first.stat().st_mtime_ns
    second = build._built()
    assert second != first or first.stat().st_mtime_ns != planted  # rebuilt: not the file others could write
    assert not second.stat().st_mode & 0o022
    os.chmod(tmp_path / "native", 0o777)  # a cache others may write into: built and loaded from a private directory
    build.library.cache_clear()
    try:
        before = set(Path(tempfile.gettempdir()).glob("tierzero-native-*"))
        lib = build.library()
        assert lib is not None and lib.tz_abi_version() == build.ABI_VERSION
        assert set(Path(tempfile.gettempdir()).glob("tierzero-native-*")) == before  # removed once loaded
    finally:
        build.library.cache_clear()


def test_processes_that_start_together_compile_the_library_once(tmp_path: Path) -> None:
    """A job's ranks on its first run: one compiles, the others wait for its library and load it."""
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    log = tmp_path / "compiles.log"
    cxx = tmp_path / "cxx"
    cxx.write_text(f'#!/bin/sh\n[ "$1" = --version ] || echo "$*" >> {log}\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    env = os.environ | {"TIERZERO_CACHE_DIR": str(tmp_path / "cache"), "CXX": str(cxx)}
    load = "from tierzero.native import build; lib = build.library(); print(lib is not None and lib.tz_abi_version())"
    ranks = [subprocess.Popen([sys.executable, "-c", load], env=env, stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [rank.communicate(timeout=300)[0].strip() for rank in ranks]
    assert outputs == [str(build.ABI_VERSION)] * 3
    assert sum("-shared" in line for line in log.read_text().splitlines()) == 1
