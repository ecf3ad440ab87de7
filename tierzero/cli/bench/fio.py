"""Run fio with the settings of one sweep point and read its bandwidth from its JSON report.

fio is the yardstick the NVMe tier is measured against: direct I/O through libaio,
sequential, the same block size, queue depth, job count and bytes as tierzero's run.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: The two sequential workloads, in fio's own words.
FIO_DIRECTIONS = ("read", "write")


@dataclass(frozen=True, slots=True, kw_only=True)
class FioJob:
    """One fio invocation: `numjobs` jobs, each covering its own contiguous share of the file."""

    path: Path
    """The data file; fio lays it out on the first run and it is reused afterwards."""
    direction: str
    """"read" or "write", sequential."""
    total_bytes: int
    """Bytes moved by all jobs together; a multiple of `numjobs * block_size`."""
    block_size: int
    iodepth: int
    numjobs: int

    def __post_init__(self) -> None:
        if self.direction not in FIO_DIRECTIONS:
            raise ValueError(f"fio direction must be one of {FIO_DIRECTIONS}, got {self.direction!r}")
        share = self.numjobs * self.block_size
        if self.numjobs < 1 or self.iodepth < 1 or self.total_bytes <= 0 or self.total_bytes % share:
            raise ValueError(
                f"fio job needs total_bytes ({self.total_bytes}) to be a positive multiple of "
                f"numjobs x block_size ({self.numjobs} x {self.block_size}), iodepth >= 1 "
                f"(got {self.iodepth}): pick a --size that is a multiple of {share}"
            )

    @property
    def bytes_per_job(self) -> int:
        return self.total_bytes // self.numjobs


@dataclass(frozen=True, slots=True)
class FioResult:
    """Bandwidth of one fio run, summed over its jobs (fio's group report)."""

    direction: str
    bytes_moved: int
    bytes_per_second: float

    @property
    def gbps(self) -> float:
        return self.bytes_per_second / 1e9


def fio_executable() -> str | None:
    """The fio binary on PATH, or None where it is not installed."""
    return shutil.which("fio")


def fio_version(executable: str) -> str:
    done = subprocess.run([executable, "--version"], capture_output=True, text=True, check=True)
    return done.stdout.strip()


def fio_command(job: FioJob, *, executable: str = "fio") -> list[str]:
    """The argument list of `job`; every job starts where the previous one's share ends."""
    return [
        executable,
        "--name=tierzero",
        f"--filename={job.path}",
        f"--rw={job.direction}",
        f"--bs={job.block_size}",
        f"--iodepth={job.iodepth}",
        f"--numjobs={job.numjobs}",
        f"--size={job.bytes_per_job}",
        f"--offset_increment={job.bytes_per_job}",
        "--direct=1",
        "--ioengine=libaio",
        "--group_reporting",
        "--output-format=json",
    ]


def parse_fio_json(text: str, *, direction: str) -> FioResult:
    """Read the grouped bandwidth of `direction` from fio's `--output-format=json` report."""
    # fio prints notes (e.g. "fio: file hash not empty") before the JSON on some versions.
    start = text.find("{")
    if start < 0:
        raise ValueError(f"fio printed no JSON report; its output began with {text[:200]!r}")
    report = json.loads(text[start:])
    jobs = report.get("jobs") or []
    if not jobs:
        raise ValueError("fio JSON report has no jobs: was --group_reporting lost?")
    errors = [job.get("error", 0) for job in jobs if job.get("error", 0)]
    if errors:
        raise OSError(f"fio job failed with error code {errors[0]} (an errno)")
    stats = [job[direction] for job in jobs]
    moved = sum(int(s["io_bytes"]) for s in stats)
    rate = sum(float(s["bw_bytes"]) for s in stats)
    if moved <= 0 or rate <= 0:
        raise ValueError(f"fio report shows no {direction} traffic (io_bytes={moved}, bw_bytes={rate})")
    return FioResult(direction=direction, bytes_moved=moved, bytes_per_second=rate)


def run_fio(job: FioJob, *, executable: str, timeout_s: float = 600.0) -> FioResult:
    """Run `job` and return its bandwidth; raises OSError with fio's stderr when fio fails."""
    if not job.path.parent.is_dir():
        # fio would silently create the missing directories.
        raise ValueError(f"fio data file directory {job.path.parent} does not exist: pick an existing --path")
    done = subprocess.run(
        fio_command(job, executable=executable), capture_output=True, text=True, timeout=timeout_s
    )
    if done.returncode != 0:
        raise OSError(f"fio exited with {done.returncode}: {done.stderr.strip()[:500]}")
    result = parse_fio_json(done.stdout, direction=job.direction)
    if result.bytes_moved != job.total_bytes:
        raise OSError(f"fio moved {result.bytes_moved} bytes, expected {job.total_bytes}")
    return result
