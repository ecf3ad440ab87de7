"""`bench train --device cuda --against deepspeed`: tierzero and DeepSpeed each trained alone, the ratio of their steps.

Issue 42 asks tierzero's step to take at most half DeepSpeed's on the same GPU (a 2B GPT all
in host memory, bf16, clip 1.0, batch 8 x 1024; DeepSpeed took 1.56 s on an H200).
`compare_with_deepspeed` runs each contender in a child process of its own (train/alone.py
says why), tierzero first, on the same GPT preset, batches and steps, and returns both runs:
median step after the warm-up, device peak, start-up, losses, and the ratio. `bench train`
runs them before its own plain-vs-tierzero steps, while this process holds nothing on the
device or in pinned memory. DeepSpeed is an optional extra (`gpu-compare`), never needed by
the tests, which stand a fake `deepspeed` module in for it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tierzero.cli.bench.train.alone import CONTENDERS, OFFLOAD_DEVICES, AloneSpec, ContenderRun, deepspeed_config
from tierzero.models.builtin import PRESETS

__all__ = ["AGAINST", "TARGET_RATIO", "AgainstResult", "check_against", "compare_with_deepspeed", "deepspeed_missing"]

AGAINST = ("deepspeed",)
"""What `--against` can name."""
TARGET_RATIO = 0.5
"""Issue 42: tierzero's median step over DeepSpeed's, at most."""


def deepspeed_missing() -> str | None:
    """One line saying how to install DeepSpeed where this Python cannot import it; None where it can."""
    if importlib.util.find_spec("deepspeed") is not None:
        return None
    return (
        f"--against deepspeed: DeepSpeed is not installed for {sys.executable}: `pip install deepspeed` "
        "(or the optional extra: pip install -e '.[gpu-compare]'), on the machine with the GPU"
    )


def check_against(*, device: str, placement: str) -> None:
    """`--against deepspeed`'s refusals, each one line, before anything is built."""
    if device != "cuda":
        raise ValueError(
            f"--against deepspeed needs --device cuda, got --device {device}: DeepSpeed's ZeRO-3 offload moves "
            "state between host memory and a GPU, and on the CPU there is no device to offload from"
        )
    if placement not in OFFLOAD_DEVICES:
        raise ValueError(
            f"--against deepspeed matches --placement {' or '.join(OFFLOAD_DEVICES)} (DeepSpeed's offload_param and "
            f"offload_optimizer to cpu, or none), got --placement {placement}: pass --placement cpu"
        )
    if (missing := deepspeed_missing()) is not None:
        raise ValueError(missing)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgainstResult:
    contender: str
    """What tierzero ran against: deepspeed."""
    preset: str
    seq: int
    batch: int
    dtype: str
    clip: float
    placement: str
    config: dict[str, Any]
    """The contender's own config (DeepSpeed's JSON)."""
    tierzero: ContenderRun
    other: ContenderRun
    target: float = TARGET_RATIO

    @property
    def ratio(self) -> float:
        """tierzero's median step over the contender's."""
        return self.tierzero.median_s / self.other.median_s

    @property
    def max_loss_difference(self) -> float:
        """The largest difference of the two's losses, step by step: both trained the same model on the same batches."""
        return max(abs(a - b) for a, b in zip(self.tierzero.losses, self.other.losses, strict=True))

    def to_dict(self) -> dict[str, Any]:
        shape = {name: getattr(self, name) for name in ("preset", "seq", "batch", "dtype", "clip", "placement")}
        return {
            "contender": self.contender,
            "version": self.other.version,
            **shape,
            "ratio": self.ratio,
            "target_ratio": self.target,
            "met": self.ratio <= self.target,
            "max_loss_difference": self.max_loss_difference,
            "config": self.config,
            "tierzero": self.tierzero.to_dict(),
            self.contender: self.other.to_dict(),
        }

    def format(self) -> str:
        tz, other, name = self.tierzero, self.other, "DeepSpeed"
        offload = OFFLOAD_DEVICES[self.placement]
        warmup = len(tz.losses) - len(tz.step_s)

        def gib(run: ContenderRun) -> str:
            return "-" if run.device_peak_bytes is None else f"{run.device_peak_bytes / 2**30:.1f} GiB"

        return "\n".join([
            f"against {name} {other.version}: ZeRO-3, "
            + (f"offload_param + offload_optimizer {offload}" if offload != "none" else "no offload")
            + f", {self.dtype}, clip {self.clip:g}; each alone in a child process, median of {len(tz.step_s)} steps after {warmup}",
            f"  step (median)  tierzero {tz.median_s * 1e3:.1f} ms   {name} {other.median_s * 1e3:.1f} ms   "
            f"ratio {self.ratio:.2f}x (target <= {self.target:.2f}: {'met' if self.ratio <= self.target else 'missed'})",
            f"  device peak    tierzero {gib(tz)}   {name} {gib(other)}",
            f"  start-up       tierzero {tz.build_s:.1f} s   {name} {other.build_s:.1f} s (model built and engine initialized)",
            f"  losses: largest difference {self.max_loss_difference:.1e} over {len(tz.losses)} steps",
        ])  # fmt: skip


