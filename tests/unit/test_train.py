"""`tierzero train` and `tierzero demo` end to end on tiny models, and the summary table."""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import re
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

import tierzero.cli.train as T
from tierzero.cli import run_summary
from tierzero.config import load_config
from tierzero.offload.disk.busy import Busy
from tierzero.store.tiered import TieredStore
from tierzero.units import kernels
from tierzero.units.kernels import chosen, onednn_available

REPO = Path(__file__).resolve().parents[2]
MiB = 1 << 20


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tierzero")
    commands = parser.add_subparsers(dest="command", required=True)
    T.add_train_command(commands)
    T.add_demo_command(commands)
    return parser.parse_args(argv)


def _tiny_config(tmp_path: Path, *, nvme: bool, **train: Any) -> tuple[Path, Path]:
    swap = tmp_path / "swap"
    swap.mkdir()
    raw: dict[str, Any] = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 3e-3, "weight_decay": 0.0},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 64},
        "data": {"max_bytes": "1MiB"},
        "train": {"steps": 20, "micro_batch_size": 4, "seq_len": 64, "log_every": 5, **train},
        "tiers": {"device": {"capacity": "8MiB"}},
    }
    if nvme:
        raw["offload"] = {"params": "nvme", "optimizer": "nvme", "gradients": "cpu"}
        raw["tiers"]["nvme"] = {"path": str(swap), "capacity": "64MiB"}
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, swap


def _logged_losses(text: str) -> list[float]:
    return [float(m) for m in re.findall(r"^step \d+/\d+ loss=([0-9.]+) ", text, flags=re.M)]


def test_train_with_nvme_placement_lowers_the_loss_and_removes_the_swap_files(tmp_path: Path) -> None:
    config, swap = _tiny_config(tmp_path, nvme=True)
    out = io.StringIO()
    rc = T.run_train(_parse(["train", "--config", str(config), "--no-progress"]), out=out)
    text = out.getvalue()
    assert rc == 0
    losses = _logged_losses(text)
    assert len(losses) == 4  # steps 5, 10, 15, 20
    assert losses[-1] < losses[0] - 0.5
    first, last = map(float, re.search(r"loss first -> last\s+([0-9.]+) -> ([0-9.]+)", text).groups())
    assert abs(first - math.log(256)) < 0.2 and last == losses[-1] and last < first - 1.5
    assert "steps                20 of 20\n" in text
    assert re.search(r"^  nvme +[0-9.]+ [KM]iB +64\.0 MiB$", text, flags=re.M)
    assert list(swap.iterdir()) == []


def test_steps_and_set_flags_override_the_config(tmp_path: Path) -> None:
    config, _ = _tiny_config(tmp_path, nvme=False)
    out = io.StringIO()
    args = _parse(["train", "--config", str(config), "--steps", "4", "--set", "train.log_every=2",
                   "--set", "model.type=llama", "--no-progress"])
    assert T.run_train(args, out=out) == 0
    text = out.getvalue()
    assert len(_logged_losses(text)) == 2 and "steps                4 of 4\n" in text
    assert "parameters           164,160\n" in text  # the tiny Llama, not the GPT


