"""The placement planner's prediction of a step: its parts, at rates measured on this machine.

The parts: the NVMe bytes the replay counts at the disk's rates (reads and writes one after
the other), the compute (6 x parameters x tokens at the rate one of the model's own blocks
trains at: forward and backward at the training shape, norms, attention and the gradients'
landing included), the optimizer's kernel over the owned elements and the host memory
traffic (copies between tiers, gathers into buffers of their own). The disk works beside
whatever computes, so the step is the longer of the disk and the rest. With a GPU the rest
overlaps too (the GPU's compute, the copy stream and the host's optimizer), and the longest
part bounds the step; without one, compute, optimizer and copies take the same cores and add
up, and run slower for as long as the disk works beside them (the block timed again beside a
disk stream: 1.03-1.21x on the 2-core VM).

On the 2B preset (docs/BENCHMARKS.md, sessions 8 and 9) the planned placement's step measured
8.3-9.4 s. Predicted from one Linear's three products it was 6.8-7.6 s (-15% to -25%); from
a block with the disk's slowdown, 7.5-8.4 s. The rest of the gap is work the same cores do
more slowly inside the step than alone, which no probe here has caught.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from tierzero.config import Config
from tierzero.estimate.estimator import Bandwidth, Estimate, measure_flops
from tierzero.models import BUILT_IN, spec_from_config
from tierzero.optim import make_optimizer
from tierzero.placement.disk import streaming
from tierzero.precision import dtype_of
from tierzero.slices import Tier

__all__ = ["Prediction", "measure_block_flops", "measure_compute", "measure_copy_rate", "measure_step_rate", "predict"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """A placement's predicted step and its parts."""

    step_s: float
    io_s: float
    """The NVMe bytes at the disk's rates, reads and writes one after the other."""
    compute_s: float
    """Forward and backward: 6 x parameters x tokens FLOPs at the rate a block of the model trains at."""
    optimizer_s: float
    """The optimizer's kernel over this rank's owned elements at its measured rate."""
    copy_s: float
    """Copies between the device and host tiers (and without a GPU, into gathered buffers)."""
    serial: bool
    """Without a GPU the compute, the optimizer and the copies add up: they take the same cores."""
    slowdown: float = 1.0
    """How much slower the rest ran beside a disk stream, measured; it slows the part the disk overlaps."""

    @property
    def bound(self) -> str:
        parts = {"disk": self.io_s, "compute": self.compute_s, "optimizer": self.optimizer_s, "copies": self.copy_s}
        return max(parts, key=parts.__getitem__)


def predict(result: Estimate, *, copy_rate: float, step_rate: float, cuda: bool, slowdown: float = 1.0) -> Prediction:
    """The step time `result`'s bytes, FLOPs and elements set (see the module note). Without a GPU,
    the rest runs `slowdown` times slower for as long as the disk works beside it."""
    assert result.plan is not None
    io, compute = result.io_floor_s, result.compute_floor_s
    optimizer = result.plan.stepped_elements() / step_rate
    copies = result.memory_copied / copy_rate
    if cuda:
        step, slowdown = max(io, compute, optimizer, copies), 1.0
    else:
        rest = compute + optimizer + copies
        if rest > 0:
            rest *= 1.0 + (slowdown - 1.0) * min(1.0, io / rest)
        step = max(io, rest)
    parts = {"io_s": io, "compute_s": compute, "optimizer_s": optimizer, "copy_s": copies}
    return Prediction(step_s=step, **parts, serial=not cuda, slowdown=slowdown)


def measure_copy_rate(nbytes: int = 64 << 20) -> float:
    """Bytes/s of one copy from host to device memory (pinned, with CUDA), or host to host without."""
    pin = torch.cuda.is_available()
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if pin else "cpu")
    dst.copy_(src)  # warm-up: first touch of the pages
    if pin:
        torch.cuda.synchronize()
    began = time.perf_counter()
    dst.copy_(src)
    if pin:
        torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - began)


