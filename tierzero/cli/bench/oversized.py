"""`tierzero bench oversized`: the oversized preset with `offload: auto` beside its own placement, in one command.

Each run is a `tierzero train` in a child process of its own, so that its peak RSS is its own
(`os.wait4`) and nothing of one run's memory or threads is left to the next. The runs go in
turn: auto under a cpu budget, the config's own placement (everything on NVMe in
configs/oversized.yaml), auto again, so that a machine whose speed drifts shows it as two
auto figures apart. They share one swap directory under `--nvme-path`, which the engine
empties as it closes (checked before each run) and the bench removes at the end; one
directory keeps the disk's measured rates for the second plan (placement/disk.py).

Per run: the median step after the first (the first pays for the plan's kernels and the
disk's cold start), the planner's prediction beside it, peak RSS, the losses. Then each auto
run's step against the other placement's (the median of its runs), beside `TARGET_SPEEDUP`;
peak RSS against the budget plus `RSS_SLACK`; the prediction against `PREDICTION_TOLERANCE`;
whether the losses agree step for step. `--cgroup SIZE` adds a run of auto with no cpu capacity inside a cgroup
v1 memory limit of SIZE (MACHINE.md's recipe): its exit status, the cgroup's peak usage, and
whether the kernel killed anything in it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from tierzero.common.cgroup import memory_cgroup_of
from tierzero.common.sizes import format_size, parse_size

__all__ = ["PREDICTION_TOLERANCE", "RSS_SLACK", "TARGET_SPEEDUP", "BenchRun", "CgroupRun", "OversizedResult", "add_command", "bench_oversized"]

#: How far above the cpu budget auto's peak RSS may go: the interpreter, torch and the activations.
RSS_SLACK = parse_size("1.5GiB")
#: How far the planner's predicted step may lie from the measured one.
PREDICTION_TOLERANCE = 0.15
#: How much faster than the config's own placement auto's step should be (issue 14).
TARGET_SPEEDUP = 2.0
_SWAP = "tierzero-bench-oversized"
_CHILD = "import sys; from tierzero.cli.main import main; sys.exit(main())"


@dataclass(frozen=True, slots=True)
class BenchRun:
    """One `tierzero train` of the bench: its name and `--set` overrides; `budget`, the cpu budget
    its peak RSS is held to (plus `RSS_SLACK`), where it has one."""

    name: str
    overrides: tuple[str, ...] = ()
    budget: int | None = None


@dataclass(slots=True)
class CgroupRun:
    """What a run inside a cgroup v1 memory limit left in the cgroup's counters."""

    limit: int
    max_usage: int
    failcnt: int
    oom_kills: int


@dataclass(slots=True)
class RunResult:
    name: str
    returncode: int
    peak_rss: int
    budget: int | None = None
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    predicted_step_s: float | None = None
    cgroup: CgroupRun | None = None

    @property
    def step_s(self) -> float | None:
        """The median step after the first."""
        return statistics.median(self.step_seconds[1:]) if len(self.step_seconds) > 1 else None

    @property
    def prediction_error(self) -> float | None:
        """(predicted - measured) / measured."""
        measured = self.step_s
        return None if self.predicted_step_s is None or not measured else self.predicted_step_s / measured - 1.0

    def row(self) -> str:
        step = "-" if self.step_s is None else f"{self.step_s:.2f} s"
        error = self.prediction_error
        predicted = "-" if error is None else f"{self.predicted_step_s:.2f} s ({error:+.0%})"
        rss = format_size(self.peak_rss) + ("" if self.budget is None else f" (budget {format_size(self.budget)})")
        status = "" if self.returncode == 0 else f"  exit {self.returncode}"
        return f"  {self.name:<10} {step:>10}  {predicted:>16}  {rss}{status}"


