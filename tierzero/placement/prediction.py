"""The placement planner's prediction of a step: its parts, at rates measured on this machine.

The parts: the NVMe bytes the replay counts at the disk's rates (reads and writes one after
the other), the compute (6 x parameters x tokens at the rate one of the model's own blocks
trains at: forward and backward at the training shape, norms, attention and the gradients'
landing included), the optimizer's kernel over the owned elements and the host memory
traffic (copies between tiers, gathers into buffers of their own). The disk works beside
whatever computes, so the step is the longer of the disk and the rest. With a GPU the rest
overlaps too (the GPU's compute, the copy stream and the host's optimizer), and the longest
part bounds the step; without one, compute, optimizer and copies take the same cores and add
up, and run slower for as long as the disk works beside them (the block timed in pairs of
windows, alone and beside a disk stream: 1.13-1.26x on the 2-core VM).

The disk overlaps only the work of the same part of the step: the replay counts each byte in
the part that issues it (forward, backward or the step after it) and each element the
optimizer steps where it is stepped, and gives the forward its measured share of the block's
time (a third of the FLOPs, but 23-25% of the time on the 2-core VM: the backward's weight
gradients and landing run slower per FLOP) and the backward the rest; what the step part issues
without stepping (the next forward's prefetches) counts in that forward. The step is the sum of
its parts: a placement whose disk works only in backward is predicted as such, not as if the
forward's compute hid it too.

Within a part the units run in order (the backward last to first), each one's work (its share
of the rest, by parameters) after its own disk, and the disk serves the units in turn, reading
ahead while the bytes read and not yet worked on fit in the `AHEAD` largest units' bytes, the
step pipeline's bound (`pipelined`). A unit's
disk hides behind the work of the units before it, those whose states live in memory included,
as the step in backward reads ahead past them; a disk-bound part takes its disk plus the work it
cannot hide at either end. On the 2B auto plan (70 units' states on NVMe, 35 in memory) the
whole-part rule, the longer of disk and rest, predicted 7.77 s against 9.38-9.60 s measured
(-18%) in session 13, when the pipeline read a unit only as its own backward began and the
disk idled beside a run of in-memory units at the end; per unit, without overlap, 9.87 s.

On the 2B preset the step was predicted from one Linear's three products at -15% to -25% of
the measured step, then from a block timed once alone and once beside the disk at -24% to +17%
as the machine drifted between the timings (docs/BENCHMARKS.md, sessions 8 to 11). The block is
now timed in pairs of windows, and planned with the medians of the day's measurements of it.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import deque
from dataclasses import dataclass

import torch
from torch import nn

from tierzero.config import Config
from tierzero.estimate.counting import Traffic
from tierzero.estimate.estimator import Bandwidth, Estimate, measure_flops
from tierzero.kernels import use_linear_kernel
from tierzero.micro_step import PARTS
from tierzero.models import BUILT_IN, spec_from_config
from tierzero.offload.step_pipeline import MAX_RESIDENT_GROUPS
from tierzero.optim import make_optimizer
from tierzero.placement.disk import label_of, streaming
from tierzero.placement.history import medians, off_median, remember, span_text
from tierzero.precision import dtype_of
from tierzero.slices import Kind, Tier

__all__ = [
    "Compute", "Part", "Prediction", "measure_block_flops", "measure_compute", "measure_copy_rate", "measure_step_rate",
    "pipelined", "predict",
]


#: The cache file of the block's measurements (placement/history.py).
COMPUTE_FILE = "compute.json"
#: The forward's share of the compute when it is not measured: 2 of the 6 x parameters x tokens FLOPs.
FORWARD_SHARE = 1 / 3
#: The largest units whose bytes the disk may hold read ahead of the work: the step pipeline's bound.
AHEAD = MAX_RESIDENT_GROUPS


@dataclass(frozen=True, slots=True, kw_only=True)
class Compute:
    """What `measure_compute` found: the rate, how much slower it runs beside the disk, and the
    forward's share of a forward and backward."""

    flops: Bandwidth
    slowdown: float = 1.0
    forward_share: float = FORWARD_SHARE


