"""CPU Adam throughput: `FlatOptimizer.step` on one flat slice beside `torch.optim.AdamW(fused=True)`.

Both update the same number of fp32 parameters from the same starting values and
gradients, timed step by step in alternation (which one goes first swaps each step),
so that a noisy machine slows both alike. Medians are reported. At the end the two
parameter tensors are compared bit for bit: the speed figure is only worth quoting
if the update is the same.

`split` > 1 steps the slice as that many sub-slices on as many Python threads, each
kernel call then running single-threaded: the alternative to torch's own intra-op
threads inside one fused call.
"""

from __future__ import annotations

import argparse
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from tierzero.common.sizes import parse_size
from tierzero.common.slices import Kind
from tierzero.optim.flat import FlatAdam, FlatOptimizer, OptimizerSpec, OptimizerType


@dataclass(frozen=True, slots=True, kw_only=True)
class AdamBenchResult:
    numel: int
    steps: int
    threads: int
    """torch intra-op threads during the run."""
    split: int
    """Sub-slices stepped on separate Python threads (1: one fused call)."""
    flat_seconds: tuple[float, ...]
    torch_seconds: tuple[float, ...]
    identical: bool
    """Whether both ended with bitwise identical parameters."""

    @property
    def flat_params_per_s(self) -> float:
        return self.numel / statistics.median(self.flat_seconds)

    @property
    def torch_params_per_s(self) -> float:
        return self.numel / statistics.median(self.torch_seconds)

    @property
    def ratio(self) -> float:
        """tierzero over torch: above 1 is faster."""
        return self.flat_params_per_s / self.torch_params_per_s

    def summary(self) -> str:
        return (
            f"CPU Adam, {self.numel / 1e6:.0f}M fp32 params, {self.steps} steps, "
            f"{self.threads} torch threads, split {self.split}: "
            f"tierzero {self.flat_params_per_s / 1e9:.2f} G params/s "
            f"({statistics.median(self.flat_seconds) * 1e3:.1f} ms/step), "
            f"torch AdamW(fused=True) {self.torch_params_per_s / 1e9:.2f} G params/s "
            f"({statistics.median(self.torch_seconds) * 1e3:.1f} ms/step), "
            f"ratio {self.ratio:.3f}, {'bitwise identical' if self.identical else 'RESULTS DIFFER'}"
        )


def bench_cpu_adam(
    numel: int = 100_000_000,
    *,
    steps: int = 10,
    warmup: int = 2,
    threads: int | None = None,
    split: int = 1,
    seed: int = 0,
) -> AdamBenchResult:
    """Time both optimizers on `numel` parameters; about 28 bytes per parameter of memory.

    `threads` sets torch's intra-op threads for the run (restored after); None keeps them.
    """
    if numel < 1 or steps < 1 or warmup < 0 or split < 1:
        raise ValueError(
            f"bench_cpu_adam needs numel >= 1, steps >= 1, warmup >= 0, split >= 1; "
            f"got numel={numel}, steps={steps}, warmup={warmup}, split={split}"
        )
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(numel, steps=steps, warmup=warmup, split=split, seed=seed)
    finally:
        torch.set_num_threads(before)


def _run(numel: int, *, steps: int, warmup: int, split: int, seed: int) -> AdamBenchResult:
    lr, betas, eps, wd = 1e-3, (0.9, 0.999), 1e-8, 0.01
    g = torch.Generator().manual_seed(seed)
    grad = torch.randn(numel, generator=g)  # shared: neither optimizer writes it
    ref = torch.nn.Parameter(torch.randn(numel, generator=g))
    ref.grad = grad
    ref_opt = torch.optim.AdamW([ref], lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=True)
    flat = ref.detach().clone()
    opt = FlatAdam(OptimizerSpec(type=OptimizerType.ADAMW, lr=lr, betas=betas, eps=eps, weight_decay=wd))
    states = opt.new_states(numel)
    parts = _parts(numel, split)
    pool = ThreadPoolExecutor(max_workers=split) if split > 1 else None

    def flat_step(step: int) -> None:
        if pool is None:
            opt.step(param=flat, grad=grad, states=states, step=step, lr=lr)
            return
        list(pool.map(lambda ab: _step_part(opt, flat, grad, states, ab, step, lr), parts))

    flat_times: list[float] = []
    torch_times: list[float] = []
    try:
        for i in range(warmup + steps):
            order = [(flat_times, lambda s=i + 1: flat_step(s)), (torch_times, ref_opt.step)]
            for times, run in order if i % 2 == 0 else reversed(order):
                start = time.perf_counter()
                run()
                if i >= warmup:
                    times.append(time.perf_counter() - start)
    finally:
        if pool is not None:
            pool.shutdown()
    return AdamBenchResult(
        numel=numel,
        steps=steps,
        threads=torch.get_num_threads(),
        split=split,
        flat_seconds=tuple(flat_times),
        torch_seconds=tuple(torch_times),
        identical=torch.equal(flat, ref.detach()),
    )


def _parts(numel: int, split: int) -> list[tuple[int, int]]:
    # Cut at multiples of 64 elements so that no cut creates a scalar tail the
    # single call would not have: the split run stays bitwise comparable.
    step = -(-numel // split // 64) * 64
    return [(a, min(a + step, numel)) for a in range(0, numel, step)]


def _step_part(
    opt: FlatOptimizer,
    flat: torch.Tensor,
    grad: torch.Tensor,
    states: dict[Kind, torch.Tensor],
    bounds: tuple[int, int],
    step: int,
    lr: float,
) -> None:
    a, b = bounds
    opt.step(param=flat[a:b], grad=grad[a:b], states={k: v[a:b] for k, v in states.items()}, step=step, lr=lr)


def _command(args: argparse.Namespace) -> int:
    result = bench_cpu_adam(parse_size(args.params), steps=args.steps, split=args.split)
    print(result.summary())
    return 0 if result.identical else 1


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench adam`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "adam", help="CPU Adam: tierzero's flat step beside torch.optim.AdamW(fused=True)",
        description="Parameters updated per second, both optimizers alternating step by step, results compared bitwise.",
    )
    parser.add_argument("--params", default="100M", help="fp32 parameters to update (default 100M; 'M' is 10^6)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps of each (default 10)")
    parser.add_argument("--split", type=int, default=1, help="sub-slices stepped on as many threads (default 1)")
    parser.set_defaults(func=_command)
