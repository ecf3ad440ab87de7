"""What the planner says while it measures: `tierzero train` and `tierzero estimate` show each
measurement as it starts and ends, so a minute of planning is not a silent minute."""

from __future__ import annotations

import functools
import io
import logging
import os
import re
from pathlib import Path

import pytest

from tierzero.cli import train as T
from tierzero.config import load_config
from tierzero.placement import compute, disk, planner
from tierzero.placement.progress import said_to


def _raw(swap: Path) -> dict[str, object]:
    return {
        "zero": {"stage": 3, "unit_classes": ["Linear"]},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 128, "d_ff": 512, "max_seq_len": 32},
        "data": {"max_bytes": "256KiB"},
        "train": {"steps": 1, "micro_batch_size": 2, "seq_len": 32},
        "offload": {"params": "cpu", "gradients": "cpu", "optimizer": "auto"},
        "tiers": {"nvme": {"path": str(swap), "block_size": "64KiB", "queue_depth": 4}},
        "swapper": {"buffer_size": "64KiB", "buffer_count": 4},
    }


def test_train_says_each_measurement_of_the_plan_before_its_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk probed (faked: a real one moves 1 GiB), the block timed for real in a few pairs of
    windows beside a small stream, the replays: each said as it starts and as it ends, then the plan's table."""
    monkeypatch.setattr(disk, "probe", lambda path, nvme, **_: (2.0, 3.0))
    monkeypatch.setattr(compute, "streaming", functools.partial(disk.streaming, nbytes=1 << 20))
    monkeypatch.setattr(planner, "measure_compute", functools.partial(compute.measure_compute, seconds=0.05, limit=0.05))
    out = io.StringIO()
    T.train(load_config(_raw(tmp_path)), progress=False, out=out)
    lines = out.getvalue().splitlines()
    table = next(i for i, line in enumerate(lines) if line.startswith("placement (offload: auto)"))
    # Each replay is said as it ends (the placement, its time and its prediction or shortfall).
    each = [line for line in lines[:table] if re.fullmatch(r"planning: replay \d+, \d+\.\d s: params .*", line)]
    said = [line for line in lines[:table] if line not in each]
    where = re.escape(os.path.realpath(tmp_path))
    expected = [
        rf"planning: probing the disk at {where} for 8 s at 64\.0 KiB qd4 t8 pread: "
        r"none of its rates there are from the last 60 min",
        r"planning: the disk read 2\.00 GB/s, wrote 3\.00",
        r"planning: timing fp32 one gpt block's forward and backward at 2x32 tokens, cpu, "
        r"alone and beside the disk, up to about 0 s",
        r"planning: \d+ GFLOP/s alone, \d+\.\d\dx slower beside the disk, in \d+\.\d s",
        r"planning: replaying the step for each candidate placement",
        r"planning: \d+ replays of \d+ placements in \d+\.\d s",
    ]
    assert len(said) == len(expected), said
    for line, pattern in zip(said, expected):
        assert re.fullmatch(pattern, line), (line, pattern)
    replays, placements = map(int, re.findall(r"\d+", said[-1])[:2])
    assert replays >= placements > 1 and 0 < len(each) <= replays  # lowered prefetch budgets replay again
    # The lines go with the plan: the logger is left as it was found.
    root = logging.getLogger("tierzero.placement")
    assert not root.handlers and root.level == logging.NOTSET


def test_the_lines_are_said_only_inside_and_only_the_planners() -> None:
    root = logging.getLogger("tierzero.placement")
    root.setLevel(logging.WARNING)  # a caller's own setting, which the planning leaves as it was
    try:
        out = io.StringIO()
        logging.getLogger("tierzero.placement.disk").info("before")
        with said_to(out):
            logging.getLogger("tierzero.placement.disk").info("the disk read %.2f GB/s", 2.0)
            logging.getLogger("tierzero.placement.compute").debug("not at INFO")
            logging.getLogger("tierzero.prefetch").info("not the planner's")
        logging.getLogger("tierzero.placement.disk").info("after")
        assert out.getvalue() == "planning: the disk read 2.00 GB/s\n"
        assert root.level == logging.WARNING and not root.handlers
    finally:
        root.setLevel(logging.NOTSET)
