"""The results of `bench nvme` as JSON sections, table rows and plot bars."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tierzero.cli.bench.nvme.results import PointResult
from tierzero.cli.bench.report import PlotBar
from tierzero.cli.bench.workload import Setting
from tierzero.common.sizes import format_size

TABLE_HEADERS = ["backend", "block", "qd", "threads", "write GB/s", "fio", "vs fio", "read GB/s", "fio", "vs fio"]


def _num(value: float | None, fmt: str = "{:.2f}") -> str:
    return "-" if value is None else fmt.format(value)


def table_rows(results: list[PointResult]) -> Iterator[list[str]]:
    for r in results:
        s = r.point.setting
        yield [
            r.point.backend, format_size(s.block_size), str(s.queue_depth), str(s.threads),
            _num(r.write.median), _num(r.write.fio_median), _num(r.write.vs_fio, "{:.0%}"),
            _num(r.read.median), _num(r.read.fio_median), _num(r.read.vs_fio, "{:.0%}"),
        ]


def runs_json(results: list[PointResult]) -> list[dict[str, Any]]:
    """One entry per point and direction: medians, every repeat, and fio beside them."""
    entries = []
    for result in results:
        s = result.point.setting
        for runs in (result.write, result.read):
            entries.append({
                "direction": runs.direction.value, "block_size": s.block_size, "queue_depth": s.queue_depth,
                "threads": s.threads, "backend": result.point.backend, "GBps": runs.median, "samples": runs.gbps,
                "fio_GBps": runs.fio_median, "fio_samples": runs.fio_gbps, "vs_fio": runs.vs_fio,
            })
    return entries


def fio_json(results: list[PointResult], *, version: str, iodepth: dict[Setting, int]) -> dict[str, Any]:
    """fio's runs, once per setting and direction (all backends of a setting share them)."""
    runs: list[dict[str, Any]] = []
    seen: set[tuple[Setting, str]] = set()
    for result in results:
        s = result.point.setting
        for r in (result.write, result.read):
            if (s, r.direction.value) in seen or not r.fio_gbps:
                continue
            seen.add((s, r.direction.value))
            runs.append({
                "direction": r.direction.value, "block_size": s.block_size, "queue_depth": s.queue_depth,
                "iodepth": iodepth[s], "numjobs": s.threads, "GBps": r.fio_median, "samples": r.fio_gbps,
            })
    best = {d: max((r["GBps"] for r in runs if r["direction"] == d), default=None) for d in ("read", "write")}
    return {"version": version, "runs": runs, "best_read_GBps": best["read"], "best_write_GBps": best["write"]}


def best_json(best: PointResult) -> dict[str, Any]:
    s = best.point.setting
    return {
        "read_GBps": best.read.median,
        "write_GBps": best.write.median,
        "block_size": s.block_size,
        "queue_depth": s.queue_depth,
        "threads": s.threads,
        "backend": best.point.backend,
        "read_vs_fio": best.read.vs_fio,
        "write_vs_fio": best.write.vs_fio,
    }


def plot_bars(results: list[PointResult]) -> list[PlotBar]:
    return [
        PlotBar(
            label=r.point.label, direction=runs.direction.value, gbps=runs.median,
            low=min(runs.gbps), high=max(runs.gbps), fio_gbps=runs.fio_median,
        )
        for r in results
        for runs in (r.write, r.read)
    ]


def ratio_lines(best: PointResult, fio: dict[str, Any] | None) -> list[str]:
    """The tierzero/fio ratios a reader looks for: at the best point, and against fio's best."""
    if fio is None:
        return ["fio not run (not on PATH, or --no-fio): no ratios"]
    lines = []
    for runs in (best.read, best.write):
        fio_best = fio[f"best_{runs.direction.value}_GBps"]
        lines.append(
            f"{runs.direction.value}: tierzero {runs.median:.2f} GB/s, fio beside it {_num(runs.fio_median)} GB/s "
            f"(ratio {_num(runs.vs_fio, '{:.0%}')}), fio best {_num(fio_best)} GB/s "
            f"(ratio {_num(runs.median / fio_best if fio_best else None, '{:.0%}')})"
        )
    return lines
