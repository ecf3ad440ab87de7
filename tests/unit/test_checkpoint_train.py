"""`tierzero train` saves checkpoints as configured and `--resume` continues exactly where one left off."""

from __future__ import annotations

import argparse
import io
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import tierzero.cli.train as T
from tierzero.checkpoint.format import dtype_from_name
from tierzero.checkpoint.manifest import Manifest
from tierzero.checkpoint.shards import ShardReader


def _run(config: Path, *args: str) -> str:
    parser = argparse.ArgumentParser(prog="tierzero")
    T.add_train_command(parser.add_subparsers(dest="command", required=True))
    out = io.StringIO()
    assert T.run_train(parser.parse_args(["train", "--config", str(config), "--no-progress", *args]), out=out) == 0
    return out.getvalue()


def _config(tmp_path: Path, ckpt: Path | None) -> Path:
    swap = tmp_path / "swap"
    swap.mkdir(exist_ok=True)
    raw: dict[str, Any] = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 3e-3},
        "precision": {"param_dtype": "bf16"},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32},
        "data": {"max_bytes": "256KiB"},
        "train": {"steps": 6, "micro_batch_size": 2, "seq_len": 32, "log_every": 1},
        "gradient_accumulation_steps": 2,
        "offload": {"optimizer": "nvme"},
        "tiers": {"nvme": {"path": str(swap)}},
        "checkpoint": {"dir": str(ckpt) if ckpt else None, "every": 2, "keep": 3},
    }
    path = tmp_path / f"config-{ckpt.name if ckpt else 'none'}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _logical(path: Path) -> dict[tuple[str, str], torch.Tensor]:
    manifest = Manifest.read(path)
    reader = ShardReader(path, manifest)
    return {
        (u.name, kind): reader.read(u, kind, 0, u.numel, out=torch.empty(u.numel, dtype=dtype_from_name(dtype, where="")))
        for u in manifest.units
        for kind, dtype in u.kinds.items()
    }


def _losses(text: str) -> dict[int, str]:
    return {int(step): loss for step, loss in re.findall(r"^step (\d+)/\d+ loss=([0-9.]+) ", text, flags=re.M)}


def test_resume_continues_bitwise_from_the_last_checkpoint(tmp_path: Path) -> None:
    unbroken, broken = tmp_path / "unbroken", tmp_path / "broken"
    full = _run(_config(tmp_path, unbroken))
    assert full.count("saved checkpoint") == 3
    first = _run(_config(tmp_path, broken), "--steps", "3")  # saves at 2 and after its last step, 3
    assert [p.name for p in sorted(broken.iterdir())] == ["2", "3", "latest"]
    resumed = _run(_config(tmp_path, broken), "--resume")
    assert f"resumed from {broken / '3'} at step 3\n" in resumed
    assert sorted(_losses(resumed)) == [4, 5, 6]
    assert {**_losses(first), **_losses(resumed)} == _losses(full)
    expected, actual = _logical(unbroken / "6"), _logical(broken / "6")
    assert expected.keys() == actual.keys()
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    assert [p.name for p in sorted(broken.iterdir())] == ["3", "4", "6", "latest"]  # keep 3: 2 went


def test_resume_needs_a_directory_and_a_checkpoint_in_it(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^--resume needs checkpoint.dir, where the checkpoints are: set it in the config"):
        _run(_config(tmp_path, None), "--resume")
    empty = tmp_path / "empty"
    with pytest.raises(FileNotFoundError, match=rf"^--resume found no complete checkpoint under {empty}: run without --resume"):
        _run(_config(tmp_path, empty), "--resume")


def test_resume_from_a_chosen_older_step_and_a_missing_one_lists_the_steps(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    full = _run(_config(tmp_path, ckpt))  # saves 2, 4 and 6
    expected = _logical(ckpt / "6")
    resumed = _run(_config(tmp_path, ckpt), "--resume", "2")
    assert f"resumed from {ckpt / '2'} at step 2\n" in resumed
    assert _losses(resumed) == {step: loss for step, loss in _losses(full).items() if step > 2}
    actual = _logical(ckpt / "6")
    assert all(torch.equal(expected[k], actual[k]) for k in expected)
    with pytest.raises(FileNotFoundError) as caught:
        _run(_config(tmp_path, ckpt), "--resume", "5")
    assert str(caught.value) == (
        f"--resume 5: no complete checkpoint of step 5 under {ckpt}; complete checkpoints under {ckpt}: steps 2, 4, 6"
    )


def test_resume_says_why_it_passed_over_the_newest_step(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    _run(_config(tmp_path, ckpt), "--steps", "4")  # saves 2 and 4
    (ckpt / "4" / "manifest.json").unlink()  # as a save killed before its manifest, or a manifest deleted
    resumed = _run(_config(tmp_path, ckpt), "--resume", "--steps", "3")  # step 4 would meet the passed-over directory
    assert resumed.startswith(
        f"loading {ckpt / '2'}, not the newer {ckpt / '4'}: it holds no manifest.json: its save never finished, "
        f"or the manifest was removed\nresumed from {ckpt / '2'} at step 2\n"
    )
