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
windows, alone and beside a disk stream: 1.13-1.26x on the 2-core VM, 1.5-2.0x on a 2-core Zen 1
VM). In the disk's seconds the rest does only 1/slowdown seconds of its work each, so the part
takes the disk's seconds x (1 - 1/slowdown) longer; taken as the disk's seconds x (slowdown - 1),
as if the work beside the disk stretched, the 2B backward on the Zen 1 VM was predicted 25.0 s
against 22.9 s measured, now 23.3 s (docs/benchmarks-journal.md, session 23).

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
as the machine drifted between the timings (docs/benchmarks-journal.md, sessions 8 to 11). The block is
now timed in pairs of windows, and planned with the medians of the day's measurements of it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tierzero.common.slices import Kind, Tier
from tierzero.config import Config
from tierzero.engine.micro_step import PARTS
from tierzero.estimate.counting import Traffic
from tierzero.estimate.estimator import Estimate
from tierzero.optim.base import FlatOptimizer
from tierzero.optim.flat import make_optimizer
from tierzero.optim.torch_opt import TorchOptimizer
from tierzero.stages.step_pipeline import MAX_RESIDENT_GROUPS

__all__ = [
    "FORWARD_SHARE", "Part", "Prediction", "measure_copy_rate", "measure_step_rate", "pipelined", "predict",
]


#: The forward's share of the compute when it is not measured: 2 of the 6 x parameters x tokens FLOPs.
FORWARD_SHARE = 1 / 3
#: The largest units whose bytes the disk may hold read ahead of the work: the step pipeline's bound.
AHEAD = MAX_RESIDENT_GROUPS


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
        if not cuda:  # in the disk's seconds the rest does 1/slowdown of their work; all of it slowed at most
            rest += min(self.io_s, rest * slowdown) * (1.0 - 1.0 / slowdown)
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
    """Elements per second of `cfg`'s optimizer kernel (tierzero.optim.flat, or its torch.optim class) on
    `device`, by default the step's: the median of `steps` steps of `numel` elements after a warm-up.
    One step read 2.3 to 3.8 G/s within minutes on the 2-core VM, against 2.2 in the 2B step
    (docs/benchmarks-journal.md, session 9)."""
    optimizer = make_optimizer(cfg.optimizer)
    # An auto optimizer is timed on the host, where an offloaded step runs.
    if device is None:
        device = "cuda" if torch.cuda.is_available() and cfg.offload.optimizer is Tier.DEVICE else "cpu"
    param, grad = torch.randn(numel, device=device), torch.randn(numel, device=device)
    step_once = _stepper(optimizer, param, grad)
    step_once(1)  # warm-up: first touch of the pages
    runs = []
    for step in range(2, steps + 2):
        if device == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        step_once(step)
        if device == "cuda":
            torch.cuda.synchronize()
        runs.append(time.perf_counter() - began)
    return numel / statistics.median(runs)


def _stepper(optimizer: FlatOptimizer, param: torch.Tensor, grad: torch.Tensor) -> Callable[[int], None]:
    """Step number k of `optimizer` on `param` with `grad`: the engine's kernel on the flat slice, or a
    torch.optim class (optimizer.type lion, adafactor, torch:<class>) built on it as one 1-D parameter,
    as it steps a piece a shard cuts (Adafactor's unfactored second moment: its slower case)."""
    if isinstance(optimizer, TorchOptimizer):
        flat = torch.nn.Parameter(param)
        flat.grad = grad
        instance = optimizer.cls([{"params": [flat], **optimizer.hypers_of(optimizer.groups[0])}], **optimizer.kwargs)
        return lambda _: instance.step()
    states = optimizer.new_states(param.numel(), device=param.device)
    lrs = optimizer.group_lrs(1.0)
    return lambda step: optimizer.step(param=param, grad=grad, states=states, step=step, lr=lrs)
