"""The checkpoint root a run writes: probed before any step, errors that say what failed, private files."""

from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_checkpoint import config, make_model, train
from test_train import _tiny_config

import tierzero
import tierzero.checkpoint.format as fmt
import tierzero.cli.train as T
from tierzero.checkpoint import (
    CheckpointWriteError,
    list_checkpoints,
    load_checkpoint,
    probe_root,
    save_checkpoint,
)
from tierzero.cli.main import main


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often `tierzero train` built an engine and ran a step."""
    calls = {"engines": 0, "steps": 0}
    real_initialize, real_step = T.initialize, T._train_step

    def initialize(*args: Any, **kwargs: Any) -> Any:
        calls["engines"] += 1
        return real_initialize(*args, **kwargs)

    def step(*args: Any, **kwargs: Any) -> float:
        calls["steps"] += 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(T, "initialize", initialize)
    monkeypatch.setattr(T, "_train_step", step)
    return calls


def _train(config_path: Path, root: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`tierzero train` with checkpoint.dir=root; (exit code, stderr)."""
    rc = main(["train", "--config", str(config_path), "--steps", "3", "--no-progress", "--set", f"checkpoint.dir={root}"])
    return rc, capsys.readouterr().err


def test_a_file_in_the_way_stops_the_run_before_the_engine_is_built(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], counted: dict[str, int]
) -> None:
    config_path, _ = _tiny_config(tmp_path, nvme=False)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    rc, err = _train(config_path, blocker / "ck", capsys)
    assert rc == 2
    assert err == (
        f"tierzero: error: checkpoint.dir {blocker / 'ck'}: cannot create the directory (a file stands where a directory "
        f"is needed at {blocker}): move that file or pick another checkpoint.dir\n"
    )
    assert counted == {"engines": 0, "steps": 0}
    rc, err = _train(config_path, blocker, capsys)  # the root itself is the file
    assert rc == 2 and "cannot create the directory (a file stands where a directory is needed)" in err


@pytest.fixture
def read_only(mount_tmpfs: Callable[[str], Path]) -> Iterator[Path]:
    """A real read-only file system (a tmpfs remounted ro; skipped where mounting is not allowed)."""
    path = mount_tmpfs("1m")
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
    yield path
    subprocess.run(["mount", "-o", "remount,rw", str(path)], check=True)


def test_a_read_only_file_system_is_named(
    tmp_path: Path, read_only: Path, capsys: pytest.CaptureFixture[str], counted: dict[str, int]
) -> None:
    config_path, _ = _tiny_config(tmp_path, nvme=False)
    rc, err = _train(config_path, read_only / "ck", capsys)
    assert rc == 2
    assert err == (
        f"tierzero: error: checkpoint.dir {read_only / 'ck'}: cannot create the directory (the file system is read-only): "
        "remount it read-write or pick another checkpoint.dir\n"
    )
    rc, err = _train(config_path, read_only, capsys)  # it exists: the probe finds it cannot write in it
    assert rc == 2 and err.endswith(f"{read_only}: cannot create a directory in it (the file system is read-only): remount it read-write or pick another checkpoint.dir\n")
    assert counted == {"engines": 0, "steps": 0}


def _probe_as_another_user(root: Path) -> str:
    """probe_root(root) in a child that cannot write `root` (root drops to nobody); its error message."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave, whatever happens
        message = "no error"
        try:
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            probe_root(root)
        except BaseException as exc:  # noqa: BLE001 - sent to the parent
            message = f"{type(exc).__name__}: {exc}"
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        message = f.read()
    os.waitpid(pid, 0)
    return message


@pytest.fixture
def theirs() -> Iterator[Path]:
    """A directory the probing user can enter but not write: outside pytest's own 0700 tree."""
    path = Path(tempfile.mkdtemp(prefix="tierzero-theirs-"))
    path.chmod(0o755 if os.geteuid() == 0 else 0o555)
    yield path
    path.chmod(0o755)
    shutil.rmtree(path)


def test_permission_denied_is_named(theirs: Path) -> None:
    message = _probe_as_another_user(theirs)
    assert message == (
        f"CheckpointDirError: checkpoint.dir {theirs}: cannot create a directory in it (permission denied): "
        "make it writable by this user or pick another checkpoint.dir"
    )
    assert list(theirs.iterdir()) == []


