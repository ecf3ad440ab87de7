"""The placement planner's prediction of a step: its parts, at rates measured on this machine.

The parts: the NVMe bytes the replay counts at the disk's rates (reads and writes one after
the other), the compute (6 x parameters x tokens at the rate of a Linear's three training
products at the model's own shape), the optimizer's kernel over the owned elements and the
host memory traffic (copies between tiers, gathers into buffers of their own, the gradients'
landing). The disk works beside whatever computes, so the step is the longer of the disk
and the rest. With a GPU the rest overlaps too (the GPU's compute, the copy stream and the
host's optimizer), and the longest part bounds the step; without one, compute, optimizer and
copies take the same cores and add up. Until host buffers came in huge pages and freed ones
were reused (docs/BENCHMARKS.md, session 8), the disk's page faults took those cores too and
the sum of every part matched best. Since then, on the 2B preset, the planned placement's
step measured 8.3-8.9 s against 6.9-7.6 s predicted (-15% to -21%: the model's own forward
and backward run slower than one Linear's products, and the disk slows them by 7-9%), and
the all-NVMe step 14.1-18.6 s against its disk's 17.2 s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tierzero.config import Config
from tierzero.estimate.estimator import Estimate
from tierzero.optim import make_optimizer
from tierzero.slices import Tier

__all__ = ["Prediction", "matmul_shape", "measure_copy_rate", "measure_step_rate", "predict"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """A placement's predicted step and its parts."""

    step_s: float
    io_s: float
    """The NVMe bytes at the disk's rates, reads and writes one after the other."""
    compute_s: float
    """Forward and backward: 6 x parameters x tokens FLOPs at the measured matmul rate."""
    optimizer_s: float
    """The optimizer's kernel over this rank's owned elements at its measured rate."""
    copy_s: float
    """Copies between the device and host tiers (and without a GPU, into gathered buffers)."""
    serial: bool
    """Without a GPU the compute, the optimizer and the copies add up: they take the same cores."""

    @property
    def bound(self) -> str:
        parts = {"disk": self.io_s, "compute": self.compute_s, "optimizer": self.optimizer_s, "copies": self.copy_s}
        return max(parts, key=parts.__getitem__)


def predict(result: Estimate, *, copy_rate: float, step_rate: float, cuda: bool) -> Prediction:
    """The step time `result`'s bytes, FLOPs and elements set (see the module note)."""
    assert result.plan is not None
    io, compute = result.io_floor_s, result.compute_floor_s
    optimizer = result.plan.stepped_elements() / step_rate
    copies = result.memory_copied / copy_rate
    step = max(io, compute, optimizer, copies) if cuda else max(io, compute + optimizer + copies)
    return Prediction(step_s=step, io_s=io, compute_s=compute, optimizer_s=optimizer, copy_s=copies, serial=not cuda)


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


def measure_step_rate(cfg: Config, numel: int = 1 << 24) -> float:
    """Elements per second of `cfg`'s optimizer kernel (tierzero.optim) on the step's device, one
    step of `numel` elements after a warm-up."""
    optimizer = make_optimizer(cfg.optimizer)
    # An auto optimizer is timed on the host, where an offloaded step runs.
    device = "cuda" if torch.cuda.is_available() and cfg.offload.optimizer is Tier.DEVICE else "cpu"
    param, grad = torch.randn(numel, device=device), torch.randn(numel, device=device)
    states = optimizer.new_states(numel, device=device)
    lrs = optimizer.group_lrs(1.0)
    optimizer.step(param=param, grad=grad, states=states, step=1, lr=lrs)  # warm-up: first touch of the pages
    if device == "cuda":
        torch.cuda.synchronize()
    began = time.perf_counter()
    optimizer.step(param=param, grad=grad, states=states, step=2, lr=lrs)
    if device == "cuda":
        torch.cuda.synchronize()
    return numel / (time.perf_counter() - began)


def matmul_shape(cfg: Config) -> tuple[int, int, int] | None:
    """A built-in model's typical matmul: a micro-batch's tokens x width x feed-forward width."""
    model = cfg.model
    if model.is_transformers:
        return None
    return cfg.train.micro_batch_size * cfg.train.seq_len, model.d_model, model.d_ff
