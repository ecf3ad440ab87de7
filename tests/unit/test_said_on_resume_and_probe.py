"""The numbers a resume shows and the blame a full disk gets: a resume under another
gradient_accumulation_steps shows the steps it saves under; a resume past `--steps` says the run is
already complete (exit 0, no steps trained); `offload: auto` on a disk too small for its own 1 GiB
probe says so, naming the disk's free space and the probe, not `tiers.nvme.capacity`."""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_train_said import TINY  # a 26,368-parameter GPT

from tierzero.cli.main import main
from tierzero.common.sizes import format_size
from tierzero.placement.disk import PROBE_BYTES, probe


def _train(capsys: pytest.CaptureFixture[str], config: Path, *args: str) -> tuple[int, str, str]:
    rc = main(["train", "--config", str(config), "--no-progress", *args])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def _shown(out: str) -> tuple[list[str], list[str]]:
    """The steps shown ('5/6') and the checkpoints saved ('6'), in order."""
    return re.findall(r"^step (\d+/\d+) ", out, flags=re.M), re.findall(r"^saved checkpoint .*/(\d+)$", out, flags=re.M)


def test_a_resume_under_another_accumulation_counts_the_steps_it_saves_under(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "ck"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(TINY | {"checkpoint": {"dir": str(root), "every": 2}}))
    rc, out, _ = _train(capsys, config)
    assert rc == 0 and _shown(out) == (["1/4", "2/4", "3/4", "4/4"], ["2", "4"])
    rc, out, _ = _train(capsys, config, "--resume", "--steps", "6", "--set", "gradient_accumulation_steps=2")
    assert rc == 0 and out.startswith(f"resumed from {root / '4'} at step 4\n")
    assert _shown(out) == (["5/6", "6/6"], ["6"])  # was: "resumed at step 2", steps 3/6 to 6/6, saved 6 and 8
    # back to one micro-step a step: 6 steps done, whatever the accumulation of the run that did them
    rc, out, _ = _train(capsys, config, "--resume", "--steps", "8")
    assert rc == 0 and out.startswith(f"resumed from {root / '6'} at step 6\n")
    assert _shown(out) == (["7/8", "8/8"], ["8"])


def test_a_resume_past_steps_says_the_run_is_already_complete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ck"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(TINY | {"checkpoint": {"dir": str(root)}}))
    assert _train(capsys, config)[0] == 0
    rc, out, err = _train(capsys, config, "--resume", "--steps", "3")
    assert (rc, err) == (0, "")
    assert out == (
        f"resumed from {root / '4'} at step 4\n"
        "the run is already complete at step 4 (train.steps 3): nothing to train; raise train.steps (or --steps) to train further\n"
    )
    assert sorted(p.name for p in root.iterdir()) == ["4", "latest"]


def _small_disk(monkeypatch: pytest.MonkeyPatch, free: int) -> None:
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: type(usage)(usage.total, usage.total - free, free))


def test_a_disk_too_small_for_the_probe_blames_the_probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    free = 300 << 20
    _small_disk(monkeypatch, free)
    with pytest.raises(OSError) as info:
        probe(tmp_path)
    assert str(info.value) == (
        f"offload: auto measures the disk at {tmp_path} with a {format_size(PROBE_BYTES)} probe file, and it has "
        f"{format_size(free)} free: free space there, pick another tiers.nvme.path, or name each offload tier instead of auto"
    )
    assert "tiers.nvme.capacity" not in str(info.value) and list(tmp_path.iterdir()) == []


def test_train_with_offload_auto_on_a_small_disk_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIERZERO_CACHE_DIR", str(tmp_path / "cache"))  # nothing remembered: the disk is probed
    swap = tmp_path / "swap"
    swap.mkdir()
    raw: dict[str, Any] = TINY | {"offload": "auto", "tiers": {"nvme": {"path": str(swap)}}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(raw))
    _small_disk(monkeypatch, 300 << 20)
    rc, _, err = _train(capsys, config)
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(f"tierzero: error: offload: auto measures the disk at {swap} with a {format_size(PROBE_BYTES)} probe file")
    assert list(swap.iterdir()) == []
