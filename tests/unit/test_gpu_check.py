"""`make gpu-check` on the CPU: the placement matrix and parity run the GPU tests use, the
device bench, the profiler-trace and junit parsing, and the JSON report with its fields."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
import torch

from tierzero.cli.bench import gpu_check
from tierzero.cli.bench.contenders import PLACEMENTS, placement_matrix, run_parity
from tierzero.cli.bench.train.copies import memcpy_traffic
from tierzero.cli.bench.train.gpu import bench_train_device
from tierzero.cli.main import main
from tierzero.common.slices import Tier

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.gpu.test_a" name="test_ok" time="0.5"/>
<testcase classname="tests.gpu.test_a" name="test_bad" time="0.1"><failure message="assert 1 == 2">trace</failure></testcase>
<testcase classname="tests.gpu.test_b" name="test_gpu" time="0"><skipped type="pytest.skip" message="needs a CUDA GPU"/></testcase>
<testcase classname="tests.gpu.test_b" name="test_known" time="0.2"><skipped type="pytest.xfail" message="swapper"/></testcase>
</testsuite></testsuites>"""


def test_placement_matrix_gives_each_stage_what_it_allows_once() -> None:
    cases = placement_matrix()
    assert [sum(stage == s for stage, _ in cases) for s in (1, 2, 3)] == [3, 4, 4]
    for stage, placement in cases:
        assert stage == 3 or placement.params is Tier.DEVICE
        assert stage >= 2 or placement.gradients is Tier.DEVICE
    homes = [(stage, placement.homes()) for stage, placement in cases]
    assert len(set(homes)) == len(homes)
    assert (3, (Tier.NVME, Tier.NVME, Tier.NVME)) in homes and (3, (Tier.CPU, Tier.CPU, Tier.CPU)) in homes


def test_parity_run_on_the_cpu_matches_plain_pytorch(tmp_path: Path) -> None:
    result = run_parity(stage=3, placement=PLACEMENTS["mixed"], nvme_path=tmp_path, device="cpu", steps=2)
    assert len(result.engine_losses) == 2 and result.max_loss_difference <= 1e-6
    assert result.max_param_difference <= 1e-6
    assert result.memory["tiers"]["nvme"]["current"] > 0 and result.memory["tiers"]["cpu"]["current"] > 0
    assert list(tmp_path.iterdir()) == []


def test_autocast_parity_run_on_the_cpu_is_bitwise(tmp_path: Path) -> None:
    """What tests/gpu asks of the GPU within cuBLAS's tolerance holds on the CPU bit for bit."""
    placement = PLACEMENTS["params-optimizer-nvme"]
    result = run_parity(stage=3, placement=placement, nvme_path=tmp_path, device="cpu", steps=2, dtype="bf16")
    assert result.engine_losses == result.plain_losses and result.max_param_difference == 0.0


def test_memcpy_traffic_sums_host_device_copies_of_a_trace() -> None:
    events = [
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "dur": 100.0, "args": {"bytes": 4096}},
        {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pageable -> Device)", "dur": 50.0, "args": {"bytes": 1024}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "dur": 10.0, "args": {"bytes": 512}},
        {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "dur": 10.0, "args": {"bytes": 999}},
        {"cat": "cpu_op", "name": "aten::copy_ HtoD", "dur": 10.0, "args": {}},
    ]
    traffic = memcpy_traffic(events)
    assert (traffic.h2d_bytes, traffic.d2h_bytes, traffic.copies, traffic.pageable_copies) == (5120, 512, 3, 1)
    assert math.isclose(traffic.h2d_busy_s, 150e-6) and math.isclose(traffic.d2h_busy_s, 10e-6)


def test_junit_summary_counts_each_outcome(tmp_path: Path) -> None:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    summary = gpu_check.junit_summary(path)
    counts = {k: summary[k] for k in ("total", "passed", "failed", "error", "skipped", "xfailed")}
    assert counts == {"total": 4, "passed": 1, "failed": 1, "error": 0, "skipped": 1, "xfailed": 1}
    assert summary["cases"][1] == {
        "name": "tests.gpu.test_a::test_bad", "outcome": "failed", "seconds": 0.1, "message": "assert 1 == 2"
    }


