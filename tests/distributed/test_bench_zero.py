"""`tierzero bench zero` end to end on a tiny GPT: every contender timed at N=1 and N=2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tierzero.cli.bench.zero import TARGETS, bench_zero


def test_bench_zero_times_every_contender_at_both_world_sizes() -> None:
    result = bench_zero(d_model=64, n_layer=2, seq=16, batch=2, steps=2, warmup=1)
    assert set(result.medians) == {1, 2}
    assert list(result.medians[1]) == ["plain", "stage1", "stage2", "stage3"]
    assert list(result.medians[2]) == ["ddp", "stage1", "stage2", "stage3"]
    assert all(seconds > 0 for medians in result.medians.values() for seconds in medians.values())
    assert result.ratio(2, "ddp") == 1.0
    assert result.ratio(1, "stage3") == result.medians[1]["stage3"] / result.medians[1]["plain"]
    assert result.met() == all(result.ratio(n, s) <= t for n in (1, 2) for s, t in TARGETS.items())
    text = result.format()
    assert "N=2 stage3" in text and "(target <= 1.30)" in text
    assert json.loads(result.to_json())["medians"]["2"]["ddp"] == result.medians[2]["ddp"]


def test_bench_zero_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="steps >= 1"):
        bench_zero(steps=0)


def test_the_command_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "zero.json"
    args = ["bench", "zero", "--d-model", "64", "--layers", "1", "--seq", "8", "--batch", "2", "--steps", "1", "--warmup", "0"]
    done = subprocess.run(
        [sys.executable, "-m", "tierzero.cli", *args, "--json", str(out)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "N=1 plain" in done.stdout and "N=2 ddp" in done.stdout
    assert set(json.loads(out.read_text())["medians"]) == {"1", "2"}
