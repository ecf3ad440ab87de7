"""`tierzero bench activations`: activation checkpointing alone against checkpointing with offload.

Both run stage 3 on the same GPT with parameters and optimizer states on NVMe and the
gradients in host memory (`--gradients`), the placement of a run short of device memory,
alternating step by step; each reports its median step time and the device tier's peak
(what the store held there, activations included), beside `tierzero estimate`'s
prediction of that peak.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tierzero.api import initialize
from tierzero.common.sizes import format_size
from tierzero.common.slices import Tier
from tierzero.config import load_config
from tierzero.estimate import estimate
from tierzero.models.builtin import PRESETS, build_model

__all__ = ["add_command", "command"]

MODES = {"checkpoint": {"checkpoint": 1}, "checkpoint+offload": {"checkpoint": 1, "offload": "cpu"}}


@dataclass(frozen=True, slots=True)
class ModeResult:
    seconds: list[float]
    device_peak: int
    activations: dict[str, int]
    predicted_peak: int


def _config(
    nvme_path: str, activations: dict[str, Any], *, seq: int, batch: int, preset: str, gradients: str
) -> dict[str, Any]:
    spec = PRESETS[preset]
    return {
        "zero": {"stage": 3},
        "model": {"type": "gpt", "n_layer": spec.n_layer, "n_head": spec.n_head, "d_model": spec.d_model,
                  "d_ff": spec.d_ff, "max_seq_len": max(seq, spec.max_seq_len)},
        "train": {"micro_batch_size": batch, "seq_len": seq},
        "optimizer": {"type": "adamw", "lr": 1e-4},
        "offload": {"params": "nvme", "gradients": gradients, "optimizer": "nvme"},
        "tiers": {"nvme": {"path": nvme_path}},
        "activations": activations,
    }  # fmt: skip


def bench_activations(
    *, nvme_path: str, preset: str, seq: int, batch: int, steps: int, warmup: int, gradients: str = "cpu"
) -> dict[str, ModeResult]:
    Path(nvme_path).mkdir(parents=True, exist_ok=True)
    engines, configs = {}, {}
    for name, acts in MODES.items():
        configs[name] = _config(nvme_path, acts, seq=seq, batch=batch, preset=preset, gradients=gradients)
        torch.manual_seed(0)
        engines[name] = initialize(build_model(load_config(configs[name]).model), configs[name])
    times: dict[str, list[float]] = {name: [] for name in MODES}
    try:
        for step in range(warmup + steps):
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(0, 256, (batch, seq + 1), generator=g)
            order = list(MODES) if step % 2 == 0 else list(MODES)[::-1]
            for name in order:
                engine = engines[name]
                if step == warmup:
                    engine.store.reset_peaks()
                started = time.perf_counter()
                _, loss = engine(tokens[:, :-1], tokens[:, 1:])
                engine.backward(loss)
                engine.step()
                if step >= warmup:
                    times[name].append(time.perf_counter() - started)
        results = {}
        for name, engine in engines.items():
            report = engine.memory_report()
            predicted = estimate(load_config(configs[name])).tiers[Tier.DEVICE].peak
            results[name] = ModeResult(times[name], report["tiers"]["device"]["peak"], report["activations"], predicted)
        return results
    finally:
        for engine in engines.values():
            engine.close()


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench activations`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "activations", help="activation checkpointing alone beside checkpointing with offload to the cpu tier",
        description="Stage 3 on a GPT at a long sequence, alternating: step time, device-tier peak, the estimate's.",
    )
    parser.add_argument("--nvme-path", required=True, help="directory for the swap files")
    parser.add_argument("--preset", default="30m", help="built-in GPT size (default 30m)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default 1024)")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch size (default 8)")
    parser.add_argument(
        "--gradients", default="cpu", choices=["device", "cpu", "nvme"], help="the gradients' home tier (default cpu)"
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps of each (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (default 1)")
    parser.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    results = bench_activations(
        nvme_path=args.nvme_path, preset=args.preset, seq=args.seq, batch=args.batch, steps=args.steps,
        warmup=args.warmup, gradients=args.gradients,
    )  # fmt: skip
    base = results["checkpoint"]
    print(
        f"GPT {args.preset}, seq {args.seq}, batch {args.batch}: stage 3, params + optimizer on NVMe, "
        f"gradients on {args.gradients}"
    )
    for name, r in results.items():
        print(
            f"  {name:<20} step {statistics.median(r.seconds):.2f} s "
            f"({statistics.median(r.seconds) / statistics.median(base.seconds):.2f}x)   device peak "
            f"{format_size(r.device_peak)} ({r.device_peak / base.device_peak:.2f}x; estimate {format_size(r.predicted_peak)}, "
            f"{r.predicted_peak / r.device_peak - 1:+.1%})   activations {', '.join(f'{t} {format_size(b)}' for t, b in r.activations.items() if b)}"
        )
    return 0
