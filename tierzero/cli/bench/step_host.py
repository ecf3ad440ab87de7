"""`tierzero bench step-host`: the host's share of an offloaded step beside the optimizer alone.

On a GPU the optimizer of host-resident states runs on the host while the GPU computes, so the
step is as long as the host's work whenever that is the longer (../shared/gpu-h200: the 2B step
waited on the host). That work should be the optimizer and nothing more. This bench measures it
on the machine it runs on, with no model worth the name: each unit's only parameter meets a fixed
vector once in the forward (`(w * v).sum()`), so autograd's own kernels are a product and a sum
over the parameters and a product that writes their dense gradient, run alike by plain PyTorch. Three contenders on the same N parameters, in one process, alternating
step by step so that a noisy machine slows all alike:

- `engine`: forward, backward and step through tierzero with every state in host memory
  (`offload: cpu`), clipping and the compute dtype as asked;
- `plain`: the same model's forward and backward in plain PyTorch, no optimizer;
- `adam`: a bare `torch._fused_adamw_` over N fp32 parameters, one tensor a unit.

The host's share is `engine - plain`: the gradients' landing, the norm, the clip, the step, the
new parameters' cast, the gradients' reset and the engine's own bookkeeping. Its ratio to
`adam` is the figure: 1.0 means the host does the optimizer's work and nothing else. The same
ratio in the process's CPU time (every thread's, the swapper's too) is printed beside it: on a
host other jobs share, wall time measures the scheduler as much as the work.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

import tierzero
from tierzero.common.sizes import format_size, parse_size
from tierzero.offload.host_heap import keep_freed_memory
from tierzero.units.precision import dtype_of

__all__ = ["StepHostResult", "add_command", "bench_step_host"]


class _Block(nn.Module):
    """One unit: `slots` flat parameters (a real layer's weights and biases are a dozen tensors) that the
    forward reads once each, against fixed vectors, so that each gradient is a dense tensor as a
    real layer's is (a sum's would be a broadcast view)."""

    def __init__(self, numel: int, *, dtype: torch.dtype, compute: torch.dtype, slots: int = 1) -> None:
        super().__init__()
        values = torch.randn(2, numel, generator=torch.Generator().manual_seed(numel)).mul_(0.01)
        sizes = [numel // slots] * (slots - 1) + [numel - (numel // slots) * (slots - 1)]
        self.w = nn.ParameterList(nn.Parameter(part.to(dtype)) for part in values[0].split(sizes))
        for i, part in enumerate(values[1].split(sizes)):
            self.register_buffer(f"v{i}", part.to(compute))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, w in enumerate(self.w):
            x = x + (w * getattr(self, f"v{i}")).sum()
        return x


class _Model(nn.Module):
    def __init__(self, numel: int, units: int, *, dtype: torch.dtype, compute: torch.dtype, slots: int = 1) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(numel // units, dtype=dtype, compute=compute, slots=slots) for _ in range(units))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.float().square().sum()


@dataclass(frozen=True, slots=True, kw_only=True)
class StepHostResult:
    params: int
    units: int
    slots: int
    """Parameters a unit."""
    dtype: str
    clip: float
    engine_s: tuple[float, ...]
    plain_s: tuple[float, ...]
    adam_s: tuple[float, ...]
    engine_step_s: tuple[float, ...]
    """The engine's `step()` call alone, inside each `engine_s`."""
    engine_cpu_s: tuple[float, ...] = ()
    """The process's CPU time (all threads) during each `engine_s`; likewise `plain_cpu_s`, `adam_cpu_s`."""
    plain_cpu_s: tuple[float, ...] = ()
    adam_cpu_s: tuple[float, ...] = ()

    @property
    def host_s(self) -> float:
        """The engine's work beyond plain autograd, a step (medians)."""
        return statistics.median(self.engine_s) - statistics.median(self.plain_s)

    @property
    def ratio(self) -> float:
        """The host's share over the bare optimizer: 1.0 is the optimizer's work alone."""
        return self.host_s / statistics.median(self.adam_s)

    @property
    def cpu_ratio(self) -> float:
        """`ratio` in CPU time: the engine's CPU beyond plain autograd's over the bare optimizer's."""
        engine, plain, adam = (statistics.median(t) for t in (self.engine_cpu_s, self.plain_cpu_s, self.adam_cpu_s))
        return (engine - plain) / adam

    def to_json(self) -> dict[str, object]:
        return {
            "params": self.params, "units": self.units, "slots": self.slots, "dtype": self.dtype, "clip": self.clip,
            "engine_s": list(self.engine_s), "plain_s": list(self.plain_s), "adam_s": list(self.adam_s),
            "engine_step_s": list(self.engine_step_s), "host_s": self.host_s, "ratio": self.ratio,
            "engine_cpu_s": list(self.engine_cpu_s), "plain_cpu_s": list(self.plain_cpu_s),
            "adam_cpu_s": list(self.adam_cpu_s), "cpu_ratio": self.cpu_ratio,
        }  # fmt: skip

    def format(self) -> str:
        ms = {name: statistics.median(values) * 1e3 for name, values in (
            ("engine", self.engine_s), ("plain", self.plain_s), ("adam", self.adam_s), ("step", self.engine_step_s))}  # fmt: skip
        return (
            f"bench step-host: {self.params / 1e6:,.0f}M parameters in {self.units} units{self._of_slots()}, {self.dtype}, clip {self.clip}, "
            f"{torch.get_num_threads()} threads (medians of {len(self.engine_s)} steps)\n"
            f"  engine step       {ms['engine']:9.1f} ms   (of which engine.step() {ms['step']:.1f} ms)\n"
            f"  plain fwd+bwd     {ms['plain']:9.1f} ms\n"
            f"  host share        {self.host_s * 1e3:9.1f} ms   = engine - plain\n"
            f"  bare fused AdamW  {ms['adam']:9.1f} ms   over {format_size(self.params * 4)} of fp32 parameters\n"
            f"  host share / AdamW  {self.ratio:.2f}x   (target <= 1.3x)\n"
            f"  in CPU time         {self.cpu_ratio:.2f}x   (engine {statistics.median(self.engine_cpu_s) * 1e3:.1f} ms, "
            f"plain {statistics.median(self.plain_cpu_s) * 1e3:.1f}, AdamW {statistics.median(self.adam_cpu_s) * 1e3:.1f})"
        )

    def _of_slots(self) -> str:
        return "" if self.slots == 1 else f" of {self.slots} tensors"


