"""The native host kernels' shared library: compiled from this folder's *.cpp (and their *.h) once per machine, then loaded.

The library is built with the C++ compiler at hand (`$CXX`, else `g++`, else `c++`) for this
CPU (`-march=native`) and kept in `$TIERZERO_CACHE_DIR/native/` (default `~/.cache/tierzero`)
under a name drawn from everything that shapes its code: the sources, the flags, the compiler's
version and the CPU's features. The sources compile side by side (2.6 s on the 2-core VM); a
second process finds the library there and compiles nothing. Processes that start together (a
torchrun job's ranks on its first run) take turns on a lock on the directory: the first compiles,
the others wait and load its library, where each used to compile its own. The library is compiled
to a private name and renamed into place, so none ever loads a half-written file.
A library there that this user does not own, or that others may write, is never loaded: it is
built again in a private directory, removed once the library is loaded.

The kernels' threads are torch's OpenMP team where torch runs on GNU OpenMP (its libgomp is found
among the process's mappings): the sources compile with `-fopenmp` and link that very runtime, so
`tz::parallel` (native/common.h) hands its parts to the workers torch's own kernels just used. Two
runtimes in one process would each keep a team of spinning workers; where torch's is another, or
none is found, the kernels start threads of their own, and so do calls from any thread but the main
one and calls in a fork()ed child, where the team it inherited has no threads behind it (a parallel
region there never returned).

Nothing here is required. Without a compiler, with `TIERZERO_NATIVE=0`, or when the build
fails, `library()` is None, the reason is logged once, and the engine steps with torch's own
kernels, which give the same bits ([Note: native kernels, torch's bits] in native/adam.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tierzero.common.cache_files import cache_path
from tierzero.common.safe_files import say_once, scratch_path
from tierzero.native.forks import forked, on_fork

__all__ = ["ABI_VERSION", "FLAGS", "library"]

SOURCES = tuple(sorted(Path(__file__).parent.glob("*.cpp")))
HEADERS = tuple(sorted(Path(__file__).parent.glob("*.h")))
FLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-ffp-contract=off", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-pthread")
"""Each source's compile flags (the link adds `-shared`). `-ffp-contract=off`: the compiler fuses no
multiply-add on its own, so the kernels round where their source says; `-fno-math-errno`: `sqrt`
vectorizes (no errno to set); `-fopenmp-simd`: the `omp simd` loops, without the runtime (`_openmp`)."""
ABI_VERSION = 1
"""`tz_abi_version()` of the source this module's callers are written against."""
_BUILD_SECONDS = 120
_PRIVATE = "tierzero-native-"
"""The prefix of a directory a library is built in when the cache holds no copy it can trust."""