@dataclass(frozen=True, slots=True, kw_only=True)
class Part:
    """One part of the step (`micro_step`'s forward, backward or step) and what it does."""

    name: str
    io_s: float
    compute_s: float
    optimizer_s: float
    copy_s: float
    units: tuple[tuple[float, float, int], ...] = ()
    """(the disk's seconds for the unit's slices in this part, the unit's share of the parameters,
    the bytes it reads) for each unit, in the order the part runs them."""

    def seconds(self, *, cuda: bool, slowdown: float) -> float:
        """The part's time: its units' disk and their shares of the rest, pipelined (see the module note)."""
        rest = self._rest(cuda=cuda)
        if not cuda and rest > 0:
            rest *= 1.0 + (slowdown - 1.0) * min(1.0, self.io_s / rest)
        if not self.units:
            return max(self.io_s, rest)
        alone = max(0.0, rest * (1.0 - sum(share for _, share, _ in self.units)))
        return max(self.io_s, rest, pipelined([(io, rest * share, n) for io, share, n in self.units]) + alone)

    def bound(self, *, cuda: bool) -> str:
        return "disk" if self.io_s > self._rest(cuda=cuda) else "compute"

    def _rest(self, *, cuda: bool) -> float:
        """What runs beside the disk: overlapped with a GPU, one after the other on the host's cores."""
        work = (self.compute_s, self.optimizer_s, self.copy_s)
        return max(work) if cuda else sum(work)


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
    parts: tuple[Part, ...] = ()
    """The step's parts, each timed on its own: their times add up to `step_s`."""

    @property
    def bound(self) -> str:
        parts = {"disk": self.io_s, "compute": self.compute_s, "optimizer": self.optimizer_s, "copies": self.copy_s}
        return max(parts, key=parts.__getitem__)

    def part_seconds(self) -> dict[str, float]:
        """Each part's predicted time, by name."""
        return {p.name: p.seconds(cuda=not self.serial, slowdown=self.slowdown) for p in self.parts}

    def by_part(self) -> str:
        """Each part's predicted time and what bounds it: "forward 2.07 s (compute), ..."."""
        seconds = self.part_seconds()
        return ", ".join(f"{p.name} {seconds[p.name]:.2f} s ({p.bound(cuda=not self.serial)})" for p in self.parts)


def pipelined(units: list[tuple[float, float, int]], *, ahead: int = AHEAD) -> float:
    """Seconds to run `units` (disk seconds, work seconds, bytes read), in order, as the pipelines
    do: a unit's work waits for its disk, and the disk serves the units in turn, each once the
    bytes read and not yet worked on leave room for its own within the `ahead` largest units'
    bytes. The disk of one unit hides behind the work of the units before it, in memory ones
    included."""
    bound = sum(sorted((n for _, _, n in units), reverse=True)[:ahead])
    disk = work = 0.0
    held: deque[tuple[float, int]] = deque()  # (when its work ends, bytes) of the units read ahead
    for io, seconds, nbytes in units:
        if io > 0:
            start = disk
            while held and (held[0][0] <= start or sum(n for _, n in held) + nbytes > bound):
                start = max(start, held.popleft()[0])
            disk = start + io
            work = max(work, disk)
        work += seconds
        if io > 0:
            held.append((work, nbytes))
    return max(disk, work)


def predict(
    result: Estimate,
    *,
    copy_rate: float,
    step_rate: float,
    cuda: bool,
    slowdown: float = 1.0,
    forward_share: float = FORWARD_SHARE,
    device_step_rate: float | None = None,
) -> Prediction:
    """The step time `result`'s bytes, FLOPs and elements set (see the module note): the sum of its
    parts', each the disk beside the rest. Without a GPU, the rest runs `slowdown` times slower for
    as long as the disk works beside it. `forward_share`: the forward's part of the compute.
    `step_rate`: the optimizer's elements/s where it steps on the host; with a GPU, the units whose
    states live on the device step there, at `device_step_rate` (default: `step_rate`)."""
    assert result.plan is not None
    if cuda:
        slowdown = 1.0
    on_device = result.plan.stepped_elements(on_device=True) if cuda else 0
    on_host = result.plan.stepped_elements() - on_device
    optimizer = on_host / step_rate + on_device / (device_step_rate or step_rate)
    parts = _parts(result, optimizer_s=optimizer, copy_rate=copy_rate, forward_share=forward_share)
    step = sum(part.seconds(cuda=cuda, slowdown=slowdown) for part in parts)
    return Prediction(
        step_s=step, io_s=result.io_floor_s, compute_s=result.compute_floor_s, optimizer_s=optimizer,
        copy_s=result.memory_copied / copy_rate, serial=not cuda, slowdown=slowdown, parts=parts,
    )  # fmt: skip


