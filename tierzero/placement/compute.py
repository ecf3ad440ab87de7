"""The compute rate the placement planner predicts with: one block of the model, timed on this machine.

`measure_compute` builds one block of a built-in model at the training shape and times its
forward and backward, alone and beside a disk stream in turn (placement/prediction.py's module
note says how the prediction takes the rate, the slowdown beside the disk and the forward's
share); each measurement joins the day's of the same block beside the same disk, and the plan
takes their medians (placement/history.py).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from tierzero.config import Config
from tierzero.estimate.estimator import Bandwidth, measure_flops
from tierzero.models.builtin import BUILT_IN, spec_from_config
from tierzero.placement.disk import label_of, streaming
from tierzero.placement.history import SHIFT, medians, off_median, remember, span_text
from tierzero.placement.prediction import FORWARD_SHARE
from tierzero.units.kernels import use_linear_kernel
from tierzero.units.precision import dtype_of

__all__ = ["COMPUTE_FILE", "Compute", "measure_block_flops", "measure_compute"]

log = logging.getLogger(__name__)

#: The cache file of the block's measurements (placement/history.py).
COMPUTE_FILE = "compute.json"
#: The pairs of windows `measure_compute` times at least, however slow the block's pass.
MIN_ROUNDS = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class Compute:
    """What `measure_compute` found: the rate, how much slower it runs beside the disk, and the
    forward's share of a forward and backward."""

    flops: Bandwidth
    slowdown: float = 1.0
    forward_share: float = FORWARD_SHARE


def measure_block_flops(cfg: Config, *, seconds: float = 1.5) -> Bandwidth | None:
    """The rate one block of `cfg`'s built-in model trains at, in the compute dtype on the compute
    device: forward and backward of a micro-batch at `train.seq_len`, its weight gradients added
    into place as the engine lands them; 6 x the block's parameters x tokens FLOPs over the median
    of the runs that fit in about `seconds` (at least three, after a warm-up). The median, not the
    best: a block inside the step shares the cores with the engine's own work. None for a
    transformers model, whose layers take inputs of their own."""
    block = _TimedBlock.build(cfg)
    return None if block is None else block.rate(block.passes(seconds, at_least=3))


def measure_compute(cfg: Config, *, seconds: float = 6.0, rounds: int = 36, limit: float = 30.0) -> Compute:
    """The compute rate for the prediction, how much slower it runs while the disk streams, and the
    forward's share of the block's time (the median over the passes alone).

    A built-in model's block (`measure_block_flops`), built once and timed in `rounds` pairs of
    windows within about `seconds` (each a pass at least, so a block whose pass is slow takes
    longer: no more pairs start after `limit` seconds once `MIN_ROUNDS` are done; the 2B block's
    pass takes about 0.25 s on the 2-core VM, 0.85-1.3 s on a 2-core Zen 1 VM, where 36 pairs
    took 124 s and the bounded ones 35 s): alone, then beside a stream to `tiers.nvme.path`
    (`streaming`, paused for the first of each pair). Without a GPU the swaps' threads,
    interrupts and memory traffic take from the cores. The slowdown is the mean of the pairs'
    ratios (at least 1.0): a machine whose speed drifts meanwhile slows both halves of a pair
    alike (timed once alone and then once beside, the 2B preset read 1.03-1.74x within a day),
    and the passes the disk holds up two or three times over, one in five or so on the 2-core
    VM, count as often as they come, as they do in a step: 16 pairs there read a median of
    1.07-1.11 and a mean of 1.13-1.20, beside a backward that ran 1.17-1.25x its work alone.
    Fewer pairs are not enough: the 2B preset's block, measured one call after another, read
    1.00-1.15x and 99-140 GFLOP/s from 12 pairs in 2 s, 1.04-1.10x and 118-123 from 36 in 6 s.
    A transformers model gets a square matmul's rate, and no slowdown is measured on a GPU or
    without an NVMe path (1.0). Each figure is the median of this measurement and the last day's
    of the same block beside the same disk: the 2B plans that missed by 16% took a block timed at
    99 GFLOP/s where the day's read 116-131, or 1.01-1.02x where the day's read 1.05-1.15x. A rate
    more than `SHIFT` off the day's median is measured again: two that far off on one side say
    the machine changed, and the day's earlier measurements are dropped (placement/history.py).
    """
    block = _TimedBlock.build(cfg)
    if block is None:
        return Compute(flops=measure_flops(cfg.precision.param_dtype))
    compute, off = _measured(cfg, block, seconds=seconds, rounds=rounds, limit=limit)
    if off:  # noise, or the machine changed: a second measurement tells (placement/history.py)
        log.info("timing it again: the rate lies more than %.0f%% off the day's median", SHIFT * 100)
        compute, _ = _measured(cfg, block, seconds=seconds, rounds=rounds, limit=limit)
    return compute


