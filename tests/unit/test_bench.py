"""`tierzero bench nvme` and `tierzero bench swap`, run for real on small sizes, and their parts."""

from __future__ import annotations

import json
import re
import shutil
import statistics
from pathlib import Path

import pytest
import torch
import yaml

from tierzero.cli.bench import pattern
from tierzero.cli.bench.fio import FioJob, fio_command, parse_fio_json, run_fio
from tierzero.cli.bench.report import format_table, nvme_config_snippet, size_text
from tierzero.cli.bench.swap import parse_duration
from tierzero.cli.main import main
from tierzero.common.sizes import parse_size
from tierzero.offload.nvme import NvmeTier

MiB = 1 << 20
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- pieces


def test_pattern_pages_are_distinct_and_a_moved_page_is_found() -> None:
    buf = torch.empty(5 * pattern.PAGE + 100, dtype=torch.uint8)
    pattern.fill(buf, block=pattern.random_block(3, 2 * pattern.PAGE), stamp=7)
    pages = buf[: 5 * pattern.PAGE].view(5, pattern.PAGE)
    # The block repeats every 2 pages; the stamps still make every page different.
    assert len({bytes(p.numpy()) for p in pages}) == 5
    assert [int(p[:8].view(torch.int64)) for p in pages] == [(7 << 32) + i for i in range(5)]
    moved = buf.clone()
    moved[2 * pattern.PAGE : 3 * pattern.PAGE] = buf[4 * pattern.PAGE : 5 * pattern.PAGE]
    mismatch = pattern.first_mismatch(moved, buf)
    assert mismatch is not None and mismatch.offset == 2 * pattern.PAGE
    assert str(mismatch) == f"byte {2 * pattern.PAGE}: expected 0x02, read 0x04"
    restamped = buf.clone()
    pattern.stamp_pages(restamped, stamp=8)
    assert pattern.first_mismatch(restamped, buf) is not None
    assert torch.equal(restamped[8 : pattern.PAGE], buf[8 : pattern.PAGE])
    assert pattern.first_mismatch(buf.clone(), buf) is None


def test_fio_command_splits_the_file_between_jobs() -> None:
    job = FioJob(path=Path("/d/f.dat"), direction="read", total_bytes=64 * MiB, block_size=4 * MiB, iodepth=2, numjobs=4)
    cmd = fio_command(job, executable="fio")
    for arg in ("--rw=read", "--bs=4194304", "--iodepth=2", "--numjobs=4", "--size=16777216",
                "--offset_increment=16777216", "--direct=1", "--ioengine=libaio", "--output-format=json"):
        assert arg in cmd
    with pytest.raises(ValueError, match=r"multiple of numjobs x block_size \(4 x 4194304\)"):
        FioJob(path=Path("/d/f"), direction="read", total_bytes=60 * MiB, block_size=4 * MiB, iodepth=1, numjobs=4)
    with pytest.raises(ValueError, match="fio direction must be one of"):
        FioJob(path=Path("/d/f"), direction="randread", total_bytes=4 * MiB, block_size=MiB, iodepth=1, numjobs=1)


def test_parse_fio_json_sums_jobs_and_skips_leading_notes() -> None:
    jobs = [{"error": 0, "read": {"io_bytes": 3 * MiB, "bw_bytes": 1_500_000_000}},
            {"error": 0, "read": {"io_bytes": 5 * MiB, "bw_bytes": 500_000_000}}]
    text = "fio: some note\n" + json.dumps({"fio version": "fio-3", "jobs": jobs})
    result = parse_fio_json(text, direction="read")
    assert result.bytes_moved == 8 * MiB and result.gbps == pytest.approx(2.0)
    failed = json.dumps({"jobs": [{"error": 5, "read": {"io_bytes": 0, "bw_bytes": 0}}]})
    with pytest.raises(OSError, match="error code 5"):
        parse_fio_json(failed, direction="read")


def test_run_fio_moves_exactly_the_requested_bytes(tmp_path: Path) -> None:
    if shutil.which("fio") is None:  # asked when the test runs, never at import: fio may come mid-run
        pytest.skip("fio is not installed")
    for direction in ("write", "read"):
        job = FioJob(path=tmp_path / "f.dat", direction=direction, total_bytes=8 * MiB, block_size=MiB, iodepth=2, numjobs=2)
        result = run_fio(job, executable=shutil.which("fio") or "fio")
        assert result.bytes_moved == 8 * MiB and result.gbps > 0
    assert (tmp_path / "f.dat").stat().st_size == 8 * MiB
    with pytest.raises(ValueError, match="does not exist"):
        run_fio(FioJob(path=tmp_path / "no" / "f", direction="read", total_bytes=MiB, block_size=MiB, iodepth=1, numjobs=1),
                executable="fio")


