"""`tierzero bench oversized`: each run a `tierzero train` child whose summary and peak RSS come back,
the ratio and checks worked out from them, a cgroup run's counters, and refusals."""

from __future__ import annotations

import io
import os
import statistics
import time
from pathlib import Path

import pytest
import yaml

from tierzero.cli.bench.oversized import RSS_SLACK, BenchRun, CgroupRun, OversizedResult, RunResult, bench_oversized
from tierzero.common.cgroup import memory_cgroup_of
from tierzero.common.sizes import format_size, parse_size

MiB = 1 << 20
ON_CPU = ("offload.params=cpu", "offload.gradients=cpu", "offload.optimizer=cpu")


def _config(tmp_path: Path) -> tuple[Path, Path]:
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    raw = {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 3e-3, "weight_decay": 0.0},
        "model": {"type": "gpt", "n_layer": 2, "n_head": 2, "d_model": 64, "d_ff": 256, "max_seq_len": 64},
        "data": {"max_bytes": "1MiB"},
        "train": {"steps": 20, "micro_batch_size": 4, "seq_len": 64, "log_every": 1},
        "offload": {"params": "nvme", "gradients": "nvme", "optimizer": "nvme"},
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, nvme


def _own_memory_cgroup() -> Path | None:
    """This process's cgroup v1 memory directory, where a child cgroup can be made in it."""
    located = memory_cgroup_of(Path("/proc/self/cgroup"))
    if located is None or located[0] != 1:
        return None
    directory = Path("/sys/fs/cgroup/memory", located[1].lstrip("/"))
    probe = directory / f"tierzero-test-{os.getpid()}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError:
        return None
    return directory


def test_each_run_is_a_child_whose_summary_and_peak_rss_come_back(tmp_path: Path) -> None:
    config, nvme = _config(tmp_path)
    out = io.StringIO()
    budget = parse_size("64MiB")
    runs = [BenchRun("cpu", ON_CPU, budget=budget), BenchRun("config")]
    result = bench_oversized(config=config, nvme_path=nvme, steps=3, runs=runs, subject="cpu", against="config", out=out)
    cpu, on_nvme = result.runs
    assert [r.returncode for r in result.runs] == [0, 0] and result.ok()
    assert len(cpu.losses) == len(cpu.step_seconds) == 3 and cpu.losses == on_nvme.losses  # placement keeps the bits
    assert cpu.predicted_step_s is None and cpu.prediction_error is None  # nothing planned
    assert cpu.step_s == statistics.median(cpu.step_seconds[1:])
    assert result.ratios() == [on_nvme.step_s / cpu.step_s]
    assert all(100 * MiB < r.peak_rss < 4096 * MiB for r in result.runs)  # the child's own, a torch process
    assert list(nvme.iterdir()) == []  # the swap directory and the summaries are gone
    text = out.getvalue() + result.format()
    assert "  | step 3/3 loss=" in text  # the child's lines, passed through
    assert f"cpu against config: {result.ratios()[0]:.2f}x (target 2.00x: " in text and "losses equal at every step: yes" in text
    within = "within" if cpu.peak_rss <= budget + RSS_SLACK else "OVER"
    assert f"cpu peak RSS {format_size(cpu.peak_rss)} against 64.0 MiB + 1.5 GiB: {within}" in text


def test_a_run_that_fails_is_reported_not_trusted(tmp_path: Path) -> None:
    config, nvme = _config(tmp_path)
    out = io.StringIO()
    runs = [BenchRun("bad", ("train.seq_len=100",))]  # longer than the model's max_seq_len
    result = bench_oversized(config=config, nvme_path=nvme, steps=2, runs=runs, against="config", out=out)
    (bad,) = result.runs
    assert bad.returncode == 2 and bad.losses == [] and bad.step_s is None and not result.ok()
    assert "  | tierzero: error: " in out.getvalue() and "exit 2" in bad.row()
    assert list(nvme.iterdir()) == []


def test_a_bench_stopped_midway_stops_its_child_and_leaves_nothing(tmp_path: Path) -> None:
    class Stopped(io.StringIO):
        def write(self, text: str) -> int:
            if "step 1/" in text:
                raise KeyboardInterrupt
            return super().write(text)

    config, nvme = _config(tmp_path)
    began = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        bench_oversized(config=config, nvme_path=nvme, steps=5000, runs=[BenchRun("config")], against="config", out=Stopped())
    assert time.monotonic() - began < 60  # 5000 steps would take many minutes: the child was stopped
    assert list(nvme.iterdir()) == []  # and waited for before its swap directory went


