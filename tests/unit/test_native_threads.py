"""The native kernels' threads (`tz::parallel` in tierzero/native/common.h, tierzero/native/build.py):
torch's own OpenMP team where torch runs on GNU OpenMP, threads of their own where it does not, the
same bits either way and however many threads a team comes with."""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tierzero.native import build
from tierzero.native.adam import NativeAdam
from tierzero.native.squares import BLOCK, LANES
from tierzero.units.slice_layout import cpu_vector_width

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")


def _mapped_runtimes() -> set[str]:
    with open("/proc/self/maps") as maps:
        return {line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5 and "/libgomp" in line}


def test_the_library_runs_on_the_openmp_runtime_torch_loaded() -> None:
    runtime = build._openmp()
    if runtime is None:
        pytest.skip("torch runs on no GNU OpenMP runtime here")
    assert build.library() is not None
    assert _mapped_runtimes() == {str(runtime)}  # one runtime, one team: none of the library's own


def _squares(lib: ctypes.CDLL, values: torch.Tensor, threads: int) -> float:
    state = torch.zeros(LANES + 2, dtype=torch.float64)
    fn = lib.tz_squares_bf16 if values.dtype == torch.bfloat16 else lib.tz_squares_f32
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int], None
    fn(values.data_ptr(), values.numel(), 3, state.data_ptr(), threads)
    lib.tz_squares_total.argtypes, lib.tz_squares_total.restype = [ctypes.c_void_p], ctypes.c_double
    return lib.tz_squares_total(state.data_ptr())


def _adam(lib: ctypes.CDLL, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    p, m, v = torch.randn(n, generator=g), torch.randn(n, generator=g) * 0.1, torch.rand(n, generator=g) * 0.01
    grad, cast = torch.randn(n, generator=g).to(torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    NativeAdam(lib).step(
        p, grad, m, v, step=3, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.1, eps=1e-8, adamw=True,
        lanes=cpu_vector_width(), scale=0.37, cast=cast,
    )  # fmt: skip
    return [p, m, v, cast]


def test_a_build_with_threads_of_its_own_gives_the_same_bits(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shared = build.library()
    assert shared is not None
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_openmp", lambda: None)
    own = ctypes.CDLL(str(build._built()))
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        values = torch.randn(5 * BLOCK + 77, generator=g).to(dtype)
        sums = {(id(lib), threads): _squares(lib, values, threads) for lib in (shared, own) for threads in (1, 2, 3)}
        assert len(set(sums.values())) == 1, sums
    n = 4 * 65536 + 5  # past one thread's least share: cut in parts
    ours, theirs = _adam(shared, n), _adam(own, n)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_a_team_smaller_than_asked_still_runs_every_part() -> None:
    """A thread limit of one: the team's one thread takes every part, and the library's probe (its sums
    against torch's ops' bits, on two threads among others) still passes, so the kernels stay on."""
    if build._openmp() is None:
        pytest.skip("torch runs on no GNU OpenMP runtime here")
    probe = "import torch; from tierzero.native import squares; torch.set_num_threads(4); print(squares._checked() is not None)"
    env = os.environ | {"OMP_THREAD_LIMIT": "1"}
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_a_compiler_without_openmp_builds_the_kernels_on_threads_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    if shutil.which("g++") is None:
        pytest.skip("needs g++")
    cxx = tmp_path / "cxx"
    cxx.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = -fopenmp ] && { echo "omp.h: No such file" >&2; exit 1; }; done\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "_compiler", lambda: str(cxx))
    monkeypatch.setattr(build, "_openmp", lambda: Path("/nonexistent/libgomp.so.1"))
    with caplog.at_level(logging.WARNING):
        lib = ctypes.CDLL(str(build._built()))
    assert "built without OpenMP (cxx failed: ['omp.h: No such file'])" in caplog.text
    values = torch.randn(3 * BLOCK, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    assert _squares(lib, values, 2) == _squares(lib, values, 1)


@pytest.mark.parametrize("before_fork", ["loaded", "imported", "tierzero"])
def test_a_forked_child_runs_the_kernels_on_threads_of_its_own(before_fork: str) -> None:
    """The team a child inherits across fork() has no threads behind it: a parallel region there never
    returned (a gloo test's ranks hung in the squares' probe). The child's sums are the parent's, whether
    the parent had loaded the kernels, imported their build, or only imported tierzero."""
    values = torch.randn(4 * BLOCK + 9, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    shared = build.library()
    assert shared is not None
    want = _squares(shared, values, 2)
    code = (
        "import os, sys, time, torch, tierzero\n"
        f"values = torch.randn({values.numel()}, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)\n"
        f"if {before_fork != 'tierzero'}: from tierzero.native import build; import test_native_threads as t\n"
        f"if {before_fork == 'loaded'}: t._squares(build.library(), values, 2)\n"
        "torch.randn(1 << 22).sum()  # torch's team busy just before the fork\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    from tierzero.native import build; import test_native_threads as t\n"
        "    os.write(w, repr(t._squares(build.library(), values, 2)).encode())\n"
        "    os._exit(0)\n"
        "for _ in range(600):\n"
        "    if os.waitpid(pid, os.WNOHANG)[0]:\n"
        "        print(os.read(r, 64).decode()); sys.exit(0)\n"
        "    time.sleep(0.05)\n"
        "os.kill(pid, 9); print('hung'); sys.exit(1)\n"
    )
    env = os.environ | {"PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert float(done.stdout.strip()) == want


def test_a_call_from_another_thread_starts_no_team_of_its_own() -> None:
    """Only the main thread's calls run on torch's team: another thread's would get a team of their own,
    whose workers stay and spin beside the main thread's; its calls start threads and join them."""
    lib = build.library()
    assert lib is not None
    values = torch.randn(4 * BLOCK, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    seen: dict[str, float] = {}

    def call() -> None:
        before = len(os.listdir("/proc/self/task"))
        seen["sum"] = _squares(lib, values, 2)
        seen["threads_left"] = len(os.listdir("/proc/self/task")) - before

    thread = threading.Thread(target=call)
    thread.start()
    thread.join()
    assert seen["threads_left"] == 0
    assert seen["sum"] == _squares(lib, values, 2)