def test_sizes_table_and_durations() -> None:
    for n in (4096, 3 * MiB, 8 << 30, 12345):
        assert parse_size(size_text(n)) == n
    assert size_text(8 * MiB) == "8MiB" and size_text(12345) == "12345"
    table = format_table(["a", "bb"], [["xyz", "1"], ["q", "22"]]).splitlines()
    assert table == ["a    bb", "---  --", "xyz   1", "q    22"]
    assert [parse_duration(d) for d in ("60s", "2m", "1.5h", "250ms", "3")] == [60, 120, 5400, 0.25, 3]
    with pytest.raises(ValueError, match=r"expected a duration such as '60s', '2m' or '500ms', got '2 weeks'"):
        parse_duration("2 weeks")


def test_config_snippet_loads_as_the_settings_it_names() -> None:
    from tierzero.config import load_config

    snippet = nvme_config_snippet(block_size=4 * MiB, queue_depth=16, threads=8, backend="aiofiles")
    assert "block_size: 4MiB" in snippet
    nvme = load_config(yaml.safe_load(snippet)).tiers.nvme
    assert (nvme.block_size, nvme.queue_depth, nvme.threads, nvme.backend) == (4 * MiB, 16, 8, "aiofiles")


# ---------------------------------------------------------------- bench nvme


def _snippet(stdout: str) -> str:
    return stdout.split("best settings as config:\n", 1)[1]


def test_bench_nvme_quick_writes_json_plot_and_a_loadable_snippet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tierzero.config import load_config
    from tierzero.placement.disk import remembered

    out_json, out_png, data = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "disk"
    data.mkdir()
    argv = ["bench", "nvme", "--path", str(data), "--size", "8MiB", "--slices", "2", "--quick", "--repeats", "2",
            "--json", str(out_json), "--plot", str(out_png), "--no-progress"]
    has_fio = shutil.which("fio") is not None
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    report = json.loads(out_json.read_text())
    assert set(report) >= {"best", "runs", "fio", "machine", "date", "through_store"}
    assert set(report["best"]) >= {"read_GBps", "write_GBps", "block_size", "queue_depth", "threads", "backend"}
    # The quick grid: one setting, both backends, both directions; two repeats each (fio after, then before).
    assert sorted((r["backend"], r["direction"]) for r in report["runs"]) == [
        ("aiofiles", "read"), ("aiofiles", "write"), ("pread", "read"), ("pread", "write")]
    for run in report["runs"]:
        assert run["GBps"] == statistics.median(run["samples"]) > 0 and len(run["samples"]) == 2
        assert len(run["fio_samples"]) == (2 if has_fio else 0)
    best = report["best"]
    best_runs = {r["direction"]: r for r in report["runs"] if r["backend"] == best["backend"]}
    assert best["read_GBps"] == best_runs["read"]["GBps"] and best["write_GBps"] == best_runs["write"]["GBps"]
    if has_fio:
        fio = report["fio"]
        assert fio["version"].startswith("fio-")
        assert fio["best_read_GBps"] == max(r["GBps"] for r in fio["runs"] if r["direction"] == "read")
        for r in report["runs"]:
            # Each repeat against the fio run beside it, then the median of those ratios.
            paired = statistics.median(mine / fio for mine, fio in zip(r["samples"], r["fio_samples"]))
            assert r["vs_fio"] == pytest.approx(paired) and r["fio_GBps"] == statistics.median(r["fio_samples"])
        assert "vs fio" in stdout
    else:
        assert report["fio"] is None
    paths = {p["path"]: p for p in report["through_store"]["paths"]}
    assert set(paths) == {"cpu->nvme", "nvme->cpu", "device->nvme", "nvme->device"}
    assert all(p["GBps"] > 0 and len(p["samples"]) == 2 and p["cold_GBps"] > 0 for p in paths.values())
    assert report["machine"]["filesystem"] != "unknown" and report["machine"]["cpus"] >= 1
    assert out_png.read_bytes()[:8] == PNG_MAGIC
    snippet = _snippet(stdout)
    cfg = load_config(yaml.safe_load(snippet))
    assert cfg.tiers.nvme.block_size == best["block_size"] and cfg.tiers.nvme.queue_depth == best["queue_depth"]
    assert cfg.tiers.nvme.threads == best["threads"] and cfg.tiers.nvme.backend == best["backend"]
    assert list(data.iterdir()) == [], "bench nvme left files behind"
    # Every point is remembered for the planner, each under its own setting.
    for backend in ("pread", "aiofiles"):
        rates = remembered(data, f"1.0 MiB qd4 t2 {backend}")
        medians = {r["direction"]: r["GBps"] for r in report["runs"] if r["backend"] == backend}
        assert rates is not None and (rates.read, rates.write) == (medians["read"] * 1e9, medians["write"] * 1e9)
    assert remembered(data, "8.0 MiB qd16 t8 pread") is None