def test_a_swap_directory_already_there_is_refused(tmp_path: Path) -> None:
    config, nvme = _config(tmp_path)
    (nvme / "tierzero-bench-oversized").mkdir()
    with pytest.raises(OSError, match=r"tierzero-bench-oversized exists: a bench left it behind or it is yours"):
        bench_oversized(config=config, nvme_path=nvme, steps=2, runs=[BenchRun("config")], against="config", out=io.StringIO())


@pytest.mark.skipif(_own_memory_cgroup() is None, reason="no writable cgroup v1 memory controller here")
def test_a_run_in_a_cgroup_reports_the_cgroup_s_counters(tmp_path: Path) -> None:
    config, nvme = _config(tmp_path)
    limit = parse_size("3GiB")
    result = bench_oversized(
        config=config, nvme_path=nvme, steps=2, runs=[], against="config", cgroup=(BenchRun("capped", ON_CPU), limit),
        out=io.StringIO(),
    )  # fmt: skip
    (capped,) = result.runs
    assert capped.returncode == 0 and len(capped.losses) == 2
    assert capped.cgroup is not None and capped.cgroup.limit == limit and capped.cgroup.oom_kills == 0
    # the cgroup charged the child's memory (and page cache), never more than its limit
    assert 100 * MiB < capped.cgroup.max_usage <= limit
    assert "capped in a 3.0 GiB cgroup: exit 0, 2 steps, peak usage " in result.format()
    own = _own_memory_cgroup()
    assert own is not None and not (own / f"tierzero-bench-{os.getpid()}").exists()  # removed after the run


def test_the_checks_say_what_misses() -> None:
    gib = 1 << 30
    runs = [
        RunResult(name="auto", returncode=0, peak_rss=16 * gib, budget=14 * gib, losses=[6.0, 5.0, 4.0],
                  step_seconds=[30.0, 10.0, 12.0], predicted_step_s=14.0),
        RunResult(name="config", returncode=0, peak_rss=3 * gib, losses=[6.0, 5.0, 4.0], step_seconds=[40.0, 22.0, 22.0]),
        RunResult(name="auto", returncode=0, peak_rss=15 * gib, budget=14 * gib, losses=[6.0, 5.0, 4.5],
                  step_seconds=[30.0, 11.0, 11.0], predicted_step_s=12.0),
        RunResult(name="auto", returncode=0, peak_rss=9 * gib, losses=[6.0, 5.0], step_seconds=[30.0, 1.0],
                  cgroup=CgroupRun(limit=12 * gib, max_usage=10 * gib, failcnt=3, oom_kills=0)),
    ]  # fmt: skip
    result = OversizedResult(runs=runs, subject="auto", against="config")
    assert result.ratios() == [2.0, 2.0]  # 22 over 11 twice; the cgroup's run is not set beside it
    lines = result.format().splitlines()
    assert "auto against config: 2.00x, 2.00x (target 2.00x: met)" in lines
    assert "auto peak RSS 16.0 GiB against 14.0 GiB + 1.5 GiB: OVER" in lines
    assert "auto peak RSS 15.0 GiB against 14.0 GiB + 1.5 GiB: within" in lines
    assert "auto prediction +27%: OUTSIDE 15%" in lines and "auto prediction +9%: within 15%" in lines
    assert "auto in a 12.0 GiB cgroup: exit 0, 2 steps, peak usage 10.0 GiB, failcnt 3, 0 OOM kills" in lines
    assert lines[-1] == "losses equal at every step: NO" and result.ok()
    runs[2].losses = [6.0, 5.0, 4.0]
    assert result.losses_agree()
    runs[1].losses = []  # a run that failed before its first step: nothing to vouch for
    assert not result.losses_agree()
    runs[1].losses = [6.0, 5.0, 4.0]
    runs[2].predicted_step_s = 8.0
    runs[2].step_seconds = [30.0, 12.0, 11.0]  # 22 over 11.5: under the target
    assert {"auto prediction -30%: OUTSIDE 15%", "auto against config: 2.00x, 1.91x (target 2.00x: missed)"} <= set(
        result.format().splitlines()
    )
    runs[3].cgroup = CgroupRun(limit=12 * gib, max_usage=12 * gib, failcnt=9, oom_kills=1)
    assert not result.ok()
