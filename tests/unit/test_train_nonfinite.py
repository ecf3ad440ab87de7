"""A NaN or inf loss stops `tierzero train` (exit 2) at the first (or after train.max_nonfinite in a row),
naming the step, with nothing saved or exported from it."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero.cli.train as T
from tierzero.cli.main import main
from tierzero.cli.resume import NonFiniteLoss, NonFiniteLosses

FIX = "the run stops and saves nothing from this step; lower optimizer.lr, check the data, or raise train.max_nonfinite, then --resume from the last checkpoint"


def _config(tmp_path: Path, *, lr: float = 1e-3, steps: int = 4, **train: Any) -> Path:
    raw = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": lr, "weight_decay": 0.0},
        "model": {"type": "gpt", "n_layer": 1, "n_head": 2, "d_model": 32, "d_ff": 64, "max_seq_len": 32},
        "data": {"max_bytes": "64KiB"},
        "train": {"steps": steps, "micro_batch_size": 2, "seq_len": 32, "log_every": 1, **train},
        "checkpoint": {"dir": str(tmp_path / "ckpt"), "every": 1, "keep": 10},
    }
    path = tmp_path / "run.json"
    path.write_text(json.dumps(raw))
    return path


def _poisoned(monkeypatch: pytest.MonkeyPatch, steps: set[int]) -> None:
    """The real micro-step, whose loss is reported as NaN at the given steps (from 1)."""
    real, calls = T.micro_step, [0]

    def micro_step(*args: Any, **kwargs: Any) -> torch.Tensor:
        loss = real(*args, **kwargs)
        calls[0] += 1
        return torch.full_like(loss, math.nan) if calls[0] in steps else loss

    monkeypatch.setattr(T, "micro_step", micro_step)


def test_a_diverging_run_stops_at_its_first_nan_loss_and_saves_nothing_from_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """lr 1e30: step 1's update overflows the weights, so step 2's loss is NaN, really."""
    summary = tmp_path / "summary.json"
    argv = ["train", "--config", str(_config(tmp_path, lr=1e30)), "--no-progress", "--summary-json", str(summary)]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err == f"tierzero: error: step 2/4: the loss is nan (train.max_nonfinite 1): {FIX}\n"
    assert "step 1/4 loss=" in captured.out and "step 2/4" not in captured.out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["1"]
    assert not summary.exists()


def test_tolerated_nonfinite_losses_are_not_saved_and_a_finite_one_resets_the_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _poisoned(monkeypatch, {2, 4})
    assert main(["train", "--config", str(_config(tmp_path, steps=5, max_nonfinite=2)), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "no checkpoint at step 2: its loss is nan\n" in out and "no checkpoint at step 4: its loss is nan\n" in out
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["1", "3", "5"]


def test_the_limit_in_a_row_stops_the_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    _poisoned(monkeypatch, {2, 3})
    assert main(["train", "--config", str(_config(tmp_path, steps=5, max_nonfinite=2)), "--no-progress"]) == 2
    assert capsys.readouterr().err == f"tierzero: error: step 3/5: the loss is nan (2 steps in a row) (train.max_nonfinite 2): {FIX}\n"
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.isdigit()) == ["1"]


def test_the_count_only_hears_the_loss() -> None:
    losses = NonFiniteLosses(limit=3)
    assert losses.saves(2.0, step=1, steps=9) and not losses.saves(math.inf, step=2, steps=9)
    assert not losses.saves(-math.inf, step=3, steps=9) and losses.saves(1.5, step=4, steps=9) and losses.in_a_row == 0
    with pytest.raises(NonFiniteLoss, match=r"^step 9/9: the loss is inf \(train.max_nonfinite 3\): "):
        losses.saves(math.inf, step=9, steps=9)  # the last step's: nothing after it would make up for it
