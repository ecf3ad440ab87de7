"""A checkpoint root belongs to one run: its saves prune, count and replace only the steps its manifests sign.

Each manifest carries the run id of the engine that wrote it (a fresh engine draws one; a load
adopts the checkpoint's). Another run's steps, a foreign all-digit directory with a
`manifest.json` of its own, and a step directory with no manifest are left alone: never pruned,
never counted against `keep`, never replaced; and `tierzero train` refuses a fresh run in a
root that already holds a run's checkpoints, naming `--resume` and a fresh directory.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_checkpoint import config, make_model, train
from test_checkpoint_train import _config, _run

import tierzero
from tierzero.checkpoint import CheckpointWriteError, list_checkpoints, load_checkpoint, save_checkpoint, save_load
from tierzero.checkpoint.find import run_checkpoints, run_of
from tierzero.checkpoint.manifest import Manifest
from tierzero.cli.main import main

PHOTO = b"\xff\xd8\xff\xe0 a holiday photo"


def _foreign(root: Path, name: str) -> Path:
    """An all-digit directory another program made, with a manifest.json of its own and a photo."""
    directory = root / name
    directory.mkdir(parents=True)
    (directory / "manifest.json").write_text(json.dumps({"album": "summer", "photos": ["photo.jpg"]}))
    (directory / "photo.jpg").write_bytes(PHOTO)
    return directory


def test_saves_prune_and_count_only_their_own_run(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with tierzero.initialize(make_model(), config(3)) as first:
        train(first, 0, 5)
        theirs = save_checkpoint(first, root, keep=1)
    photos, year = _foreign(root, "7"), _foreign(root, "2024")
    with tierzero.initialize(make_model(), config(3)) as second:
        assert second.run_id != first.run_id
        saved = []
        for step in range(1, 4):
            train(second, step - 1, step)
            saved.append(save_checkpoint(second, root, keep=2))
        ours = run_checkpoints(root, second.run_id)
    # keep=2 counted this run's steps only: 2 and 3 stay, 1 went; the 2024 directory took no slot
    assert ours == saved[1:] and not saved[0].exists()
    assert run_of(theirs) == first.run_id and Manifest.read(theirs).step == 5  # the other run's step survives
    for directory in (photos, year):
        assert (directory / "photo.jpg").read_bytes() == PHOTO
    assert list_checkpoints(root) == [*saved[1:], theirs]  # the foreign directories are no checkpoints


def test_a_save_never_replaces_a_step_directory_it_did_not_write(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    photos = _foreign(root, "1")
    with tierzero.initialize(make_model(), config(3)) as engine:
        train(engine, 0, 1)
        with pytest.raises(CheckpointWriteError, match=rf"{photos} already exists and is not a checkpoint of this run: it is left alone"):
            save_checkpoint(engine, root)
    assert (photos / "photo.jpg").read_bytes() == PHOTO and sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["1"]


def test_a_resumed_engine_takes_the_run_of_its_checkpoint_and_replaces_its_own_steps(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    with tierzero.initialize(make_model(), config(3)) as first:
        train(first, 0, 2)
        saved = save_checkpoint(first, root)
        run = first.run_id
    with tierzero.initialize(make_model(), config(3)) as resumed:
        load_checkpoint(resumed, root)
        assert resumed.run_id == run
        assert save_checkpoint(resumed, root) == saved  # the same step again: its own, so replaced
    assert run_of(saved) == run and list_checkpoints(root) == [saved]


def test_a_fresh_run_in_a_used_root_is_refused_and_resume_continues_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = tmp_path / "ckpt"
    config_path = _config(tmp_path, ckpt)
    _run(config_path, "--steps", "2")
    before = sorted(p.name for p in ckpt.iterdir())
    assert main(["train", "--config", str(config_path), "--no-progress", "--steps", "4"]) == 2
    assert capsys.readouterr().err == (
        f"tierzero: error: checkpoint.dir {ckpt} already holds another run's checkpoints (steps 2): continue that run "
        "with --resume, or give this one a fresh checkpoint.dir\n"
    )
    assert sorted(p.name for p in ckpt.iterdir()) == before
    resumed = _run(config_path, "--resume", "--steps", "4")
    assert f"resumed from {ckpt / '2'} at step 2\n" in resumed
    assert [p.name for p in list_checkpoints(ckpt)] == ["2", "4"]


def test_ctrl_c_mid_save_leaves_no_half_written_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "ckpt"
    with tierzero.initialize(make_model(), config(3)) as engine:
        train(engine, 0, 1)
        saved = save_checkpoint(engine, root)
        train(engine, 1, 2)

        def interrupted(*args: object, **kwargs: object) -> None:
            raise KeyboardInterrupt

        monkeypatch.setattr(save_load, "_write_rank_files", interrupted)
        with pytest.raises(KeyboardInterrupt):
            save_checkpoint(engine, root)
    assert sorted(p.name for p in root.iterdir()) == ["1", "latest"]  # the close released the lock
    assert list_checkpoints(root) == [saved]


def test_a_save_prunes_old_copies_and_links_left_by_dead_saves(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text("not the run's")
    root.mkdir()
    (root / ".tmp-old-3-deadbeef").symlink_to(outside)  # a link: unlinked, never followed
    (root / ".tmp-old-4-feedface").symlink_to(tmp_path / "gone")  # a dangling one too
    (root / ".tmp-5-0badcafe").mkdir()  # a save killed before its rename
    with tierzero.initialize(make_model(), config(3)) as engine:
        train(engine, 0, 1)
        save_checkpoint(engine, root)
    assert sorted(p.name for p in root.iterdir()) == ["1", "latest"]
    assert (outside / "keep.txt").read_text() == "not the run's"