@dataclass(slots=True)
class OversizedResult:
    runs: list[RunResult]
    subject: str
    """The name of the runs set beside the others (auto)."""
    against: str
    """The name of the runs they are set beside (the config's own placement)."""

    def ratios(self) -> list[float]:
        """The median step of the `against` runs over each `subject` run's, in order."""
        others = [r.step_s for r in self.runs if r.name == self.against and r.step_s]
        subjects = [r.step_s for r in self.runs if r.name == self.subject and r.cgroup is None and r.step_s]
        return [statistics.median(others) / step for step in subjects] if others else []

    def losses_agree(self) -> bool:
        """Whether every run outside a cgroup trained and agrees with the first at each step both took;
        a run that took no step agrees with nothing (it failed, or never began)."""
        trained = [r.losses for r in self.runs if r.cgroup is None]
        return bool(trained) and all(trained) and all(losses == trained[0][: len(losses)] for losses in trained)

    def format(self) -> str:
        lines = [f"  {'run':<10} {'step':>10}  {'predicted':>16}  peak RSS", *(r.row() for r in self.runs)]
        ratios = self.ratios()
        if ratios:
            met = "met" if min(ratios) >= TARGET_SPEEDUP else "missed"
            lines.append(
                f"{self.subject} against {self.against}: " + ", ".join(f"{x:.2f}x" for x in ratios)
                + f" (target {TARGET_SPEEDUP:.2f}x: {met})"
            )  # fmt: skip
        for run in self.runs:
            if run.budget is not None:
                within = run.peak_rss <= run.budget + RSS_SLACK
                lines.append(
                    f"{run.name} peak RSS {format_size(run.peak_rss)} against {format_size(run.budget)} + "
                    f"{format_size(RSS_SLACK)}: {'within' if within else 'OVER'}"
                )
            error = run.prediction_error
            if error is not None and run.cgroup is None:
                held = "within" if abs(error) <= PREDICTION_TOLERANCE else "OUTSIDE"
                lines.append(f"{run.name} prediction {error:+.0%}: {held} {PREDICTION_TOLERANCE:.0%}")
            if run.cgroup is not None:
                c = run.cgroup
                lines.append(
                    f"{run.name} in a {format_size(c.limit)} cgroup: exit {run.returncode}, {len(run.losses)} steps, peak usage "
                    f"{format_size(c.max_usage)}, failcnt {c.failcnt}, {c.oom_kills} OOM kills"
                )
        lines.append(f"losses equal at every step: {'yes' if self.losses_agree() else 'NO'}")
        return "\n".join(lines) + "\n"

    def ok(self) -> bool:
        return all(r.returncode == 0 and (r.cgroup is None or r.cgroup.oom_kills == 0) for r in self.runs)


def bench_oversized(
    *, config: str | os.PathLike[str], nvme_path: str | os.PathLike[str], steps: int, runs: Sequence[BenchRun],
    subject: str = "auto", against: str, cgroup: tuple[BenchRun, int] | None = None, out: TextIO,
    python: str = sys.executable,
) -> OversizedResult:  # fmt: skip
    """Train `config` once per run of `runs`, and once more where `cgroup` gives a run and the
    bytes of its cgroup's memory limit, each in a child process; what each did."""
    swap = Path(nvme_path) / _SWAP
    if swap.exists():
        raise OSError(f"{swap} exists: a bench left it behind or it is yours; remove it or pass another --nvme-path")
    swap.mkdir(parents=True)
    results = []
    try:
        plan: list[tuple[BenchRun, int | None]] = [(run, None) for run in runs] + ([cgroup] if cgroup else [])
        for run, limit in plan:
            if any(swap.iterdir()):
                raise OSError(f"{swap} still holds {sorted(p.name for p in swap.iterdir())} after a run: not starting another")
            out.write(f"{run.name}: tierzero train {' '.join('--set ' + o for o in run.overrides)}"
                      f"{'' if limit is None else f' in a {format_size(limit)} cgroup'}\n")  # fmt: skip
            out.flush()
            results.append(_train(python, config, swap, steps, run, limit, out))
    finally:
        shutil.rmtree(swap, ignore_errors=True)
    return OversizedResult(runs=results, subject=subject, against=against)