@no_cuda
def test_dry_run_report_has_every_field_and_sane_values(tmp_path: Path) -> None:
    result = bench_train_device(device="cpu", nvme_path=tmp_path, preset="tiny", seq=16, batch=2, steps=1, peak_bytes=1 << 20)
    bench = {"ok": True, **result.to_dict()}
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT.replace("<failure", "<skipped").replace("</failure>", "</skipped>"))
    tests = {"returncode": 0, **gpu_check.junit_summary(junit)}
    out = tmp_path / "gpu-check.json"
    gpu_check.write_report(gpu_check.build_report(mode="dry-run", env=gpu_check.environment(), tests=tests, bench=bench), out)
    report = json.loads(out.read_text())
    assert report["ok"] and report["problems"] == [] and report["schema"] == gpu_check.SCHEMA
    assert report["environment"]["torch"] == torch.__version__ and report["environment"]["device"] == "cpu"
    summary = report["bench"]["summary"]
    assert summary["tierzero_tflops"] > 0 and summary["plain_tflops"] > 0 and 0 <= summary["hit_rate"] <= 1
    assert report["bench"]["params"] > 0 and report["bench"]["flops_convention"].startswith("6 x parameters")
    assert report["bench"]["traffic"]["h2d_bytes"] == 0 and summary["h2d_gbs_while_copying"] is None
    assert report["bench"]["peak"]["h2d_gbs"] > 0 and report["bench"]["max_param_difference"] <= 1e-6
    assert report["bench"]["placement"] == {"params": "nvme", "gradients": "device", "optimizer": "nvme"}
    assert report["tests"]["skipped"] == 2 and len(report["tests"]["cases"]) == 4


def test_report_fails_on_failed_tests_or_skips_under_cuda() -> None:
    tests = {"returncode": 1, "total": 3, "passed": 1, "failed": 1, "error": 0, "skipped": 1, "xfailed": 0}
    report = gpu_check.build_report(mode="cuda", env={}, tests=tests, bench={"ok": False, "error": "OSError: disk"})
    assert not report["ok"]
    assert report["problems"] == [
        "pytest exited 1: 1 failed, 0 errors", "1 CUDA tests skipped on a machine with CUDA", "bench: OSError: disk"
    ]


@no_cuda
def test_gpu_check_without_cuda_says_so_and_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "gpu-check.json"
    args = argparse.Namespace(out=str(out), tests="tests/gpu", nvme_path=str(tmp_path), test_timeout=10.0, dry_run=False)
    assert gpu_check.command(args) == 2
    assert "no CUDA device" in capsys.readouterr().err
    report = json.loads(out.read_text())
    assert not report["ok"] and "DRY_RUN=1" in report["problems"][0] and report["tests"] is None


@no_cuda
def test_bench_train_on_cuda_without_cuda_is_a_user_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "train", "--device", "cuda", "--nvme-path", str(tmp_path)]) == 2
    assert "--device cuda needs a CUDA GPU" in capsys.readouterr().err


def test_dry_run_command_writes_the_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole `make gpu-check DRY_RUN=1` path: pytest in a child process, the bench, the JSON."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test; the command hides CUDA itself
    tests = tmp_path / "gpu"
    tests.mkdir()
    (tests / "test_x.py").write_text(
        "import pytest\n\ndef test_runs():\n    pass\n\n@pytest.mark.skip(reason='needs a CUDA GPU')\ndef test_gpu():\n    pass\n"
    )
    out = tmp_path / "gpu-check.json"
    args = argparse.Namespace(out=str(out), tests=str(tests), nvme_path=str(tmp_path / "swap"), test_timeout=60.0, dry_run=True)
    assert gpu_check.command(args) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and report["mode"] == "dry-run" and report["bench"]["ok"]
    assert (report["tests"]["passed"], report["tests"]["skipped"]) == (1, 1)
    assert Path(report["tests"]["junit"]).exists() and report["seconds"] > 0
