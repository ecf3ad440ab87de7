"""`tierzero bench gpu-check` (`make gpu-check`): the CUDA tests, the CUDA training bench and tierzero against DeepSpeed, one JSON.

It runs `pytest tests/gpu` in a child process (its junit XML beside the JSON, summarised
into it), then `bench train --device cuda` in this process, then, where DeepSpeed can be
imported, `bench train --against deepspeed`'s comparison at a short shape (`AGAINST_SHAPES`:
each contender alone in a child process, a few minutes at most even while DeepSpeed compiles
its CPU Adam), and writes one JSON: each test's outcome, the bench's figures, the
DeepSpeed ratio (or why it was skipped), the torch and CUDA versions, the device, and `ok`.
Without CUDA it writes `ok: false` with the reason and exits 2, unless `--dry-run`:
then CUDA is hidden (CUDA_VISIBLE_DEVICES=) from the tests and the bench, which run on
the CPU (the CUDA tests skip), so the report's plumbing is checked on any machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import torch

from tierzero import __version__
from tierzero.cli.bench.train.against import compare_with_deepspeed, deepspeed_missing
from tierzero.cli.bench.train.gpu import bench_train_device

__all__ = ["add_command", "build_report", "command", "environment", "junit_summary", "run_against", "run_bench", "run_tests"]

SCHEMA = 1
BENCH_SHAPES = {
    "cuda": {"preset": "30m", "seq": 512, "batch": 8, "steps": 10, "warmup": 2, "peak_bytes": 256 << 20},
    "dry-run": {"preset": "tiny", "seq": 32, "batch": 2, "steps": 2, "warmup": 1, "peak_bytes": 4 << 20},
}
"""The bench's model and batch in each mode: the dry run only has to exercise the code."""
AGAINST_SHAPES = {
    "cuda": {"preset": "30m", "seq": 512, "batch": 8, "steps": 3, "warmup": 1, "dtype": "bf16", "clip": 1.0},
    "dry-run": {"preset": "tiny", "seq": 32, "batch": 2, "steps": 2, "warmup": 1, "dtype": "fp32", "clip": 1.0},
}
"""tierzero against DeepSpeed, all in host memory (`--placement cpu`): issue 42's config at the bench's model, few steps."""
AGAINST_TIMEOUT_S = 150.0
"""Seconds each contender may take alone: DeepSpeed's first start on a machine compiles its CPU Adam (about a minute)."""
OUTCOMES = ("passed", "failed", "error", "skipped", "xfailed")
_JUNIT_OUTCOMES = {"failure": "failed", "error": "error", "skipped": "skipped"}


def environment() -> dict[str, Any]:
    """torch, CUDA and the device this process sees; the git commit when run in a checkout."""
    cuda = torch.cuda.is_available()
    props = torch.cuda.get_device_properties(0) if cuda else None
    return {
        "tierzero": __version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "cuda_available": cuda,
        "device_count": torch.cuda.device_count() if cuda else 0,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "device_memory_bytes": props.total_memory if props is not None else None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "git": _git(),
    }


def _git() -> dict[str, Any] | None:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
        status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(status.stdout.strip())}


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts by outcome and every test case of a pytest junit XML file."""
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in _JUNIT_OUTCOMES:
                xfail = child.tag == "skipped" and child.get("type") == "pytest.xfail"
                outcome, message = "xfailed" if xfail else _JUNIT_OUTCOMES[child.tag], child.get("message", "")
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"name": name, "outcome": outcome, "seconds": float(case.get("time", 0.0)), "message": message[:500]})
    counts = {outcome: sum(c["outcome"] == outcome for c in cases) for outcome in OUTCOMES}
    return {"total": len(cases), **counts, "cases": cases}


def run_tests(tests: Path, *, junit: Path, timeout_s: float, env: dict[str, str]) -> dict[str, Any]:
    """`pytest tests` in a child process, its junit XML written to `junit`, summarised."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tests), f"--junitxml={junit}"]
    cmd += ["-o", f"timeout={int(timeout_s)}"]
    junit.unlink(missing_ok=True)
    started = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env, check=False)
        returncode, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        returncode, output = None, f"pytest ran past {timeout_s:.0f} s: {exc}"
    summary = junit_summary(junit) if junit.exists() else {"total": 0, **dict.fromkeys(OUTCOMES, 0), "cases": []}
    return {
        "command": cmd,
        "returncode": returncode,
        "seconds": time.perf_counter() - started,
        "junit": str(junit),
        **summary,
        "output_tail": output[-3000:],
    }


def run_bench(*, mode: str, nvme_path: Path) -> dict[str, Any]:
    """`bench train --device ...` in this process; a failure is reported, not raised."""
    device = "cuda" if mode == "cuda" else "cpu"
    started = time.perf_counter()
    try:
        result = bench_train_device(device=device, nvme_path=nvme_path, **BENCH_SHAPES[mode])
    except Exception as exc:  # noqa: BLE001 - the report says what broke; the tests' results still count
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    return {"ok": True, "seconds": time.perf_counter() - started, "text": result.format(), **result.to_dict()}