def test_summary_matches_what_the_loop_measured(tmp_path: Path) -> None:
    config, _ = _tiny_config(tmp_path, nvme=False, steps=3)
    cfg = load_config(config)
    out = io.StringIO()
    summary = T.train(cfg, progress=False, out=out)
    assert summary.steps == 3 and len(summary.losses) == 3 and not summary.interrupted
    assert summary.tokens == 3 * 4 * 64
    assert summary.peak_rss > 50 * MiB
    assert summary.tier_capacity["device"] == 8 * MiB and 0 < summary.peak_tier_bytes["device"] <= 8 * MiB
    assert summary.part_seconds == []  # no plan predicted the parts: none are timed
    assert out.getvalue().endswith(summary.format())
    assert summary.linear_gradients is None and "linear gradients" not in out.getvalue()  # PyTorch's kernel


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN")
def test_the_summary_says_where_the_onednn_kernel_s_gradients_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kernels, "_kept", {})  # what this process's other tests chose stays out
    config, _ = _tiny_config(tmp_path, nvme=False, steps=2)
    cfg = load_config(config, overrides={"precision.linear_kernel": "onednn"})
    out = io.StringIO()
    summary = T.train(cfg, progress=False, out=out)
    row = re.search(r"^  linear gradients +(.+)$", out.getvalue(), flags=re.M)
    assert row is not None and row[1] == summary.linear_gradients
    # 4 x 64 tokens through the attention's in-projection (64 -> 192), its out-projection and the MLP's two
    assert {f"{product} of 64 -> 192 at 129-256 tokens" for product in ("input gradient", "weight gradient")} <= chosen().keys()
    for product in ("input gradient", "weight gradient"):
        counted = re.search(rf"{product} on (mm|onednn) \((\d) shapes?\)(, (mm|onednn) \((\d)\))?", row[1])
        assert counted is not None and int(counted[2]) + int(counted[5] or 0) == 4


def test_summary_json_is_rank_0_s_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config, _ = _tiny_config(tmp_path, nvme=False, steps=2)
    path = tmp_path / "summary.json"
    argv = ["train", "--config", str(config), "--no-progress", "--summary-json", str(path)]
    monkeypatch.setenv("RANK", "1")  # as a launcher names another rank: it leaves the file to rank 0
    assert T.run_train(_parse(argv), out=io.StringIO()) == 0 and not path.exists()
    monkeypatch.delenv("RANK")
    out = io.StringIO()
    assert T.run_train(_parse(argv), out=out) == 0
    written = json.loads(path.read_text())
    first, last = re.search(r"loss first -> last +([0-9.]+) -> ([0-9.]+)", out.getvalue()).groups()  # type: ignore[union-attr]
    assert written["steps"] == 2 and [f"{x:.4f}" for x in written["losses"]] == [first, last]
    assert len(written["step_seconds"]) == 2 and written["peak_rss"] > 50 * MiB and written["predicted_step_s"] is None


def test_the_disk_s_time_in_the_steps_after_the_first_is_summed_and_learnt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The NVMe tier's clock read at the end of each step: what moved after the first step, which
    the planner's disk rates are told of (placement/disk.py `learn`)."""
    config, swap = _tiny_config(tmp_path, nvme=True, steps=3)
    cfg = load_config(config)
    told: list[tuple[Any, ...]] = []
    monkeypatch.setattr(T, "learn", lambda path, nvme, busy, **kw: told.append((path, nvme, busy, kw)))
    read = TieredStore.nvme_busy
    clocks: list[Busy] = []
    monkeypatch.setattr(TieredStore, "nvme_busy", lambda store: clocks.append(read(store)) or clocks[-1])
    out = io.StringIO()
    summary = T.train(cfg, progress=False, out=out)
    busy = summary.nvme_busy
    assert len(clocks) == 3 and busy == clocks[2] - clocks[0]
    assert 0 < busy.read_s <= busy.any_s and 0 < busy.write_s <= busy.any_s
    assert busy.read_bytes > 0 and busy.write_bytes > 0
    assert told == [(str(swap), cfg.tiers.nvme, busy, {"seconds": sum(summary.step_seconds[1:]), "steps": 2})]
    assert re.search(r"^  disk busy +[0-9.]+ s a step after the first, of [0-9.]+ s: [0-9.]+ GB/s read, ", out.getvalue(), flags=re.M)