def bench_step_host(
    params: int, *, units: int = 8, slots: int = 1, dtype: str = "bf16", clip: float = 1.0, steps: int = 5, warmup: int = 2
) -> StepHostResult:
    """The three contenders of the module note, `steps` timed steps each after `warmup`."""
    compute = dtype_of(dtype)
    # The engine is handed fp32 parameters, as a user builds them, and keeps its own compute copy.
    if slots < 1 or params // units < slots:
        raise ValueError(f"--slots must be between 1 and the parameters a unit ({params // units}), got {slots}")
    engine = tierzero.initialize(_Model(params, units, dtype=torch.float32, compute=compute, slots=slots), _config(dtype, clip))
    plain = _Model(params, units, dtype=compute, compute=compute, slots=slots)
    # As much freed heap kept as glibc allows (2 GiB), past the engine's own `tiers.cpu.keep_freed`:
    # plain PyTorch's fresh gradients each step would otherwise fault in pages the engine's reused
    # buffers do not, and charge the engine's share with less than its own work.
    keep_freed_memory(2**31 - 1)
    adam = _BareAdam([p.numel() for p in plain.parameters()])
    x = torch.ones(())
    times: dict[str, list[float]] = {"engine": [], "plain": [], "adam": [], "step": []}
    cpu: dict[str, list[float]] = {"engine": [], "plain": [], "adam": []}

    def engine_step() -> None:
        engine.backward(engine(x))
        began = time.perf_counter()
        engine.step()
        times["step"].append(time.perf_counter() - began)

    def plain_step() -> None:
        plain(x).backward()
        for p in plain.parameters():
            p.grad = None

    runs = [("engine", engine_step), ("plain", plain_step), ("adam", adam.step)]
    try:
        for i in range(warmup + steps):
            for name, run in runs[i % 3 :] + runs[: i % 3]:
                began, began_cpu = time.perf_counter(), time.process_time()
                run()
                if i >= warmup:
                    times[name].append(time.perf_counter() - began)
                    cpu[name].append(time.process_time() - began_cpu)
    finally:
        engine.close()
    return StepHostResult(
        params=params, units=units, slots=slots, dtype=dtype, clip=clip, engine_s=tuple(times["engine"]),
        plain_s=tuple(times["plain"]), adam_s=tuple(times["adam"]), engine_step_s=tuple(times["step"][warmup:]),
        engine_cpu_s=tuple(cpu["engine"]), plain_cpu_s=tuple(cpu["plain"]), adam_cpu_s=tuple(cpu["adam"]),
    )  # fmt: skip


def _config(dtype: str, clip: float) -> dict[str, object]:
    return {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": 1e-4, "weight_decay": 0.1},
        "gradient_clipping": clip,
        "precision": {"param_dtype": dtype},
        "offload": {"params": "cpu", "gradients": "cpu", "optimizer": "cpu"},
    }


class _BareAdam:
    """torch's fused AdamW over fp32 parameters of the model's tensors' sizes, as torch.optim would step them."""

    def __init__(self, sizes: list[int]) -> None:
        def fresh(fill: float) -> list[torch.Tensor]:
            return [torch.full((size,), fill) for size in sizes]

        self.params, self.grads, self.exp_avgs, self.exp_avg_sqs = fresh(0.01), fresh(0.001), fresh(0.0), fresh(0.0)
        self.count = torch.zeros(())

    def step(self) -> None:
        self.count += 1
        torch._fused_adamw_(
            self.params, self.grads, self.exp_avgs, self.exp_avg_sqs, [], [self.count] * len(self.params),
            lr=1e-4, beta1=0.9, beta2=0.999, weight_decay=0.1, eps=1e-8, amsgrad=False, maximize=False,
        )  # fmt: skip


def _command(args: argparse.Namespace) -> int:
    result = bench_step_host(
        parse_size(args.params), units=args.units, slots=args.slots, dtype=args.dtype, clip=args.clip, steps=args.steps, warmup=args.warmup
    )
    print(result.format())
    return 0


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench step-host`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "step-host", help="the host's share of an offloaded step beside a bare fused AdamW",
        description="Times the engine's work beyond plain autograd (gradient landing, norm, clip, optimizer, "
        "casts, resets) for N parameters in host memory, beside plain PyTorch's forward and backward and a bare "
        "torch._fused_adamw_ over the same N, alternating step by step.",
    )  # fmt: skip
    parser.add_argument("--params", default="100M", help="parameters (default 100M)")
    parser.add_argument("--units", type=int, default=8, help="units the parameters are cut into (default 8)")
    parser.add_argument("--slots", type=int, default=1, help="parameter tensors a unit (default 1; a transformer layer has about 12)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16", help="compute dtype (default bf16)")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient clipping (default 1.0; 0 turns it off)")
    parser.add_argument("--steps", type=int, default=5, help="timed steps (default 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.set_defaults(func=_command)