def run_against(*, mode: str, nvme_path: Path) -> dict[str, Any]:
    """tierzero against DeepSpeed where DeepSpeed can be imported, else skipped with the line that says how to
    install it; a failure is reported, not raised."""
    if (missing := deepspeed_missing()) is not None:
        return {"ok": True, "skipped": missing}
    started = time.perf_counter()
    try:
        result = compare_with_deepspeed(nvme_path=nvme_path, timeout_s=AGAINST_TIMEOUT_S, **AGAINST_SHAPES[mode])
    except Exception as exc:  # noqa: BLE001 - the report says what broke; the tests' and the bench's results still count
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]}
    return {"ok": True, "seconds": time.perf_counter() - started, "text": result.format(), **result.to_dict()}


def build_report(
    *,
    mode: str,
    env: dict[str, Any],
    tests: dict[str, Any] | None,
    bench: dict[str, Any] | None,
    error: str | None = None,
    against: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON's content; `ok` is whether everything ran and passed (in a dry run: ran, the CUDA tests skipped).
    DeepSpeed's failure counts on CUDA only: the dry run checks the report, not DeepSpeed's own CPU path."""
    problems = [error] if error else []
    if tests is not None:
        if tests["returncode"] is None:
            problems.append("pytest ran past its time limit (--test-timeout) and was stopped")
        elif tests["returncode"] != 0:
            problems.append(f"pytest exited {tests['returncode']}: {tests['failed']} failed, {tests['error']} errors")
        if tests["total"] == 0:
            problems.append("pytest ran no tests")
        if mode == "cuda" and tests["skipped"]:
            problems.append(f"{tests['skipped']} CUDA tests skipped on a machine with CUDA")
    if bench is not None and not bench["ok"]:
        problems.append(f"bench: {bench['error']}")
    if mode == "cuda" and against is not None and not against["ok"]:
        problems.append(f"against deepspeed: {against['error']}")
    return {
        "schema": SCHEMA,
        "mode": mode,
        "ok": not problems,
        "problems": problems,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "environment": env,
        "tests": tests,
        "bench": bench,
        "against": against,
    }


def write_report(report: dict[str, Any], out: Path) -> None:
    """Written whole or not at all: a half-written report is never read as one."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(report, indent=2) + "\n")
    partial.replace(out)


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench gpu-check`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "gpu-check", help="tests/gpu and bench train --device cuda in one run, one JSON of results (make gpu-check)",
        description="Run the CUDA tests and the CUDA training bench, and where DeepSpeed is installed tierzero against "
        "DeepSpeed (bench train --against deepspeed, a few steps), and write what they found, with the torch and "
        "CUDA versions and the device, to one JSON file. Fails without CUDA unless --dry-run.",
    )
    parser.add_argument("--out", default="gpu-check.json", help="the JSON report (default gpu-check.json)")
    parser.add_argument("--tests", default="tests/gpu", help="the CUDA tests (default tests/gpu)")
    parser.add_argument("--nvme-path", default=".tierzero-swap", help="the bench's swap directory (default .tierzero-swap)")
    parser.add_argument("--test-timeout", type=float, default=210.0, help="seconds pytest may run (default 210)")
    parser.add_argument(
        "--dry-run", action="store_true", help="no GPU: hide CUDA, run the same tests (they skip) and bench on the CPU"
    )
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    """Run the check and write the report; 0 when `ok`, 1 when something failed, 2 without CUDA."""
    out, mode = Path(args.out), "dry-run" if args.dry_run else "cuda"
    env = dict(os.environ)
    if args.dry_run:
        # Before anything asks CUDA for its devices: the runtime reads this once, at start-up.
        os.environ["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        error = (
            f"no CUDA device: torch {torch.__version__} (CUDA {torch.version.cuda}) sees none. "
            "Run it on a GPU machine, or `make gpu-check DRY_RUN=1` to check the report on the CPU"
        )
        write_report(build_report(mode=mode, env=environment(), tests=None, bench=None, error=error), out)
        print(f"gpu-check: {error}; wrote {out}", file=sys.stderr)
        return 2
    tests = Path(args.tests)
    if not tests.is_dir():
        raise ValueError(f"gpu-check: no test directory {tests}: run it from the repository root or pass --tests")
    started = time.perf_counter()
    test_results = run_tests(tests, junit=out.with_suffix(".junit.xml"), timeout_s=args.test_timeout, env=env)
    bench = run_bench(mode=mode, nvme_path=Path(args.nvme_path))
    against = run_against(mode=mode, nvme_path=Path(args.nvme_path) / "against")
    report = build_report(mode=mode, env=environment(), tests=test_results, bench=bench, against=against)
    report["seconds"] = time.perf_counter() - started
    write_report(report, out)
    print(_summary_line(report, out))
    if bench.get("text"):
        print(bench["text"])
    if against.get("text"):
        print(against["text"])
    elif "skipped" in against:
        print(f"gpu-check: tierzero against DeepSpeed skipped: {against['skipped']}")
    elif mode == "dry-run":  # on CUDA the failure is among the problems below
        print(f"gpu-check: tierzero against DeepSpeed failed (not counted in a dry run): {against['error']}", file=sys.stderr)
    for problem in report["problems"]:
        print(f"gpu-check: {problem}", file=sys.stderr)
    return 0 if report["ok"] else 1


def _summary_line(report: dict[str, Any], out: Path) -> str:
    tests = report["tests"]
    counts = ", ".join(f"{tests[o]} {o}" for o in OUTCOMES if tests[o])
    verdict = "ok" if report["ok"] else "FAILED"
    return f"gpu-check ({report['mode']}, {report['environment']['device']}): {verdict}; tests: {counts or 'none'}; wrote {out}"