def _train(python: str, config: Any, swap: Path, steps: int, run: BenchRun, limit: int | None, out: TextIO) -> RunResult:
    summary = swap.parent / f"{_SWAP}-{run.name}.json"
    argv = [python, "-c", _CHILD, "train", "--config", str(config), "--nvme-path", str(swap), "--no-progress",
            "--set", f"train.steps={steps}", "--summary-json", str(summary)]  # fmt: skip
    for override in run.overrides:
        argv += ["--set", override]
    with _memory_cgroup(limit) as enter:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, preexec_fn=enter if limit else None)
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                out.write(f"  | {line}")
        except BaseException:
            proc.terminate()  # tierzero train closes its engine and swap files on SIGTERM
            raise
        finally:  # the child is gone before its cgroup and swap directory are removed
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
        counters = enter.counters() if limit else None
    result = RunResult(name=run.name, returncode=proc.returncode, peak_rss=usage.ru_maxrss * 1024, budget=run.budget)
    if limit is not None:
        result.cgroup = CgroupRun(limit=limit, **counters)
    try:
        done = json.loads(summary.read_text())
    except FileNotFoundError:
        return result
    finally:
        summary.unlink(missing_ok=True)
    result.losses, result.step_seconds = done["losses"], done["step_seconds"]
    result.predicted_step_s = done["predicted_step_s"]
    return result


class _memory_cgroup:
    """A cgroup v1 memory cgroup of `limit` bytes under this process's own, entered by the child
    (`preexec_fn`), removed on exit; nothing where `limit` is None."""

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.path: Path | None = None

    def __enter__(self) -> _memory_cgroup:
        if self.limit is None:
            return self
        need = "--cgroup needs a writable cgroup v1 memory controller (MACHINE.md)"
        try:
            located = memory_cgroup_of(Path("/proc/self/cgroup"))
            if located is None or located[0] != 1:
                raise OSError(f"{need}: this process's memory controller is {'not there' if located is None else 'on cgroup v2'}")
            path = Path("/sys/fs/cgroup/memory", located[1].lstrip("/"), f"tierzero-bench-{os.getpid()}")
            path.mkdir()
            self.path = path
            (path / "memory.limit_in_bytes").write_text(str(self.limit))
        except (OSError, ValueError) as exc:
            self.__exit__()
            raise OSError(str(exc) if str(exc).startswith(need) else f"{need}: {exc}") from None
        return self

    def __call__(self) -> None:
        if self.path is not None:
            (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def counters(self) -> dict[str, int]:
        assert self.path is not None
        oom = dict(line.split() for line in (self.path / "memory.oom_control").read_text().splitlines())
        return {
            "max_usage": int((self.path / "memory.max_usage_in_bytes").read_text()),
            "failcnt": int((self.path / "memory.failcnt").read_text()),
            "oom_kills": int(oom.get("oom_kill", 0)),
        }

    def __exit__(self, *exc: object) -> None:
        if self.path is not None:
            self.path.rmdir()


def _command(args: argparse.Namespace) -> int:
    budget = parse_size(args.cpu_capacity)
    auto = BenchRun("auto", ("offload=auto", f"tiers.cpu.capacity={args.cpu_capacity}"), budget=budget)
    result = bench_oversized(
        config=args.config, nvme_path=args.nvme_path, steps=args.steps, runs=[auto, BenchRun("config"), auto],
        against="config", cgroup=None if args.cgroup is None else (BenchRun("auto", ("offload=auto",)), parse_size(args.cgroup)),
        out=sys.stdout,
    )  # fmt: skip
    print(result.format(), end="")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": [asdict(r) for r in result.runs], "ratios": result.ratios()}, indent=2))
    return 0 if result.ok() else 1


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench oversized`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "oversized", help="offload: auto beside the config's own placement (the oversized preset's all-NVMe), in child processes",
        description="tierzero train of --config, each run a child process: auto under --cpu-capacity, the config as it "
        "is, auto again; the median step after the first, the prediction, peak RSS (held to the budget + "
        f"{format_size(RSS_SLACK)}), the losses; with --cgroup, auto once more inside a cgroup v1 memory limit.",
    )  # fmt: skip
    parser.add_argument("--config", default="configs/oversized.yaml", help="the config to train (default: configs/oversized.yaml)")
    parser.add_argument("--nvme-path", required=True, help="the swap files go under DIR/" + _SWAP)
    parser.add_argument("--cpu-capacity", default="14GiB", help="auto's cpu budget, tiers.cpu.capacity (default 14GiB)")
    parser.add_argument("--steps", type=int, default=5, help="steps of each run (default 5)")
    parser.add_argument("--cgroup", default=None, metavar="SIZE", help="also run auto with no cpu capacity in a cgroup of SIZE")
    parser.add_argument("--json", help="also write the result here")
    parser.set_defaults(func=_command)