log = logging.getLogger(__name__)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded library, or None where native kernels are off or cannot be built (said once)."""
    if os.environ.get("TIERZERO_NATIVE", "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        path = _built()
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError, _BuildError) as exc:
        say_once(log, f"tierzero: native host kernels unavailable ({exc}); the step runs torch's kernels")
        return None
    if path.parent.name.startswith(_PRIVATE):
        shutil.rmtree(path.parent, ignore_errors=True)  # loaded: the mapping outlives the file, nothing is left behind
    if lib.tz_abi_version() != ABI_VERSION:
        say_once(log, "tierzero: the native host kernels' library is of another version; the step runs torch's kernels")
        return None
    if forked():
        lib.tz_own_threads(1)
    return lib


def _own_threads_in_child() -> None:
    if library.cache_info().currsize and (lib := library()) is not None:
        lib.tz_own_threads(1)


on_fork(_own_threads_in_child)


class _BuildError(RuntimeError):
    pass


def _compiler() -> str:
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and (found := shutil.which(name)):
            return found
    raise _BuildError("no C++ compiler found: set CXX or install g++")


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            return next((line for line in info if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _openmp() -> Path | None:
    """The GNU OpenMP runtime loaded in this process (torch's), if exactly one is."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5 and "/libgomp" in line}
    except OSError:
        return None
    found = [Path(path) for path in paths if Path(path).name.startswith("libgomp") and ".so" in Path(path).name]
    return found[0] if len(found) == 1 and found[0].is_file() else None


def _built() -> Path:
    """The library's path, compiled first when no trusted copy is cached."""
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout
    runtime = _openmp()
    key = hashlib.sha256(
        "\0".join((
            *(s.read_text() for s in SOURCES + HEADERS), " ".join(FLAGS), version, platform.machine(), _cpu_features(),
            str(runtime),
        )).encode()
    ).hexdigest()[:20]  # fmt: skip
    name = f"tierzero_native-{key}.so"
    target = cache_path("native") / name
    if _trusted(target):
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        if _trusted_dir(target.parent):
            with _turn(target.parent):
                if not _trusted(target):  # else built by a process this one waited for
                    _compile(cxx, scratch_path(target), target, runtime)
            if _trusted(target):
                return target
    except OSError:
        pass
    private = Path(tempfile.mkdtemp(prefix=_PRIVATE)) / name
    try:
        _compile(cxx, scratch_path(private), private, runtime)
    except BaseException:
        shutil.rmtree(private.parent, ignore_errors=True)
        raise
    return private


@contextlib.contextmanager
def _turn(directory: Path) -> Iterator[None]:
    """This process's turn to build in `directory`: an exclusive lock on the directory itself (no lock
    file to leave behind), which the kernel lets go of when its holder exits, however it ends."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _compile(cxx: str, scratch: Path, target: Path, runtime: Path | None) -> None:
    """Build the library on `runtime`'s OpenMP team, or, where the compiler cannot (no omp.h), on threads of its own."""
    try:
        _compile_on(cxx, scratch, target, runtime)
    except _BuildError as exc:
        if runtime is None:
            raise
        say_once(log, f"tierzero: native host kernels built without OpenMP ({exc}); they start threads of their own")
        _compile_on(cxx, scratch, target, None)


def _compile_on(cxx: str, scratch: Path, target: Path, runtime: Path | None) -> None:
    """Compile each source apart, as many at once as there are cores (the five took 5.4 s one after
    another on the 2-core VM, 1.6 s the longest), link them into `scratch`, then move it to `target`.
    With `runtime`, OpenMP's: linked by its path (and found there again at load), not `-lgomp`'s."""
    objects = Path(tempfile.mkdtemp(prefix=".objects-", dir=scratch.parent))  # beside the library: the same owner and trust
    deadline = time.monotonic() + _BUILD_SECONDS
    try:
        openmp = [] if runtime is None else ["-fopenmp"]
        pending = [[cxx, *FLAGS, *openmp, "-c", str(source), "-o", str(objects / f"{source.stem}.o")] for source in SOURCES]
        with ThreadPoolExecutor(max_workers=max(1, min(len(pending), os.cpu_count() or 1))) as pool:
            for done in pool.map(lambda command: _run(command, deadline), pending):
                _check(cxx, done)
        link = [] if runtime is None else [str(runtime), f"-Wl,-rpath,{runtime.parent}"]
        _check(cxx, _run([cxx, *FLAGS, "-shared", *sorted(map(str, objects.glob("*.o"))), *link, "-o", str(scratch)], deadline))
        os.chmod(scratch, 0o700)
        os.replace(scratch, target)
    finally:
        scratch.unlink(missing_ok=True)
        shutil.rmtree(objects, ignore_errors=True)


def _run(command: list[str], deadline: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))


def _check(cxx: str, done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode != 0:
        raise _BuildError(f"{Path(cxx).name} failed: {done.stderr.strip().splitlines()[-1:] or done.returncode}")


def _trusted_dir(path: Path) -> bool:
    st = path.stat()
    return st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _trusted(path: Path) -> bool:
    """A regular file of this user's that only this user may write, in such a directory."""
    try:
        st = path.lstat()
    except OSError:
        return False
    return (
        stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        and _trusted_dir(path.parent)
    )  # fmt: skip
