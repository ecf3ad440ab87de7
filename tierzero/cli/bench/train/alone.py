"""One contender of `bench train --against deepspeed` trained alone, in a process of its own: tierzero or DeepSpeed.

DeepSpeed initializes torch.distributed and patches torch as it starts, so it never runs in
tierzero's process. tierzero's side runs the same way, in a child of its own, so that both are
timed alike: step after step with nothing in between (in `bench train`'s own process the plain
contender's step runs between two of tierzero's, while tierzero's host work may still be going),
and each device peak is that contender's alone. The parent (train/against.py) passes an
`AloneSpec` as JSON; the child writes its `ContenderRun` as JSON to `spec.result`, never to
stdout, which DeepSpeed's logging shares.

DeepSpeed's config is scripts/ds_gpu.py's from the first GPU run (shared/gpu-h200): ZeRO-3,
parameters and optimizer offloaded to host memory (pinned on a GPU), bf16, gradient clipping,
AdamW as tierzero's, and the bucket sizes transformers' "auto" derives from the hidden size.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tierzero import __version__
from tierzero.cli.bench.contenders import LR, PLACEMENTS, EngineSteps, EngineTraining, engine_config, gpt, token_batch
from tierzero.models.builtin import PRESETS

__all__ = ["CONTENDERS", "OFFLOAD_DEVICES", "AloneSpec", "ContenderRun", "DeepSpeedTraining", "deepspeed_config", "run_alone"]

CONTENDERS = ("tierzero", "deepspeed")
OFFLOAD_DEVICES = {"cpu": "cpu", "device": "none"}
"""tierzero's placements DeepSpeed has a match for -> the device of its `offload_param` and `offload_optimizer`
(ZeRO-3 offloads gradients with the optimizer, as tierzero's `cpu` placement keeps them)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class AloneSpec:
    which: str
    """tierzero or deepspeed."""
    preset: str
    seq: int
    batch: int
    steps: int
    """Timed steps, after `warmup` untimed ones; both contenders get batches 0, 1, ... (`token_batch`)."""
    warmup: int
    dtype: str
    clip: float
    placement: str
    """A key of OFFLOAD_DEVICES: tierzero's placement, and DeepSpeed's offload that matches it."""
    nvme_path: str
    result: str
    """Where the child writes its ContenderRun as JSON."""

    def __post_init__(self) -> None:
        if self.which not in CONTENDERS:
            raise ValueError(f"a contender alone is one of {', '.join(CONTENDERS)}, got {self.which!r}")
        if self.placement not in OFFLOAD_DEVICES:
            raise ValueError(f"DeepSpeed matches placements {', '.join(OFFLOAD_DEVICES)}, got {self.placement!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class ContenderRun:
    which: str
    version: str
    build_s: float
    """Seconds from building the model to an engine ready to train."""
    step_s: tuple[float, ...]
    """Each timed step, between two device synchronisations."""
    losses: tuple[float, ...]
    """Every step's loss, warm-up included."""
    device_peak_bytes: int | None
    """torch.cuda.max_memory_allocated over the whole run (build included); None on the CPU."""

    @property
    def median_s(self) -> float:
        return statistics.median(self.step_s)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "median_s": self.median_s}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ContenderRun:
        fields = {k: v for k, v in data.items() if k != "median_s"}
        return cls(**{**fields, "step_s": tuple(fields["step_s"]), "losses": tuple(fields["losses"])})


def deepspeed_config(*, batch: int, clip: float, dtype: str, placement: str, hidden: int, pin: bool) -> dict[str, Any]:
    """DeepSpeed's side: ZeRO-3 offloading as `placement` does, bf16 when `dtype` is, AdamW as tierzero's."""
    offload = OFFLOAD_DEVICES[placement]
    zero: dict[str, Any] = {
        "stage": 3, "overlap_comm": True, "contiguous_gradients": True,
        # the values transformers' "auto" derives from the hidden size, as most users run it
        "reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
    }  # fmt: skip
    if offload != "none":
        zero["offload_param"] = {"device": offload, "pin_memory": pin}
        zero["offload_optimizer"] = {"device": offload, "pin_memory": pin}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": clip,
        "bf16": {"enabled": dtype == "bf16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
        "zero_optimization": zero,
    }


class DeepSpeedTraining(EngineSteps):
    """DeepSpeed as one rank of one, as EngineTraining is tierzero: its process group on a free local
    port, its engine over the same seeded GPT."""

    def __init__(self, spec: AloneSpec, device: torch.device) -> None:
        import deepspeed  # the optional extra (gpu-compare), imported in this child only

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        self.config = deepspeed_config(
            batch=spec.batch, clip=spec.clip, dtype=spec.dtype, placement=spec.placement,
            hidden=PRESETS[spec.preset].d_model, pin=device.type == "cuda",
        )  # fmt: skip
        model = gpt(spec.preset)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=self.config)
        self.version = str(deepspeed.__version__)

    def close(self) -> None:
        """The process group DeepSpeed opened, closed before the process ends (NCCL warns otherwise)."""
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


def _build(spec: AloneSpec, device: torch.device) -> tuple[EngineTraining | DeepSpeedTraining, str]:
    if spec.which == "deepspeed":
        runner = DeepSpeedTraining(spec, device)
        return runner, runner.version
    Path(spec.nvme_path).mkdir(parents=True, exist_ok=True)
    config = engine_config(
        stage=3, placement=PLACEMENTS[spec.placement], nvme_path=spec.nvme_path, clip=spec.clip, dtype=spec.dtype
    )
    return EngineTraining(spec.preset, config), __version__


def run_alone(spec_json: str) -> None:
    """The child's body: build `spec.which`, train warm-up + timed steps, write the ContenderRun to `spec.result`."""
    spec = AloneSpec(**json.loads(spec_json))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)
    started = time.perf_counter()
    runner, version = _build(spec, device)
    build_s = time.perf_counter() - started
    times, losses = [], []
    try:
        for n in range(spec.warmup + spec.steps):
            tokens, targets = token_batch(n, batch=spec.batch, seq=spec.seq, device=device)
            sync()
            started = time.perf_counter()
            loss = runner.step(tokens, targets)
            sync()
            seconds = time.perf_counter() - started
            losses.append(float(loss))  # read after the clock stops, as ds_gpu.py did
            if n >= spec.warmup:
                times.append(seconds)
    finally:
        runner.close()
    run = ContenderRun(
        which=spec.which, version=version, build_s=build_s, step_s=tuple(times), losses=tuple(losses),
        device_peak_bytes=torch.cuda.max_memory_allocated(device) if cuda else None,
    )  # fmt: skip
    Path(spec.result).write_text(json.dumps(run.to_dict()))
