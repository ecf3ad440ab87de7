"""Fixtures shared by the test rooms."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tierzero.estimate import dry_run as dry_run_module


@pytest.fixture(scope="session")
def _native_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where every cache directory of the session finds the native library (tierzero/native/build.py):
    built once, not once a test by each process a test spawns, which cost 4 builds (22 s of CPU) a
    two-node torchrun test."""
    return tmp_path_factory.mktemp("native")


def _cache_dir(tmp_path_factory: pytest.TempPathFactory, native: Path, name: str) -> str:
    cache = tmp_path_factory.mktemp(name)
    (cache / "native").symlink_to(native, target_is_directory=True)
    return str(cache)


@pytest.fixture(autouse=True, scope="session")
def _session_disk_cache(tmp_path_factory: pytest.TempPathFactory, _native_dir: Path) -> Iterator[None]:
    """The same for what module fixtures run before `_disk_cache` (ranks spawned once for a module's tests)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIERZERO_CACHE_DIR", _cache_dir(tmp_path_factory, _native_dir, "session-cache"))
        yield


@pytest.fixture(autouse=True)
def _disk_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch, _native_dir: Path) -> None:
    """Disk rates remembered by a test (tierzero/placement/disk.py) go to a scratch directory, not ~/.cache;
    the native library is the session's (`_native_dir`)."""
    monkeypatch.setenv("TIERZERO_CACHE_DIR", _cache_dir(tmp_path_factory, _native_dir, "cache"))


@pytest.fixture(autouse=True)
def _fresh_dry_runs() -> None:
    """Each test replays its own dry runs: one may patch what the engine does, which the kept runs'
    keys (their arguments) cannot see. tests/unit/test_planner.py, which patches none of it, shares them."""
    dry_run_module._kept.clear()


@pytest.fixture(autouse=True)
def _single_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """No torchrun variables from the shell that runs pytest: a test is one process unless it spawns ranks."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def mount_tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mounts a size-limited tmpfs under tmp_path (`mount_tmpfs("2m")`), a real small disk.

    Needs root and mount(8): the test is skipped where mounting is not allowed. Every
    mount is undone after the test.
    """
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        if shutil.which("mount") is None or os.geteuid() != 0:
            pytest.skip("mounting a tmpfs needs root and mount(8)")
        path = tmp_path / f"tmpfs-{len(mounts)}"
        path.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", str(path)], check=True)
