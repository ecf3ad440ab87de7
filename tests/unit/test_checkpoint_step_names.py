"""Step directories are named in ASCII digits: a directory named "²" or "٣" (str.isdigit() is true of both,
and int() refuses the first) is no step, passed over by saves, pruning, listing and loading alike."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_checkpoint import config, make_model, train

import tierzero
from tierzero.checkpoint import list_checkpoints, save_checkpoint
from tierzero.checkpoint.find import find_checkpoint
from tierzero.checkpoint.manifest import is_step_name


def test_only_ascii_digits_name_a_step() -> None:
    assert [is_step_name(name) for name in ("12", "0", "²", "٣", "1²", "", "1a")] == [True, True, False, False, False, False, False]


@pytest.mark.parametrize("name", ["²", "٣"])
def test_a_non_ascii_digit_directory_is_no_step(tmp_path: Path, name: str) -> None:
    root = tmp_path / "ckpt"
    odd = root / name
    odd.mkdir(parents=True)
    (odd / "manifest.json").write_text("{}")
    with tierzero.initialize(make_model(), config(3)) as engine:
        saved = []
        for step in (1, 2):  # the first save, then a save that prunes (keep=1)
            train(engine, step - 1, step)
            saved.append(save_checkpoint(engine, root, keep=1))
    assert list_checkpoints(root) == [saved[1]] and not saved[0].exists()
    assert (odd / "manifest.json").read_text() == "{}"  # left alone
    assert find_checkpoint(root) == saved[1]
