"""On a terminal, planning shows its replays as a tqdm bar (replays done of those planned, elapsed) instead of a line each."""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from tqdm import tqdm

import tierzero.cli.estimate as E
from tierzero.config import load_config
from tierzero.placement import planner, progress
from tierzero.placement.candidates import whole_kind


class _Recorded(tqdm):
    """A tqdm bar that keeps its starting total and every update it was given."""

    made: list[_Recorded] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.first_total, self.shown, self.updates = self.total, not self.disable, []
        _Recorded.made.append(self)

    def update(self, n: float | None = 1) -> bool | None:
        self.updates.append(n)
        return super().update(n)


def _config(tmp_path: Path) -> Path:
    swap = tmp_path / "swap"
    swap.mkdir()
    raw = {
        "zero": {"stage": 3, "unit_classes": ["Linear"]},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 128, "d_ff": 512, "max_seq_len": 32},
        "train": {"steps": 1, "micro_batch_size": 2, "seq_len": 32},
        "offload": {"params": "auto", "gradients": "auto", "optimizer": "auto"},
        "tiers": {"nvme": {"path": str(swap), "block_size": "64KiB", "queue_depth": 4}, "cpu": {"keep_freed": 0}},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(raw))
    (tmp_path / "bench.json").write_text(json.dumps({"best": {"read_GBps": 2.0, "write_GBps": 3.0}}))
    return path


def _estimate(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, terminal: bool) -> tuple[str, int]:
    """`tierzero estimate` of an auto placement, its stderr faked (a terminal or not); (stderr, replays run)."""
    path = _config(tmp_path)
    monkeypatch.setattr(planner, "measure_copy_rate", lambda: 5.0e9)
    monkeypatch.setattr(planner, "measure_step_rate", lambda *a, **k: 1.0e9)
    replays = []
    real = planner.estimate
    monkeypatch.setattr(planner, "estimate", lambda *a, **k: replays.append(1) or real(*a, **k))
    monkeypatch.setattr(progress, "tqdm", _Recorded)
    _Recorded.made = []
    err = io.StringIO()
    monkeypatch.setattr(err, "isatty", lambda: terminal, raising=False)
    monkeypatch.setattr(sys, "stderr", err)
    parser = argparse.ArgumentParser(prog="tierzero")
    E.add_estimate_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["estimate", "--config", str(path), "--flops", "100", "--nvme-bench", str(tmp_path / "bench.json")])
    assert E.run_estimate(args, out=io.StringIO()) == 0
    return err.getvalue(), len(replays)


def test_a_terminal_gets_one_bar_whose_total_and_updates_are_the_replays(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said, replays = _estimate(tmp_path, monkeypatch, terminal=True)
    assert replays > 1
    [bar] = _Recorded.made
    assert bar.first_total == len(whole_kind(load_config(str(tmp_path / "cfg.yaml"))))
    assert bar.total == replays and bar.n == replays
    assert sum(bar.updates) == replays and all(n >= 0 for n in bar.updates)
    assert bar.shown and bar.desc == "planning"
    # the replays are the bar's; the summary is still said, above it
    assert not re.search(r"planning: replay \d+", said)
    assert re.search(rf"planning: {replays} replays of \d+ placements in \d+\.\d s", said)
    assert f"{replays}/{replays}" in said


def test_elsewhere_each_replay_keeps_its_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    said, replays = _estimate(tmp_path, monkeypatch, terminal=False)
    assert not _Recorded.made
    lines = said.splitlines()
    each = [line for line in lines if re.fullmatch(r"planning: replay \d+, \d+\.\d s: .*", line)]
    assert 0 < len(each) <= replays
    assert lines[-1].startswith(f"planning: {replays} replays of ")
