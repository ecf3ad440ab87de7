"""`tierzero bench train --device cuda`: model TFLOPS, host<->device bandwidth against pinned peak, prefetch hits.

`bench_train_device` alternates steps of plain PyTorch and tierzero on the device, as
the CPU bench does (tierzero/cli/bench/train/cpu.py), timing each step between two device
synchronisations. Then:

- model TFLOPS: 6 x parameters x tokens / median step time (the 6ND convention:
  embedding parameters counted, attention scores and recomputation not);
- host<->device bytes of one more tierzero step, read from the CUDA profiler's memcpy
  records (the bytes the hardware moved, whichever code moved them), as GB/s over the
  step and over the copies' own busy time, against the peak of a plain pinned->device
  copy of `peak_bytes` measured in the same run; pageable copies are counted apart;
- prefetch hit rate: the engine's own report, steps 2 on.

On the CPU (`tierzero bench gpu-check --dry-run`) the same code runs with host memory
as the device: no memcpy records, and the "peak" is a host memcpy.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tierzero.cli.bench.contenders import (
    PLACEMENTS,
    EngineTraining,
    PlainTraining,
    engine_config,
    gpt,
    max_param_difference,
    token_batch,
)
from tierzero.cli.bench.train.copies import GB, CopyPeak, Traffic, copy_peak, profiled_traffic
from tierzero.models.builtin import count_parameters

__all__ = ["DeviceTrainResult", "bench_train_device", "check_device"]

FLOPS_CONVENTION = "6 x parameters x tokens per step / median step time (embeddings counted, attention scores not)"


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceTrainResult:
    device: str
    device_name: str
    preset: str
    placement: dict[str, str]
    stage: int
    dtype: str
    clip: float
    seq: int
    batch: int
    params: int
    plain_seconds: tuple[float, ...]
    tierzero_seconds: tuple[float, ...]
    hit_rates: tuple[float, ...]
    """Prefetch hit rate of each tierzero step from the second on."""
    waited_s: tuple[float, ...]
    traffic: Traffic
    peak: CopyPeak
    max_param_difference: float
    flops_convention: str = FLOPS_CONVENTION
    notes: list[str] = field(default_factory=list)

    @property
    def flops_per_step(self) -> float:
        return 6.0 * self.params * self.batch * self.seq

    def tflops(self, seconds: tuple[float, ...]) -> float:
        return self.flops_per_step / statistics.median(seconds) / 1e12

    @property
    def hit_rate(self) -> float:
        return statistics.fmean(self.hit_rates) if self.hit_rates else 0.0

    def bandwidth(self) -> dict[str, float | None]:
        """GB/s each way: over the median tierzero step, over the copies' busy time, and that over the peak."""
        step = statistics.median(self.tierzero_seconds)
        t, peak = self.traffic, self.peak
        h2d_busy = t.h2d_bytes / t.h2d_busy_s / GB if t.h2d_busy_s > 0 else None
        d2h_busy = t.d2h_bytes / t.d2h_busy_s / GB if t.d2h_busy_s > 0 else None
        return {
            "h2d_gbs_over_step": t.h2d_bytes / step / GB,
            "d2h_gbs_over_step": t.d2h_bytes / step / GB,
            "h2d_gbs_while_copying": h2d_busy,
            "d2h_gbs_while_copying": d2h_busy,
            "h2d_fraction_of_peak": None if h2d_busy is None else h2d_busy / peak.h2d_gbs,
            "d2h_fraction_of_peak": None if d2h_busy is None else d2h_busy / peak.d2h_gbs,
        }

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["summary"] = {
            "plain_step_s": statistics.median(self.plain_seconds),
            "tierzero_step_s": statistics.median(self.tierzero_seconds),
            "plain_tflops": self.tflops(self.plain_seconds),
            "tierzero_tflops": self.tflops(self.tierzero_seconds),
            "hit_rate": self.hit_rate,
            **self.bandwidth(),
        }
        return out

    def format(self) -> str:
        s, bw, t = self.to_dict()["summary"], self.bandwidth(), self.traffic

        def gbs(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} GB/s"

        def share(value: float | None) -> str:
            return "" if value is None else f" ({value:.0%} of peak)"

        lines = [
            f"GPT {self.preset} ({self.params / 1e6:.1f} M params), seq {self.seq}, batch {self.batch}, {self.dtype}, "
            f"gradient clipping {self.clip:g} on {self.device_name}: stage {self.stage}, offload {self.placement}",
            f"  step (median)  plain {s['plain_step_s'] * 1e3:.1f} ms  {s['plain_tflops']:.2f} TFLOPS   "
            f"tierzero {s['tierzero_step_s'] * 1e3:.1f} ms  {s['tierzero_tflops']:.2f} TFLOPS",
            f"  TFLOPS = {self.flops_convention}",
            f"  host->device {t.h2d_bytes / 2**20:.1f} MiB/step: {gbs(bw['h2d_gbs_over_step'])} over the step, "
            f"{gbs(bw['h2d_gbs_while_copying'])} while copying{share(bw['h2d_fraction_of_peak'])}",
            f"  device->host {t.d2h_bytes / 2**20:.1f} MiB/step: {gbs(bw['d2h_gbs_over_step'])} over the step, "
            f"{gbs(bw['d2h_gbs_while_copying'])} while copying{share(bw['d2h_fraction_of_peak'])}",
            f"  peak ({self.peak.method}, {self.peak.nbytes / 2**20:.0f} MiB): "
            f"{self.peak.h2d_gbs:.1f} GB/s to the device, {self.peak.d2h_gbs:.1f} GB/s back; "
            f"{t.pageable_copies} of {t.copies} copies pageable",
            f"  prefetch hit rate from step 2: {self.hit_rate:.1%}; "
            f"largest parameter difference to plain PyTorch {self.max_param_difference:.2e}",
        ]
        return "\n".join(lines + [f"  note: {note}" for note in self.notes])

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def _timed(step: Callable[[], torch.Tensor], sync: Callable[[], None]) -> float:
    sync()
    started = time.perf_counter()
    step()
    sync()
    return time.perf_counter() - started