def test_too_little_space_is_found_before_the_first_step(
    tmp_path: Path, mount_tmpfs: Callable[[str], Path], capsys: pytest.CaptureFixture[str], counted: dict[str, int]
) -> None:
    small = mount_tmpfs("1m")
    config_path, swap = _tiny_config(tmp_path, nvme=True)
    rc, err = _train(config_path, small / "ck", capsys)
    assert rc == 2
    assert re.fullmatch(
        rf"tierzero: error: checkpoint.dir {small / 'ck'} has [0-9.]+ KiB free, a checkpoint of this run takes about "
        r"[0-9.]+ MiB: free space or pick another checkpoint.dir\n", err
    ), err
    assert counted == {"engines": 1, "steps": 0}
    assert list(swap.iterdir()) == []  # the engine was closed
    assert list((small / "ck").iterdir()) == []  # no probe, no lock file left


@pytest.mark.parametrize(
    ("code", "fix"),
    [
        (errno.EACCES, "make it writable by this user or pick another checkpoint.dir"),
        (errno.EIO, "check the disk (dmesg) or pick another checkpoint.dir"),
        (errno.ENOSPC, "free space or pick another checkpoint.dir"),
    ],
)
def test_a_failed_save_says_what_to_do_about_what_failed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, fix: str) -> None:
    def fail(file: Any, data: Any) -> None:
        raise OSError(code, os.strerror(code))

    with tierzero.initialize(make_model(), config(2)) as engine:
        train(engine, 0, 1)
        first = save_checkpoint(engine, tmp_path)
        train(engine, 1, 2)
        monkeypatch.setattr(fmt, "write_all", fail)
        with pytest.raises(CheckpointWriteError) as caught:
            save_checkpoint(engine, tmp_path)
    assert str(caught.value) == (
        f"checkpoint of step 2 under {tmp_path} was not written (rank 0: [Errno {code}] {os.strerror(code)}); "
        f"the previous checkpoint {first} is intact and still loads: {fix}"
    )


def test_a_save_onto_a_file_system_gone_read_only_says_so(mount_tmpfs: Callable[[str], Path]) -> None:
    disk = mount_tmpfs("4m")
    with tierzero.initialize(make_model(), config(2)) as engine:
        train(engine, 0, 1)
        first = save_checkpoint(engine, disk)
        train(engine, 1, 2)
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        try:
            with pytest.raises(CheckpointWriteError, match=r"\[Errno 30\] Read-only file system") as caught:
                save_checkpoint(engine, disk)
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True)
        assert str(caught.value).endswith(f"the previous checkpoint {first} is intact and still loads: remount it read-write or pick another checkpoint.dir")
        assert list_checkpoints(disk) == [first] and load_checkpoint(engine, disk) == first


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.mark.usefixtures("umask_022")
def test_checkpoint_files_are_0600_and_directories_0700(tmp_path: Path) -> None:
    root = tmp_path / "new" / "ckpt"
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        train(engine, 0, 1)
        step = save_checkpoint(engine, root)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in [root, step, *root.iterdir(), *step.iterdir()]}
    assert modes == {
        "ckpt": 0o700, "1": 0o700, "latest": 0o600,
        "manifest.json": 0o600, "rank-00000.json": 0o600, "rank-00000.safetensors": 0o600,
    }


def test_a_planted_symlink_is_never_written_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Names a local attacker could guess (the old pointer's temp file was named by the pid): planted
    # as symlinks to a file of the victim's, the save must refuse them rather than write through them.
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    root = tmp_path / "ckpt"
    with tierzero.initialize(make_model(), config(2)) as engine:
        train(engine, 0, 1)
        save_checkpoint(engine, root)
        train(engine, 1, 2)
        names = iter(["beef", "cafe"])  # the temp directory's name, then the pointer's temp file's
        monkeypatch.setattr(secrets, "token_hex", lambda n: next(names))
        for name in (".latest.tmp-cafe", f".latest.tmp-{os.getpid()}"):
            (root / name).symlink_to(victim)
        with pytest.raises(CheckpointWriteError, match="File exists"):
            save_checkpoint(engine, root)
    assert victim.read_text() == "precious\n"
    assert (root / "latest").read_text() == "1\n"
    with pytest.raises(FileExistsError):
        fmt.create_file(root / ".latest.tmp-cafe")
