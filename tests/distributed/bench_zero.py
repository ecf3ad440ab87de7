"""Step time of ZeRO stages 1/2/3 against plain PyTorch (N=1) and DistributedDataParallel (N=2).

    python tests/distributed/bench_zero.py [--width 256] [--layers 4] [--steps 20]

Each rank alternates the contenders step by step (plain/DDP, stage 1, 2, 3, again...),
so the machine's minute-to-minute drift hits all of them alike; the median of each
contender's steps is reported, after two warm-up steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from harness import TinyLM, run_ranks  # noqa: E402


def _config(stage: int) -> dict[str, Any]:
    return {"zero": {"stage": stage}, "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0}}


def _contenders(args: argparse.Namespace, world_size: int) -> dict[str, tuple[Any, Any]]:
    import tierzero

    def model() -> TinyLM:
        torch.manual_seed(0)
        return TinyLM(vocab=args.vocab, width=args.width, layers=args.layers)

    base: nn.Module = model()
    name = "plain" if world_size == 1 else "ddp"
    if world_size > 1:
        base = nn.parallel.DistributedDataParallel(base)
    optimizer = torch.optim.AdamW(base.parameters(), lr=1e-3, weight_decay=0.0, fused=True)
    out: dict[str, tuple[Any, Any]] = {name: (base, optimizer)}
    for stage in (1, 2, 3):
        out[f"stage{stage}"] = (tierzero.initialize(model(), _config(stage)), None)
    return out


def _step(runner: Any, optimizer: Any, tokens: torch.Tensor, targets: torch.Tensor) -> None:
    loss = runner(tokens, targets)
    if optimizer is None:
        runner.backward(loss)
        runner.step()
    else:
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _bench(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, float]:
    torch.set_num_threads(args.threads)
    contenders = _contenders(args, world_size)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    g = torch.Generator().manual_seed(rank)
    for step in range(args.steps + 2):
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g)
        for name, (runner, optimizer) in contenders.items():
            start = time.perf_counter()
            _step(runner, optimizer, tokens[:, :-1], tokens[:, 1:])
            if step >= 2:
                times[name].append(time.perf_counter() - start)
    for runner, optimizer in contenders.values():
        if optimizer is None:
            runner.close()
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    params = sum(p.numel() for p in TinyLM(vocab=args.vocab, width=args.width, layers=args.layers).parameters())
    print(f"TinyLM width {args.width}, {args.layers} layers, {params / 1e6:.2f} M params, batch {args.batch}x{args.seq}")
    for world_size in (1, 2):
        medians = _bench(0, 1, args) if world_size == 1 else run_ranks(_bench, world_size=2, payload=args)[0]
        baseline = "plain" if world_size == 1 else "ddp"
        for name, seconds in medians.items():
            print(f"N={world_size} {name:7s} {seconds * 1e3:8.1f} ms/step  {seconds / medians[baseline]:.2f}x {baseline}")


if __name__ == "__main__":
    main()