def check_device(device: str) -> None:
    """The device bench's refusals, each one line: `device` is cpu or cuda, and the one this machine has."""
    has_cuda = torch.cuda.is_available()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"the device bench runs on cpu or cuda, got {device!r}")
    if device == "cuda" and not has_cuda:
        raise ValueError(
            f"--device cuda needs a CUDA GPU and torch {torch.__version__} sees none: run it on a GPU machine, "
            "or `tierzero bench gpu-check --dry-run` to check the bench on the CPU"
        )
    if device == "cpu" and has_cuda:
        raise ValueError("tierzero computes on the GPU wherever one is visible: hide it (CUDA_VISIBLE_DEVICES=) for a cpu run")


def bench_train_device(
    *,
    device: str,
    nvme_path: str | Path,
    placement: str = "params-optimizer-nvme",
    stage: int = 3,
    preset: str = "30m",
    seq: int = 512,
    batch: int = 8,
    steps: int = 10,
    warmup: int = 2,
    dtype: str = "fp32",
    clip: float = 0.0,
    peak_bytes: int = 256 << 20,
) -> DeviceTrainResult:
    """Alternate plain and tierzero steps on `device` ("cuda", or "cpu" where no GPU is visible)."""
    if steps < 1 or warmup < 1:
        raise ValueError(f"the device bench needs steps >= 1 and warmup >= 1, got steps={steps}, warmup={warmup}")
    if placement not in PLACEMENTS:
        raise ValueError(f"unknown placement {placement!r}: pick one of {', '.join(PLACEMENTS)}")
    check_device(device)
    has_cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if has_cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(dev)) if has_cuda else (lambda: None)
    Path(nvme_path).mkdir(parents=True, exist_ok=True)
    peak = copy_peak(dev, nbytes=peak_bytes)
    chosen = PLACEMENTS[placement].for_stage(stage)
    params = count_parameters(gpt(preset))
    plain = PlainTraining(preset, clip=clip, dtype=dtype, device=dev)
    tz = EngineTraining(preset, engine_config(stage=stage, placement=chosen, nvme_path=nvme_path, clip=clip, dtype=dtype))
    times: dict[str, list[float]] = {"plain": [], "tierzero": []}
    hits: list[float] = []
    waited: list[float] = []
    try:
        for step in range(warmup + steps):
            tokens, targets = token_batch(step, batch=batch, seq=seq, device=dev)
            order = [("plain", plain), ("tierzero", tz)]
            for name, runner in order if step % 2 == 0 else order[::-1]:
                seconds = _timed(lambda runner=runner: runner.step(tokens, targets), sync)
                if step >= warmup:
                    times[name].append(seconds)
            report = tz.engine.prefetch_report()
            if step >= 1 and report is not None:
                hits.append(report.hit_rate)
                waited.append(report.waited_s)
        tokens, targets = token_batch(warmup + steps, batch=batch, seq=seq, device=dev)
        traffic = profiled_traffic(lambda: tz.step(tokens, targets), dev)
        plain.step(tokens, targets)
        difference = max_param_difference(tz.engine, plain.model)
    finally:
        tz.close()
    notes = [] if has_cuda else ["no CUDA: host memory is the device, so no host<->device copies are recorded"]
    return DeviceTrainResult(
        device=dev.type,
        device_name=torch.cuda.get_device_name(dev) if has_cuda else "cpu",
        preset=preset,
        placement=chosen.offload(),
        stage=stage,
        dtype=dtype,
        clip=clip,
        seq=seq,
        batch=batch,
        params=params,
        plain_seconds=tuple(times["plain"]),
        tierzero_seconds=tuple(times["tierzero"]),
        hit_rates=tuple(hits),
        waited_s=tuple(waited),
        traffic=traffic,
        peak=peak,
        max_param_difference=difference,
        notes=notes,
    )