def _measured(cfg: Config, block: _TimedBlock, *, seconds: float, rounds: int, limit: float) -> tuple[Compute, bool]:
    """One measurement of `measure_compute`'s, remembered; and whether it lies off the day's median."""
    shares: list[float] = []  # of the passes alone
    began = time.perf_counter()
    if torch.cuda.is_available() or cfg.tiers.nvme.path is None:
        log.info("timing %s, about %.0f s", block.what, seconds)
        runs = block.passes(seconds, at_least=3, shares=shares)
        rate = block.rate(runs)
        log.info("%.0f GFLOP/s, in %.1f s", rate.read / 1e9, time.perf_counter() - began)
        return _remembered(block, rate.read, 1.0, statistics.median(shares), how=rate.source, beside="alone")
    log.info("timing %s, alone and beside the disk, up to about %.0f s", block.what, limit)
    window = seconds / (2 * rounds)
    alone: list[float] = []
    ratios: list[float] = []
    with streaming(cfg.tiers.nvme.path, cfg.tiers.nvme) as stream:
        for done in range(rounds):
            if done >= MIN_ROUNDS and time.perf_counter() - began > limit:
                break
            with stream.paused():
                quiet = block.passes(window, at_least=1, shares=shares)
            busy = block.passes(window, at_least=1)
            alone += quiet
            ratios.append(statistics.median(busy) / statistics.median(quiet))
        read, write = stream.rates()
    quiet_rate, slowdown, share = block.rate(alone), max(1.0, statistics.mean(ratios)), statistics.median(shares)
    log.info("%.0f GFLOP/s alone, %.2fx slower beside the disk, in %.1f s", quiet_rate.read / 1e9, slowdown, time.perf_counter() - began)
    beside = f"{slowdown:.2f}x slower beside the disk, which read {read:.1f} GB/s, wrote {write:.1f}"
    how = f"{quiet_rate.source}, the forward {share:.0%} of it; {beside}"
    disk = f"beside {os.path.realpath(cfg.tiers.nvme.path)} at {label_of(cfg.tiers.nvme)}"
    return _remembered(block, quiet_rate.read, slowdown, share, how=how, beside=disk)


def _remembered(
    block: _TimedBlock, flops: float, slowdown: float, share: float, *, how: str, beside: str
) -> tuple[Compute, bool]:
    """The medians of this measurement and those of the last day of the same block beside the same
    disk (placement/history.py): one measurement samples one moment of a machine whose speed drifts.
    And whether this one lies off the earlier ones' median."""
    measured = remember(COMPUTE_FILE, f"{block.what}, {block.flops:.0f} FLOP a pass, {beside}",
                        {"flops": flops, "slowdown": slowdown, "forward_share": share}, how=how)  # fmt: skip
    figures = medians(measured)
    flops, slowdown, share = figures["flops"], figures["slowdown"], figures["forward_share"]
    if len(measured) > 1:
        how = f"{span_text(measured, '')}: {flops / 1e9:.0f} GFLOP/s, the forward {share:.0%}, {slowdown:.2f}x beside"
    compute = Compute(flops=Bandwidth(read=flops, write=flops, source=how), slowdown=slowdown, forward_share=share)
    return compute, off_median(measured, ("flops",))


class _TimedBlock:
    """One block of a config's built-in model at the training shape, built and warmed up once
    (see `measure_block_flops`)."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        model, dtype = cfg.model, dtype_of(cfg.precision.param_dtype)
        spec = spec_from_config(model)
        with torch.device(device):
            self.block = BUILT_IN[model.type].Block(spec).to(dtype)
            shape = (cfg.train.micro_batch_size, cfg.train.seq_len, spec.d_model)
            self.x = torch.randn(*shape, dtype=dtype, requires_grad=True)
            self.extra = BUILT_IN[model.type].block_inputs(spec, cfg.train.seq_len)
        use_linear_kernel(self.block, cfg.precision.linear_kernel)  # the engine's kernels
        for p in self.block.parameters():
            p.grad = torch.zeros_like(p)
        self.device = device
        self.flops = 6.0 * sum(p.numel() for p in self.block.parameters()) * shape[0] * shape[1]
        what = f"one {model.type} block's forward and backward at {shape[0]}x{shape[1]} tokens"
        kernel = "" if cfg.precision.linear_kernel == "torch" else f", {cfg.precision.linear_kernel} linear"
        self.what = f"{cfg.precision.param_dtype} {what}, {device.type}{kernel}"
        self.passes(0.0, at_least=1)  # warm-up: first touch of the pages, kernel choice

    @classmethod
    def build(cls, cfg: Config) -> _TimedBlock | None:
        """None for a transformers model."""
        if cfg.model.is_transformers:
            return None
        return cls(cfg, torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))

    def passes(self, seconds: float, *, at_least: int, shares: list[float] | None = None) -> list[float]:
        """The seconds of each pass run in about `seconds`, `at_least` of them; `shares` gets each
        one's forward share of its time."""
        runs: list[float] = []
        began = time.perf_counter()
        while len(runs) < at_least or time.perf_counter() - began < seconds:
            forward, total = _timed_pass(self.block, self.x, self.extra, self.device)
            runs.append(total)
            if shares is not None:
                shares.append(forward / total)
        return runs

    def rate(self, runs: list[float]) -> Bandwidth:
        measured = self.flops / statistics.median(runs)
        return Bandwidth(read=measured, write=measured, source=f"measured {measured / 1e9:.0f} GFLOP/s ({self.what})")


def _timed_pass(
    block: nn.Module, x: torch.Tensor, extra: tuple[torch.Tensor, ...], device: torch.device
) -> tuple[float, float]:
    """(seconds to the end of the forward, seconds of the whole pass)."""
    began = time.perf_counter()
    y = block(x, *extra)
    if device.type == "cuda":
        torch.cuda.synchronize()
    forward = time.perf_counter() - began
    y.backward(torch.ones_like(y))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return forward, time.perf_counter() - began
