"""One run per checkpoint root: a second is refused naming the holder, and the first's checkpoints survive."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

import pytest
from test_checkpoint import assert_same_params, config, make_model, train

import tierzero
from tierzero.checkpoint import (
    CheckpointDirError,
    CheckpointWriteError,
    RootLock,
    claim_root,
    list_checkpoints,
    load_checkpoint,
    probe_root,
    save_checkpoint,
)
from tierzero.checkpoint.directory import LOCK_FILE


def test_a_second_engine_on_the_same_root_is_refused_naming_the_holder(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    probe_root(root)
    with tierzero.initialize(make_model(), config(3)) as first, tierzero.initialize(make_model(), config(3)) as second:
        lock = claim_root(first, root)
        train(first, 0, 2)
        saved = save_checkpoint(first, root, keep=1)
        state = first.full_state_dict()
        with pytest.raises(CheckpointDirError) as caught:
            claim_root(second, root)
        assert str(caught.value) == (
            f"checkpoint.dir {root} is in use by another run (pid {os.getpid()} on {socket.gethostname()}): wait for it "
            "to end, or pick another checkpoint.dir; two runs on one directory delete each other's checkpoints"
        )
        assert list_checkpoints(root) == [saved]
        assert load_checkpoint(second, root) == saved  # the holder's checkpoint is intact
        assert_same_params(second.full_state_dict(), state)
        lock.release()
        lock.release()  # idempotent
        assert not (root / LOCK_FILE).exists()
        claim_root(second, root).release()  # free again once the first run has let go


def test_the_lock_is_the_kernels_and_goes_with_the_process(tmp_path: Path) -> None:
    # A lock file left by a run that died names a pid, but nobody holds it: the next run takes it.
    (tmp_path / LOCK_FILE).write_text("pid 999999 on elsewhere\n")
    lock = RootLock.acquire(tmp_path)
    assert lock.held and (tmp_path / LOCK_FILE).read_text() == f"pid {os.getpid()} on {socket.gethostname()}\n"
    lock.release()


def test_a_lock_taken_on_a_file_just_removed_is_taken_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Between our open and our flock the holder released: it removed the file we opened. Locking that
    # orphan would let a third run, which creates a new file, hold "the" lock at the same time.
    real_flock, removed = fcntl.flock, []

    def flock(fd: int, operation: int) -> None:
        real_flock(fd, operation)
        if not removed:
            removed.append(True)
            (tmp_path / LOCK_FILE).unlink()  # what a releasing holder does

    monkeypatch.setattr(fcntl, "flock", flock)
    lock = RootLock.acquire(tmp_path)
    assert len(removed) == 1 and (tmp_path / LOCK_FILE).exists()
    held = os.stat(tmp_path / LOCK_FILE)
    with pytest.raises(CheckpointDirError, match="is in use by another run"):
        RootLock.acquire(tmp_path)  # the file now on disk is the one locked
    lock.release()
    assert held.st_size > 0


def test_a_released_lock_leaves_nothing_behind(tmp_path: Path) -> None:
    with tierzero.initialize(make_model(), config(2)) as engine:
        lock = claim_root(engine, tmp_path)
        assert lock.held and (tmp_path / LOCK_FILE).exists()
        lock.release()
    assert list(tmp_path.iterdir()) == []


def test_engines_saving_through_the_api_hold_their_root_until_closed(tmp_path: Path) -> None:
    """`engine.save_checkpoint` claims its root on first use: a script without `tierzero train` is protected too."""
    root = tmp_path / "ckpt"
    first = tierzero.initialize(make_model(), config(3))
    with tierzero.initialize(make_model(), config(3)) as second:
        train(first, 0, 1)
        saved = first.save_checkpoint(root)
        first.save_checkpoint(root)  # the same engine again: it holds the lock already
        train(second, 0, 1)
        with pytest.raises(CheckpointDirError, match=rf"^checkpoint\.dir {root} is in use by another run \(pid {os.getpid()} "):
            second.save_checkpoint(root)
        assert list_checkpoints(root) == [saved]
        first.close()
        assert not (root / LOCK_FILE).exists()
        # Free once the first engine is closed, but its step 1 is another run's: left alone, never replaced.
        with pytest.raises(CheckpointWriteError, match=rf"{saved} already exists and is not a checkpoint of this run: it is left alone"):
            second.save_checkpoint(root)
        assert list_checkpoints(root) == [saved]