def compare_with_deepspeed(
    *,
    nvme_path: str | Path,
    preset: str,
    seq: int,
    batch: int,
    steps: int,
    warmup: int,
    dtype: str,
    clip: float,
    placement: str = "cpu",
    timeout_s: float | None = None,
) -> AgainstResult:
    """tierzero, then DeepSpeed, each alone in a child process on the same model, batches and steps;
    `timeout_s` bounds each child."""
    if steps < 1 or warmup < 1:
        raise ValueError(f"--against needs --steps >= 1 and --warmup >= 1, got {steps} and {warmup}")
    if preset not in PRESETS:
        raise ValueError(f"--preset {preset}: the built-in GPTs are {', '.join(PRESETS)}")
    config = deepspeed_config(
        batch=batch, clip=clip, dtype=dtype, placement=placement, hidden=PRESETS[preset].d_model, pin=torch.cuda.is_available()
    )
    shape = {"preset": preset, "seq": seq, "batch": batch, "dtype": dtype, "clip": clip, "placement": placement}
    runs: dict[str, ContenderRun] = {}
    with tempfile.TemporaryDirectory(prefix="tierzero-against-") as tmp:
        for which in CONTENDERS:
            spec = AloneSpec(
                which=which, steps=steps, warmup=warmup, nvme_path=str(Path(nvme_path) / f"alone-{which}"),
                result=str(Path(tmp) / f"{which}.json"), **shape,
            )  # fmt: skip
            runs[which] = _run_alone(spec, timeout_s=timeout_s)
    return AgainstResult(contender="deepspeed", config=config, tierzero=runs["tierzero"], other=runs["deepspeed"], **shape)


def _run_alone(spec: AloneSpec, *, timeout_s: float | None) -> ContenderRun:
    """One child (train/alone.py's `run_alone`), in a session of its own: a timeout stops it and whatever it
    started (DeepSpeed compiles its CPU Adam with ninja on first use)."""
    code = f"from tierzero.cli.bench.train.alone import run_alone; run_alone({json.dumps(asdict(spec))!r})"
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = child.communicate(timeout=timeout_s)
    except BaseException as exc:  # a timeout or Ctrl-C: its session would outlive this process otherwise
        os.killpg(child.pid, signal.SIGKILL)
        child.communicate()
        if isinstance(exc, subprocess.TimeoutExpired):
            raise RuntimeError(f"{spec.which} alone ran past {timeout_s:.0f} s and was stopped") from None
        raise
    if child.returncode != 0:
        raise RuntimeError(f"{spec.which} alone failed (exit {child.returncode}); its output ends:\n{output[-3000:]}")
    return ContenderRun.from_dict(json.loads(Path(spec.result).read_text()))