def test_summary_table_format() -> None:
    summary = T.RunSummary(
        steps=2, planned_steps=5, losses=[5.5, 4.25], tokens=2000, seconds=4.0, parameters=1234567,
        state_bytes=64 * MiB, peak_tier_bytes={"device": 8 * MiB, "nvme": 48 * MiB},
        tier_capacity={"device": 16 * MiB, "nvme": None}, peak_rss=300 * MiB, interrupted=True,
    )
    assert summary.format().splitlines()[1:] == [
        "tierzero train summary",
        "  steps                2 of 5 (interrupted)",
        "  loss first -> last   5.5000 -> 4.2500",
        "  tokens/s             500",
        "  time                 4.0 s",
        "  parameters           1,234,567",
        "  training state       64.0 MiB (4.0x the device capacity)",
        "  peak RSS             300.0 MiB",
        "",
        "  tier             peak     capacity",
        "  device        8.0 MiB     16.0 MiB",
        "  nvme         48.0 MiB    unbounded",
    ]
    # A cache that took every NVMe byte out of the step still shows the step, and what it holds.
    cached = dataclasses.replace(summary, nvme_steps=[(0, 0)], step_seconds=[1.25], nvme_cache=3 * MiB)
    assert cached.format().splitlines()[9:11] == [
        "  last step            1.2 s, NVMe read 0 B, written 0 B",
        "  NVMe cache           3.0 MiB of NVMe-homed slices in host memory",
    ]
    # A planned run sets the plan's step beside the median of its steps after the first.
    planned = dataclasses.replace(summary, step_seconds=[9.0, 2.2, 2.4, 2.3], predicted_step_s=2.0)
    assert "  planned step         predicted 2.00 s, measured 2.30 s after the first step (prediction -13%)" in (
        planned.format().splitlines()
    )
    assert "planned step" not in dataclasses.replace(planned, step_seconds=[9.0]).format()
    # ... and each part's prediction beside the median of its measured seconds after the first step.
    parts = [{"forward": 5.0, "backward": 3.0}, {"forward": 0.5, "backward": 1.5, "step": 0.25}]
    parts += [{"forward": 0.75, "backward": 1.25, "step": 0.5}, {"forward": 0.5, "backward": 1.75, "step": 0.75}]
    by_part = dataclasses.replace(planned, predicted_parts={"forward": 0.6, "backward": 1.4, "step": 0.0}, part_seconds=parts)
    assert (
        "  by part              forward 0.60 s predicted, 0.50 s measured; backward 1.40 s predicted, 1.50 s measured; "
        "step 0.00 s predicted, 0.50 s measured"
    ) in by_part.format().splitlines()
    assert "by part" not in planned.format()


def test_part_clock_sums_each_part_over_the_micro_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    now = iter([10.0, 11.0, 13.5, 14.0, 20.0, 20.5, 21.0, 21.25, 21.5])
    monkeypatch.setattr(run_summary.time, "perf_counter", lambda: next(now))
    clock = run_summary.PartClock(cuda=False)
    for part in ("forward", "backward", "step", ""):  # a micro-step: 1 s, 2.5 s, 0.5 s
        clock.mark(part)
    for part in ("forward", "backward", "step", ""):  # the next, after 6 s outside any part
        clock.mark(part)
    assert clock.step_done() == {"forward": 1.5, "backward": 3.0, "step": 0.75}
    clock.mark("forward")
    assert clock.step_done() == {}  # a part not yet ended has no time


