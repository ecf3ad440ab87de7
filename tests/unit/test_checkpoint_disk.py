"""A disk that fills during a save: the save fails cleanly, says so, and the previous checkpoint loads."""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint import config, make_model, train

import tierzero
import tierzero.checkpoint.format as fmt
from tierzero.checkpoint import CheckpointWriteError, list_checkpoints, load_checkpoint, save_checkpoint


def _save_fails_and_the_previous_checkpoint_survives(root: Path, *, before_second: Callable[[], None] = lambda: None) -> str:
    """Save step 1, then attempt step 2 (which must fail); returns the error text."""
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        train(engine, 0, 1)
        first = save_checkpoint(engine, root)
        saved = engine.full_state_dict()
        train(engine, 1, 2)
        before_second()
        with pytest.raises(CheckpointWriteError) as caught:
            save_checkpoint(engine, root)
        assert [p.name for p in root.iterdir() if p.name.startswith(".tmp-")] == []
        assert list_checkpoints(root) == [first]
        assert (root / "latest").read_text() == "1\n"
        assert load_checkpoint(engine, root) == first
        loaded = engine.full_state_dict()
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
        message = str(caught.value)
        assert "\n" not in message
        assert message.startswith(f"checkpoint of step 2 under {root} was not written (rank 0: ")
        assert message.endswith(f"the previous checkpoint {first} is intact and still loads: free space or pick another checkpoint.dir")
        return message


def test_enospc_in_the_middle_of_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    budget = [0]
    real_write = fmt.write_all

    def write_until_full(file: Any, data: Any) -> None:
        # The first save goes through; the second fails after its first 20 KB.
        if Path(file.name).parent.name.startswith(".tmp-2-"):
            budget[0] += len(data)
            if budget[0] > 20_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_write(file, data)

    monkeypatch.setattr(fmt, "write_all", write_until_full)
    message = _save_fails_and_the_previous_checkpoint_survives(tmp_path)
    assert "[Errno 28] No space left on device" in message


@pytest.fixture
def small_disk(mount_tmpfs) -> Path:
    """A 2 MiB tmpfs (root only; skipped where mounting is not allowed)."""
    return mount_tmpfs("2m")


def test_a_really_full_filesystem(small_disk: Path) -> None:
    root = small_disk / "ckpt"
    with tierzero.initialize(make_model(), config(3, dtype="bf16")) as engine:
        size = sum(f.stat().st_size for f in save_checkpoint(engine, small_disk / "probe").iterdir())
    shutil.rmtree(small_disk / "probe")

    def leave_room_for_half_a_checkpoint() -> None:
        stat = os.statvfs(small_disk)
        with open(small_disk / "filler", "wb") as f:
            f.write(b"\0" * (stat.f_bavail * stat.f_frsize - size // 2))

    message = _save_fails_and_the_previous_checkpoint_survives(root, before_second=leave_room_for_half_a_checkpoint)
    assert "[Errno 28] No space left on device" in message