def _parts(result: Estimate, *, optimizer_s: float, copy_rate: float, forward_share: float) -> tuple[Part, ...]:
    """The replay's traffic by part of the step, in seconds. The optimizer's time is split as its
    elements were stepped (all in the step's own part where none were counted). A step part that
    steps nothing only issues the next forward's prefetches, which the disk serves while that
    forward runs: its traffic joins the forward's."""
    phases = {name: result.phases.get(name, Traffic()) for name in PARTS}
    stepped = sum(traffic.stepped for traffic in phases.values())
    if phases["step"].stepped == 0 and stepped:
        phases["forward"] = phases["forward"].merged(phases["step"])
        phases["step"] = Traffic()
    disk, parts = result.disk, []
    specs = result.plan.specs
    params = {unit: next((s.numel for s in of_unit if s.kind is Kind.PARAM), 0) for unit, of_unit in specs.items()}
    total = sum(params.values()) or 1
    share = {"forward": forward_share, "backward": 1.0 - forward_share, "step": 0.0}
    for name, traffic in phases.items():
        if stepped:
            optimizer = optimizer_s * traffic.stepped / stepped
        else:
            optimizer = optimizer_s if name == "step" else 0.0
        io = 0.0 if disk is None else traffic.read / disk.read + traffic.written / disk.write
        order = list(specs)[::-1] if name == "backward" else list(specs)  # the backward runs them last first
        units = () if disk is None else tuple(
            (read / disk.read + written / disk.write, params.get(unit, 0) / total, read)
            for unit in order
            for read, written in [traffic.by_unit.get(unit, (0, 0))]
        )  # fmt: skip
        parts.append(Part(
            name=name, io_s=io, compute_s=result.compute_floor_s * share[name], optimizer_s=optimizer,
            copy_s=traffic.copied / copy_rate, units=units,
        ))  # fmt: skip
    return tuple(parts)


def measure_copy_rate(nbytes: int | None = None, *, copies: int = 5) -> float:
    """Bytes/s of a copy from host to device memory (pinned, with CUDA), or host to host without:
    the median of `copies` after a warm-up. By default 256 MiB host to host, larger than a host's
    last-level cache as the engine's slices are (on the 2-core VM, 64 MiB copied at 44-63 GB/s and
    256 MiB at 37); 64 MiB to a GPU, which no cache serves, and whose pinned buffer torch's host
    allocator keeps cached for the rest of the run."""
    pin = torch.cuda.is_available()
    if nbytes is None:
        nbytes = (64 if pin else 256) << 20
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if pin else "cpu")
    dst.copy_(src)  # warm-up: first touch of the pages
    runs = []
    for _ in range(copies):
        if pin:
            torch.cuda.synchronize()
        began = time.perf_counter()
        dst.copy_(src)
        if pin:
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - began)
    return nbytes / statistics.median(runs)


def measure_step_rate(cfg: Config, numel: int = 1 << 24, *, steps: int = 3, device: str | None = None) -> float:
    """Elements per second of `cfg`'s optimizer kernel (tierzero.optim) on `device`, by default the
    step's: the median of `steps` steps of `numel` elements after a warm-up. One step read 2.3 to
    3.8 G/s within minutes on the 2-core VM, against 2.2 in the 2B step (docs/BENCHMARKS.md,
    session 9)."""
    optimizer = make_optimizer(cfg.optimizer)
    # An auto optimizer is timed on the host, where an offloaded step runs.
    if device is None:
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
    block = _TimedBlock.build(cfg)
    return None if block is None else block.rate(block.passes(seconds, at_least=3))


def measure_compute(cfg: Config, *, seconds: float = 6.0, rounds: int = 36) -> Compute:
    """The compute rate for the prediction, how much slower it runs while the disk streams, and the
    forward's share of the block's time (the median over the passes alone).

    A built-in model's block (`measure_block_flops`), built once and timed in `rounds` pairs of
    windows within about `seconds`: alone, then beside a stream to `tiers.nvme.path`
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
    compute, off = _measured(cfg, block, seconds=seconds, rounds=rounds)
    if off:  # noise, or the machine changed: a second measurement tells (placement/history.py)
        compute, _ = _measured(cfg, block, seconds=seconds, rounds=rounds)
    return compute


def _measured(cfg: Config, block: _TimedBlock, *, seconds: float, rounds: int) -> tuple[Compute, bool]:
    """One measurement of `measure_compute`'s, remembered; and whether it lies off the day's median."""
    shares: list[float] = []  # of the passes alone
    if torch.cuda.is_available() or cfg.tiers.nvme.path is None:
        runs = block.passes(seconds, at_least=3, shares=shares)
        rate = block.rate(runs)
        return _remembered(block, rate.read, 1.0, statistics.median(shares), how=rate.source, beside="alone")
    window = seconds / (2 * rounds)
    alone: list[float] = []
    ratios: list[float] = []
    with streaming(cfg.tiers.nvme.path, cfg.tiers.nvme) as stream:
        for _ in range(rounds):
            with stream.paused():
                quiet = block.passes(window, at_least=1, shares=shares)
            busy = block.passes(window, at_least=1)
            alone += quiet
            ratios.append(statistics.median(busy) / statistics.median(quiet))
        read, write = stream.rates()
    quiet_rate, slowdown, share = block.rate(alone), max(1.0, statistics.mean(ratios)), statistics.median(shares)
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