def test_bench_nvme_fails_naming_the_slice_when_a_read_is_corrupted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_submit = NvmeTier.submit_read

    def corrupt(self: NvmeTier, region, dst, **kwargs):  # type: ignore[no-untyped-def]
        future = real_submit(self, region, dst, **kwargs)
        future.result()
        if region.label == "bench/1":
            dst[5000] ^= 0xFF
        return future

    monkeypatch.setattr(NvmeTier, "submit_read", corrupt)
    argv = ["bench", "nvme", "--path", str(tmp_path), "--size", "8MiB", "--slices", "2", "--quick", "--no-fio",
            "--no-store", "--no-progress"]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "bench nvme: FAILED: slice 1 read back wrong through the NvmeTier (1.0 MiB qd4 t2 pread): byte 5000" in err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------- bench swap


def test_bench_swap_short_run_passes_and_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s.json"
    disk = tmp_path / "disk"
    disk.mkdir()
    argv = ["bench", "swap", "--path", str(disk), "--duration", "2s", "--slices", "12", "--slice-size", "256KiB",
            "--workers", "4", "--json", str(out)]
    code = main(argv)
    stdout = capsys.readouterr().out
    report = json.loads(out.read_text())
    assert code == 0, stdout
    assert report["passed"] and report["failures"] == []
    assert report["transfers"] == sum(p["transfers"] for p in report["paths"].values()) > 0
    for name, p in report["paths"].items():
        assert p["p50_ms"] <= p["p99_ms"] and p["bytes"] >= p["transfers"] * 128 * 1024, name
    assert {"nvme->cpu", "cpu->nvme"} <= set(report["paths"])
    tiers = ("device", "cpu", "nvme")
    assert report["leaked"] == {name: 0 for t in tiers for name in (t, f"ledger.{t}")}
    assert report["staging"]["capacity"] == 4 * 256 * 1024 and report["peak_rss"] > 0
    assert "bench swap: PASSED" in stdout
    assert list(disk.iterdir()) == []


def test_bench_swap_corrupted_read_fails_naming_the_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_submit = NvmeTier.submit_read

    # Every NVMe read (blocking `read` goes through `submit_read`) lands with one byte flipped.
    def flip_a_byte(self: NvmeTier, region, dst, **kwargs):  # type: ignore[no-untyped-def]
        future = real_submit(self, region, dst, **kwargs)
        future.result()
        dst[dst.numel() // 2] ^= 0x01
        return future

    monkeypatch.setattr(NvmeTier, "submit_read", flip_a_byte)
    argv = ["bench", "swap", "--path", str(tmp_path), "--duration", "1s", "--slices", "6", "--slice-size", "64KiB"]
    assert main(argv) == 1
    stdout = capsys.readouterr().out
    failed = [line for line in stdout.splitlines() if line.startswith("FAILED: slice swap.")]
    assert failed and all("home nvme" in line and "is wrong: byte" in line for line in failed), stdout
    assert "bench swap: FAILED" in stdout
    assert list(tmp_path.iterdir()) == []


def test_bench_swap_fails_on_bytes_never_freed_and_on_files_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tierzero.offload import nvme as nvme_mod
    from tierzero.offload.cpu import CpuTier

    real_free = CpuTier.free

    def keep_fetched_copies(self: CpuTier, region) -> None:  # type: ignore[no-untyped-def]
        if not region.label.endswith("fetched"):
            real_free(self, region)

    monkeypatch.setattr(CpuTier, "free", keep_fetched_copies)
    monkeypatch.setattr(nvme_mod._RunFiles, "remove", lambda self: None)
    argv = ["bench", "swap", "--path", str(tmp_path), "--duration", "0.5s", "--slices", "6", "--slice-size", "64KiB"]
    assert main(argv) == 1
    stdout = capsys.readouterr().out
    assert re.search(r"^FAILED: cpu tier: [0-9.]+ [KM]iB still accounted after every release$", stdout, re.M), stdout
    assert re.search(r"^FAILED: NVMe tier: .*tz-bench-swap-\d+ left behind after close$", stdout, re.M), stdout


def test_bench_adam_reports_both_rates_and_identical_bits(capsys: pytest.CaptureFixture[str]) -> None:
    from tierzero.cli.main import main

    assert main(["bench", "adam", "--params", "1M", "--steps", "2"]) == 0
    line = capsys.readouterr().out.strip()
    assert re.match(r"^CPU Adam, 1M fp32 params, 2 steps, .* ratio [0-9.]+, bitwise identical$", line), line
