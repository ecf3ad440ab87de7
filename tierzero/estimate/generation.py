"""`tierzero estimate --generate`: the tokens/s a generate run can reach, from the estimate's own bytes and rates.

A decoding step reads every weight once for the whole batch (tierzero/inference/generate.py),
so its time is bound by the slowest of three things, each of which can hide the others:
- the disk: the PARAM slices homed on NVMe, read once a step, at the disk's read rate;
- the copies: every PARAM slice not homed on the device (cpu and nvme homes alike) crosses
  to it once a step, at the host-to-device copy rate (host to host without a GPU);
- the compute: 2 x parameters FLOPs a new token, times the batch, at the compute rate.
tokens/s is the batch over that time. The batch is the given one, or auto's
(tierzero/inference/batch.py), sized the same way from the device budget, with the
dry run's model and units standing in for the engine's: the formula is batch.py's, not a copy.
Attention over the KV cache and the prompts' forward are left out: the bound is the steady
step's, where the weights' bytes dominate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tierzero.common.sizes import format_size
from tierzero.common.slices import Kind, Tier
from tierzero.estimate.estimator import Bandwidth, Estimate
from tierzero.inference.batch import BatchCost, auto_batch, batch_cost
from tierzero.units.precision import dtype_of
from tierzero.units.unit import Unit

__all__ = ["GeneratePrediction", "decoding_cost", "device_room", "predict_generate"]


@dataclass(frozen=True, slots=True)
class _DryEngine:
    """What `batch_cost` reads of an engine, from a dry run's model and units: no engine is built."""

    module: nn.Module
    cfg: Any
    units: tuple[Unit, ...]

    @property
    def stage(self) -> _DryEngine:
        return self

    @property
    def shards_params(self) -> bool:
        return self.cfg.zero.stage == 3

    def dtype_of(self, unit: Unit) -> torch.dtype:
        """As the stages say it: the unit's own dtype, else the compute dtype."""
        return unit.dtype or dtype_of(self.cfg.precision.param_dtype)


def decoding_cost(cfg: Any, *, model: nn.Module, units: tuple[Unit, ...], prompt: int, new: int) -> BatchCost:
    """`batch_cost` of `cfg`'s model (on the meta device) and units, as a dry run built them."""
    return batch_cost(_DryEngine(module=model, cfg=cfg, units=units), prompt=prompt, new=new)


def device_room(result: Estimate, *, device: Any, cpu: Any) -> tuple[int, str]:
    """Bytes the device may take beyond the homes the store keeps there, and where the figure comes from.

    `device` and `cpu` are the tiers' budgets (`nbytes`, `source`); without a device figure the
    host stands in for the device, less both tiers' homes, as `tierzero generate` counts it.
    """
    held = result.tiers[Tier.DEVICE].home_total
    if device.nbytes is not None:
        return device.nbytes - held, f"{device.source}, less {format_size(held)} of device homes"
    held += result.tiers[Tier.CPU].home_total
    return cpu.nbytes - held, f"the host stands in for the device: {cpu.source}, less {format_size(held)} of device and cpu homes"


@dataclass(frozen=True, slots=True, kw_only=True)
class GeneratePrediction:
    """A generate run's decoding step: its batch, the weight bytes it moves, its time and tokens/s."""

    batch: int
    auto: bool
    prompt: int
    new: int
    cost: BatchCost
    nvme_read: int
    """NVMe-homed PARAM bytes read a step."""
    cpu_read: int
    """cpu-homed PARAM bytes a step."""
    disk: Bandwidth | None
    copy: Bandwidth
    flops: Bandwidth
    parameters: int

    @property
    def copied(self) -> int:
        """Bytes copied to the device a step: every PARAM slice not homed there."""
        return self.nvme_read + self.cpu_read

    @property
    def step_flops(self) -> float:
        return 2.0 * self.parameters * self.batch

    @property
    def times(self) -> dict[str, float]:
        """Seconds a step takes for each bound: disk, copy, compute."""
        disk = 0.0 if self.disk is None or not self.nvme_read else self.nvme_read / self.disk.read
        return {"disk": disk, "copy": self.copied / self.copy.read, "compute": self.step_flops / self.flops.read}

    @property
    def step_s(self) -> float:
        return max(self.times.values())

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    def to_json(self) -> dict[str, Any]:
        return {
            "batch_size": self.batch,
            "auto": self.auto,
            "prompt_len": self.prompt,
            "new_tokens": self.new,
            "device_bytes": self.cost.of(self.batch),
            "read_per_step": {"nvme": self.nvme_read, "cpu": self.cpu_read},
            "copied_per_step": self.copied,
            "flops_per_step": self.step_flops,
            "rates": {"disk_read_Bps": None if self.disk is None else self.disk.read, "copy_Bps": self.copy.read,
                      "flops": self.flops.read},
            "time_s": self.times,
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
        }

    def lines(self) -> list[str]:
        fs = format_size
        times = self.times
        bound = max(times, key=times.__getitem__)
        how = "auto, " + self.cost.describe() if self.auto else "given"
        return [
            f"generate: batch {self.batch} ({how}), prompt {self.prompt} + {self.new} new tokens a row",
            f"  weights a decoding step: nvme read {fs(self.nvme_read)}, cpu {fs(self.cpu_read)}, "
            f"copied to the device {fs(self.copied)}",
            f"  step time {self.step_s:.4f} s ({bound}-bound: disk {times['disk']:.4f} s, copy {times['copy']:.4f} s at "
            f"{self.copy.source}, compute {times['compute']:.4f} s)",
            f"  predicted {self.tokens_per_s:.1f} tokens/s",
        ]


def predict_generate(
    cfg: Any,
    result: Estimate,
    *,
    model: nn.Module,
    units: tuple[Unit, ...],
    prompt: int,
    new: int,
    batch: int | None,
    room: tuple[int, str],
    copy: Bandwidth,
    most: int,
) -> GeneratePrediction:
    """The decoding step of a generate run of `cfg`, placed as `result` says; `batch` None: auto's, at most
    `most`, from `room` (bytes, source); ValueError where not even batch 1 fits."""
    if prompt < 1 or new < 1:
        raise ValueError(f"--prompt-len {prompt} and --new-tokens {new} must be at least 1: give positive lengths")
    assert result.plan is not None
    cost = decoding_cost(cfg, model=model, units=units, prompt=prompt, new=new)
    chosen = batch if batch is not None else auto_batch(cost, budget=room[0], prompts=most, source=room[1])
    params = [spec for spec in result.plan.all() if spec.kind is Kind.PARAM]
    return GeneratePrediction(
        batch=chosen,
        auto=batch is None,
        prompt=prompt,
        new=new,
        cost=cost,
        nvme_read=sum(spec.nbytes for spec in params if spec.home is Tier.NVME),
        cpu_read=sum(spec.nbytes for spec in params if spec.home is Tier.CPU),
        disk=result.disk,
        copy=copy,
        flops=result.flops,
        parameters=result.parameters,
    )