@pytest.fixture
def ctrl_c_delivered() -> Iterator[None]:
    """SIGINT handled as in a terminal: a shell starts background jobs (a CI runner's, say) with it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupted_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ctrl_c: Any) -> tuple[int, str, Path, int]:
    """Train with `ctrl_c()` called at the start of step 3: (exit code, output, swap dir, steps begun)."""
    config, swap = _tiny_config(tmp_path, nvme=True)
    real_step, calls = T._train_step, []

    def step(*args: Any, **kwargs: Any) -> float:
        calls.append(1)
        if len(calls) == 3:
            ctrl_c()
        return real_step(*args, **kwargs)

    monkeypatch.setattr(T, "_train_step", step)
    out = io.StringIO()
    rc = T.run_train(_parse(["train", "--config", str(config), "--no-progress"]), out=out)
    return rc, out.getvalue(), swap, len(calls)


@pytest.mark.usefixtures("ctrl_c_delivered")
def test_ctrl_c_stops_cleanly_with_exit_130_and_no_swap_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # as Ctrl-C would, in the middle of step 3
    rc, out, swap, _ = _interrupted_run(tmp_path, monkeypatch, lambda: os.kill(os.getpid(), signal.SIGINT))
    assert rc == 130
    assert "interrupted after 2 steps: closing the engine and removing swap files" in out
    assert "steps                2 of 20 (interrupted)" in out
    assert list(swap.iterdir()) == []


@pytest.mark.usefixtures("ctrl_c_delivered")
def test_ctrl_c_swallowed_where_it_landed_still_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A KeyboardInterrupt raised inside a finalizer or an error-catching callback is lost;
    # the run must stop anyway, at the end of the step it came in.
    def swallowed() -> None:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs here, in the main thread
        except KeyboardInterrupt:
            pass  # what a finalizer does with it

    before = signal.getsignal(signal.SIGINT)
    rc, out, swap, steps_begun = _interrupted_run(tmp_path, monkeypatch, swallowed)
    assert rc == 130 and steps_begun == 3
    assert "interrupted after 2 steps" in out
    assert list(swap.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is before  # the loop's handler is gone


def test_resume_without_a_checkpoint_dir_is_a_one_line_error(tmp_path: Path) -> None:
    config, _ = _tiny_config(tmp_path, nvme=False)
    with pytest.raises(ValueError, match=r"^--resume needs checkpoint.dir, where the checkpoints are"):
        T.run_train(_parse(["train", "--config", str(config), "--resume"]))


def test_config_errors_name_the_key(tmp_path: Path) -> None:
    config, _ = _tiny_config(tmp_path, nvme=False)
    with pytest.raises(ValueError, match=r"^train.seq_len 100 is above model.max_seq_len 64"):
        T.run_train(_parse(["train", "--config", str(config), "--set", "train.seq_len=100"]))


def test_transformers_model_by_name_trains(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    config, _ = _tiny_config(tmp_path, nvme=False, steps=3)
    hf = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 256, "n_positions": 64}
    cfg = load_config(config, overrides={"model.type": "transformers", "model.transformers_class": "GPT2LMHeadModel",
                                         "model.transformers_config": hf})
    summary = T.train(cfg, progress=False, out=io.StringIO())
    assert summary.steps == 3 and all(math.isfinite(x) for x in summary.losses)
    assert abs(summary.losses[0] - math.log(256)) < 0.5


def test_demo_config_is_stage_3_offloaded_and_four_times_the_device() -> None:
    cfg = load_config(REPO / "configs" / "demo.yaml", overrides={"tiers.nvme.path": str(REPO)})
    from tierzero.models.builtin import build_model, count_parameters

    assert cfg.zero.stage == 3 and cfg.offload.params.value in ("cpu", "nvme") and cfg.offload.optimizer.value in ("cpu", "nvme")
    import torch

    with torch.device("meta"):
        params = count_parameters(build_model(cfg.model))
    # fp32 parameters, gradients and two Adam states: 16 bytes a parameter.
    assert 16 * params >= 4 * cfg.tiers.device.capacity
    assert 24 <= cfg.train.steps <= 60


def test_demo_swaps_under_the_working_directory_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = io.StringIO()
    rc = T.run_demo(_parse(["demo", "--steps", "1", "--no-progress"]), out=out)
    assert rc == 0
    text = out.getvalue()
    ratio = float(re.search(r"training state .* \(([0-9.]+)x the device capacity\)", text).group(1))
    assert ratio >= 4.0
    assert not (tmp_path / ".tierzero-swap").exists()
