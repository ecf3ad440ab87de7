"""Host<->device copies: what a step moved, from the CUDA profiler's memcpy records, and the peak of a plain copy.

The profiler sees every copy the hardware ran, whichever thread or stream queued it, so
the bytes counted are the step's own, not a second account kept beside the engine's.
Its Chrome trace names each copy "Memcpy HtoD (Pinned -> Device)" and the like
(category `gpu_memcpy`), with its bytes and its duration in microseconds.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

__all__ = ["GB", "CopyPeak", "Traffic", "copy_peak", "memcpy_traffic", "profiled_traffic"]

GB = 1e9


@dataclass(frozen=True, slots=True, kw_only=True)
class CopyPeak:
    """A plain copy of `nbytes` from pinned host memory to the device and back, at its best of `repeats`."""

    nbytes: int
    h2d_gbs: float
    d2h_gbs: float
    method: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Traffic:
    """Host<->device copies of one step, from the profiler's memcpy records."""

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    h2d_busy_s: float = 0.0
    d2h_busy_s: float = 0.0
    copies: int = 0
    pageable_copies: int = 0
    """Copies from or to pageable host memory: each blocks the host and runs below pinned speed."""


def memcpy_traffic(events: Iterable[Mapping[str, Any]]) -> Traffic:
    """Sum the host<->device `gpu_memcpy` events of a Chrome trace (`torch.profiler`'s export)."""
    totals = {"HtoD": [0, 0.0], "DtoH": [0, 0.0]}
    copies = pageable = 0
    for event in events:
        name = str(event.get("name", ""))
        direction = next((d for d in totals if d.lower() in name.lower()), None)
        if event.get("cat") != "gpu_memcpy" or direction is None:
            continue
        totals[direction][0] += int(event.get("args", {}).get("bytes", 0))
        totals[direction][1] += float(event.get("dur", 0.0)) / 1e6
        copies += 1
        pageable += "pageable" in name.lower()
    return Traffic(
        h2d_bytes=int(totals["HtoD"][0]),
        d2h_bytes=int(totals["DtoH"][0]),
        h2d_busy_s=totals["HtoD"][1],
        d2h_busy_s=totals["DtoH"][1],
        copies=copies,
        pageable_copies=pageable,
    )


def copy_peak(device: torch.device, *, nbytes: int, repeats: int = 5) -> CopyPeak:
    """The best of `repeats` plain copies each way; CUDA events time them on the device."""
    cuda = device.type == "cuda"
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    other = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def best(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src, non_blocking=cuda)  # warm-up: first-touch pages, driver set-up
        seconds = []
        for _ in range(repeats):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                dst.copy_(src, non_blocking=True)
                end.record()
                end.synchronize()
                seconds.append(start.elapsed_time(end) / 1e3)
            else:
                started = time.perf_counter()
                dst.copy_(src)
                seconds.append(time.perf_counter() - started)
        return nbytes / min(seconds) / GB

    return CopyPeak(
        nbytes=nbytes,
        h2d_gbs=best(other, host),
        d2h_gbs=best(host, other),
        method="pinned host <-> CUDA copy, CUDA events" if cuda else "host memcpy (no CUDA: the dry run's stand-in)",
    )


def profiled_traffic(step: Callable[[], torch.Tensor], device: torch.device) -> Traffic:
    """The host<->device copies of `step()`, as the profiler recorded them (none on the CPU)."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    return memcpy_traffic(events)
