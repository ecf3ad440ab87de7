"""Step time of ZeRO stages 1, 2 and 3 against plain PyTorch (N=1) and DistributedDataParallel (N=2).

`bench_zero` builds the same built-in GPT once per contender, in one process for N=1
and in each of two forked gloo ranks for N=2. Each rank alternates the contenders
step by step (plain or DDP, stage 1, 2, 3, again...), so the machine's minute-to-minute
drift slows all of them alike, and reports the median of each contender's steps after
the warm-up steps. The ratios are rank 0's medians over the baseline's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierzero.api import initialize
from tierzero.cli.bench.forked import forked_ranks
from tierzero.models.builtin import GPT, ModelSpec

__all__ = ["ZeroBenchResult", "add_command", "bench_zero"]

STAGES = (1, 2, 3)
TARGETS = {"stage1": 1.15, "stage2": 1.15, "stage3": 1.3}
"""Most step time of each stage over the baseline (issue: ZeRO stages, numbers)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroBenchResult:
    d_model: int
    n_layer: int
    params: int
    seq: int
    batch: int
    steps: int
    medians: dict[int, dict[str, float]]
    """World size -> contender ("plain" | "ddp" | "stage1" ...) -> median seconds per step (rank 0)."""

    def ratio(self, world_size: int, name: str) -> float:
        baseline = "plain" if world_size == 1 else "ddp"
        return self.medians[world_size][name] / self.medians[world_size][baseline]

    def met(self) -> bool:
        return all(self.ratio(n, name) <= target for n in self.medians for name, target in TARGETS.items())

    def format(self) -> str:
        lines = [
            f"GPT d_model {self.d_model}, {self.n_layer} layers, {self.params / 1e6:.2f} M params, "
            f"batch {self.batch}x{self.seq}, median of {self.steps} steps"
        ]
        for world_size, medians in self.medians.items():
            baseline = "plain" if world_size == 1 else "ddp"
            for name, seconds in medians.items():
                target = f" (target <= {TARGETS[name]:.2f})" if name in TARGETS else ""
                lines.append(
                    f"  N={world_size} {name:7s} {seconds * 1e3:8.1f} ms/step  "
                    f"{self.ratio(world_size, name):.2f}x {baseline}{target}"
                )
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Setup:
    d_model: int
    n_layer: int
    seq: int
    batch: int
    steps: int
    warmup: int
    threads: int

    def spec(self) -> ModelSpec:
        return ModelSpec(
            n_layer=self.n_layer, n_head=max(1, self.d_model // 64), d_model=self.d_model,
            d_ff=4 * self.d_model, max_seq_len=self.seq,
        )

    def model(self) -> nn.Module:
        torch.manual_seed(0)
        return GPT(self.spec())


def bench_zero(
    *, d_model: int = 256, n_layer: int = 4, seq: int = 64, batch: int = 8, steps: int = 30, warmup: int = 2, threads: int = 1
) -> ZeroBenchResult:
    """Median step time of each contender at N=1 (in this process) and N=2 (two forked gloo ranks)."""
    if steps < 1 or warmup < 0 or threads < 1:
        raise ValueError(f"bench zero needs steps >= 1, warmup >= 0, threads >= 1; got {steps}, {warmup}, {threads}")
    setup = _Setup(d_model=d_model, n_layer=n_layer, seq=seq, batch=batch, steps=steps, warmup=warmup, threads=threads)
    params = sum(p.numel() for p in setup.model().parameters())
    single = _bench_rank(setup, rank=0, world_size=1)
    pair = forked_ranks(_pair_rank, setup, world_size=2, what="bench zero")
    return ZeroBenchResult(
        d_model=d_model, n_layer=n_layer, params=params, seq=seq, batch=batch, steps=steps, medians={1: single, 2: pair}
    )


def _contenders(setup: _Setup, world_size: int) -> dict[str, tuple[Any, torch.optim.Optimizer | None]]:
    base = setup.model()
    if world_size > 1:
        base = nn.parallel.DistributedDataParallel(base)
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    out: dict[str, tuple[Any, torch.optim.Optimizer | None]] = {"plain" if world_size == 1 else "ddp": (base, optimizer)}
    for stage in STAGES:
        cfg = {"zero": {"stage": stage}, "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0}}
        out[f"stage{stage}"] = (initialize(setup.model(), cfg), None)
    return out


def _step(runner: Any, optimizer: torch.optim.Optimizer | None, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    _, loss = runner(tokens, targets)
    if optimizer is None:
        runner.backward(loss)
        runner.step()
    else:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _bench_rank(setup: _Setup, *, rank: int, world_size: int) -> dict[str, float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(setup.threads)
    contenders = _contenders(setup, world_size)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    g = torch.Generator().manual_seed(rank)
    try:
        for step in range(setup.warmup + setup.steps):
            tokens = torch.randint(0, 256, (setup.batch, setup.seq + 1), generator=g)
            for name, (runner, optimizer) in contenders.items():
                started = time.perf_counter()
                _step(runner, optimizer, tokens[:, :-1], tokens[:, 1:])
                if step >= setup.warmup:
                    times[name].append(time.perf_counter() - started)
    finally:
        for runner, optimizer in contenders.values():
            if optimizer is None:
                runner.close()
        torch.set_num_threads(threads)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _pair_rank(rank: int, setup: _Setup) -> dict[str, float]:
    return _bench_rank(setup, rank=rank, world_size=2)


def _command(args: argparse.Namespace) -> int:
    result = bench_zero(
        d_model=args.d_model, n_layer=args.layers, seq=args.seq, batch=args.batch,
        steps=args.steps, warmup=args.warmup, threads=args.threads,
    )
    print(result.format())
    if args.json:
        Path(args.json).write_text(result.to_json() + "\n")
    return 0


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench zero`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "zero", help="ZeRO stages 1-3 beside plain PyTorch (N=1) and DistributedDataParallel (N=2, gloo)",
        description="Median step time of each stage on a built-in GPT, alternating contenders step by step, "
        "in one process and in two forked gloo ranks.",
    )
    parser.add_argument("--d-model", type=int, default=256, help="model width (default 256; heads of 64)")
    parser.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch per rank (default 8)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each (default 30)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: two ranks, two cores)")
    parser.add_argument("--json", help="also write the result here")
    parser.set_defaults(func=_command)