def measure_step_rate(cfg: Config, numel: int = 1 << 24, *, steps: int = 3) -> float:
    """Elements per second of `cfg`'s optimizer kernel (tierzero.optim) on the step's device: the
    median of `steps` steps of `numel` elements after a warm-up. One step read 2.3 to 3.8 G/s
    within minutes on the 2-core VM, against 2.2 in the 2B step (docs/BENCHMARKS.md, session 9)."""
    optimizer = make_optimizer(cfg.optimizer)
    # An auto optimizer is timed on the host, where an offloaded step runs.
    device = "cuda" if torch.cuda.is_available() and cfg.offload.optimizer is Tier.DEVICE else "cpu"
    param, grad = torch.randn(numel, device=device), torch.randn(numel, device=device)
    states = optimizer.new_states(numel, device=device)
    lrs = optimizer.group_lrs(1.0)
    optimizer.step(param=param, grad=grad, states=states, step=1, lr=lrs)  # warm-up: first touch of the pages
    runs = []
    for step in range(2, steps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        optimizer.step(param=param, grad=grad, states=states, step=step, lr=lrs)
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - began)
    return numel / statistics.median(runs)


def measure_block_flops(cfg: Config, *, seconds: float = 1.5) -> Bandwidth | None:
    """The rate one block of `cfg`'s built-in model trains at, in the compute dtype on the compute
    device: forward and backward of a micro-batch at `train.seq_len`, its weight gradients added
    into place as the engine lands them; 6 x the block's parameters x tokens FLOPs over the median
    of the runs that fit in about `seconds` (at least three, after a warm-up). The median, not the
    best: a block inside the step shares the cores with the engine's own work. None for a
    transformers model, whose layers take inputs of their own."""
    timer = _block_timer(cfg)
    return None if timer is None else timer(seconds)


def measure_compute(cfg: Config, *, seconds: float = 1.5) -> tuple[Bandwidth, float]:
    """The compute rate for the prediction, and how much slower it runs while the disk streams.

    A built-in model's block (`measure_block_flops`), built once and timed alone and then beside
    a stream to `tiers.nvme.path` (`streaming`): without a GPU the swaps' threads, interrupts and
    memory traffic take from the cores. On the 2B preset the block ran 1.03-1.21x slower beside
    the disk. A transformers model gets a square matmul's rate, and no slowdown is measured on a
    GPU or without an NVMe path (1.0).
    """
    timer = _block_timer(cfg)
    if timer is None:
        return measure_flops(cfg.precision.param_dtype), 1.0
    quiet = timer(seconds)
    if torch.cuda.is_available() or cfg.tiers.nvme.path is None:
        return quiet, 1.0
    with streaming(cfg.tiers.nvme.path) as moved:
        busy = timer(seconds)
        gbs = moved()
    slowdown = max(1.0, quiet.read / busy.read)
    source = f"{quiet.source}; {slowdown:.2f}x slower beside the disk at {gbs:.1f} GB/s"
    return Bandwidth(read=quiet.read, write=quiet.write, source=source), slowdown


def _block_timer(cfg: Config) -> Callable[[float], Bandwidth] | None:
    """One block of `cfg`'s built-in model at the training shape, built and warmed up once, and a
    function that times it for about so many seconds (see `measure_block_flops`)."""
    model = cfg.model
    if model.is_transformers:
        return None
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    dtype = dtype_of(cfg.precision.param_dtype)
    spec = spec_from_config(model)
    with torch.device(device):
        block = BUILT_IN[model.type].Block(spec).to(dtype)
        x = torch.randn(cfg.train.micro_batch_size, cfg.train.seq_len, spec.d_model, dtype=dtype, requires_grad=True)
        extra = BUILT_IN[model.type].block_inputs(spec, cfg.train.seq_len)
    for p in block.parameters():
        p.grad = torch.zeros_like(p)
    _timed_pass(block, x, extra, device)  # warm-up: first touch of the pages, kernel choice
    flops = 6.0 * sum(p.numel() for p in block.parameters()) * x.shape[0] * x.shape[1]
    what = f"one {model.type} block's forward and backward at {x.shape[0]}x{x.shape[1]} tokens"

    def rate(seconds: float) -> Bandwidth:
        runs: list[float] = []
        began = time.perf_counter()
        while len(runs) < 3 or time.perf_counter() - began < seconds:
            runs.append(_timed_pass(block, x, extra, device))
        measured = flops / statistics.median(runs)
        source = f"measured {measured / 1e9:.0f} GFLOP/s ({cfg.precision.param_dtype} {what}, {device.type})"
        return Bandwidth(read=measured, write=measured, source=source)

    return rate


def _timed_pass(block: nn.Module, x: torch.Tensor, extra: tuple[torch.Tensor, ...], device: torch.device) -> float:
    began = time.perf_counter()
    y = block(x, *extra)
    y.backward(torch.ones_like(y))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - began
