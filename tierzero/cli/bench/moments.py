"""`tierzero bench moments`: the loss of a built-in GPT with 8-bit (or bf16) Adam moments against fp32 moments.

Issue 43's check of `optimizer.state_dtype: int8` ([Note: compact moments]): the same GPT
preset (the 30M one by default) trains the same steps on the same byte-level batches from
the same initial weights once per moment dtype, at one rank with every state in the device
tier, so the runs differ only in how Adam's moments are stored. The figure is the mean
loss of the last 20 steps (single steps swing about 10% batch to batch), relative to fp32
moments'; the curve is printed as the mean of each `every` steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from tierzero.api import initialize
from tierzero.cli.bench.report import finish
from tierzero.config import load_config
from tierzero.data import batches_from_config
from tierzero.engine.micro_step import micro_step
from tierzero.models.builtin import PRESETS, build_model

__all__ = ["TARGET", "MomentsResult", "add_command", "bench_moments"]

TARGET = 0.01
"""Most relative difference of the final loss from fp32 moments' (issue 43)."""
TAIL = 20
"""Steps whose mean loss is the final loss."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MomentsResult:
    preset: str
    steps: int
    every: int
    losses: dict[str, list[float]]
    """state_dtype -> the loss of each step."""
    seconds: dict[str, float]
    """state_dtype -> wall seconds of its whole run (noisy on a shared machine)."""

    def final(self, name: str) -> float:
        tail = self.losses[name][-TAIL:]
        return sum(tail) / len(tail)

    def rel_diff(self, name: str) -> float:
        """The final loss's relative difference from fp32 moments', signed (> 0: higher loss)."""
        return self.final(name) / self.final("fp32") - 1

    def met(self) -> bool:
        return all(abs(self.rel_diff(name)) <= TARGET for name in self.losses)

    def format(self) -> str:
        names = list(self.losses)
        width = max(12, *(len(n) + 2 for n in names))
        lines = [
            f"loss of the {self.preset} GPT preset, {self.steps} steps, by optimizer.state_dtype; "
            f"each row the mean of the {self.every} steps ending there",
            "step".rjust(6) + "".join(n.rjust(width) for n in names),
        ]
        for end in range(self.every, self.steps + 1, self.every):
            means = [sum(self.losses[n][end - self.every : end]) / self.every for n in names]
            lines.append(f"{end:6d}" + "".join(f"{m:{width}.4f}" for m in means))
        tail = min(TAIL, self.steps)
        lines.append(f"last {tail}".rjust(6) + "".join(f"{self.final(n):{width}.4f}" for n in names))
        lines.append("vs fp32".rjust(6) + "".join(f"{self.rel_diff(n):{width}.3%}" for n in names))
        lines.append("seconds".rjust(6) + "".join(f"{self.seconds[n]:{width}.1f}" for n in names))
        lines.append(f"target: the mean of the last {tail} steps within {TARGET:.0%} of fp32 moments': {self.met()}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _config(state_dtype: str, *, preset: str, steps: int, batch: int, seq_len: int, lr: float) -> dict[str, Any]:
    return {
        "zero": {"stage": 3},
        "optimizer": {"type": "adamw", "lr": lr, "state_dtype": state_dtype},
        "gradient_clipping": 1.0,
        "model": {"type": "gpt", **dataclasses.asdict(PRESETS[preset])},
        "data": {"max_bytes": "4MiB"},
        "train": {"steps": steps, "micro_batch_size": batch, "seq_len": seq_len},
    }


def _run(config: dict[str, Any]) -> tuple[list[float], float]:
    """The loss of each step of one run, and its wall seconds."""
    cfg = load_config(config)
    torch.manual_seed(cfg.train.seed)  # the same initial weights for every state dtype
    data = batches_from_config(cfg, rank=0, world_size=1)
    start = time.perf_counter()
    with initialize(build_model(cfg.model), cfg) as engine:
        losses = [micro_step(engine, *data.batch(step), is_hf=False).item() for step in range(cfg.train.steps)]
    return losses, time.perf_counter() - start


def bench_moments(
    *, preset: str = "30m", steps: int = 200, every: int = 10, batch: int = 4, seq_len: int = 64, lr: float = 1e-3,
    dtypes: tuple[str, ...] = ("int8",),
) -> MomentsResult:  # fmt: skip
    """Train `preset` `steps` steps with fp32 moments, then with each of `dtypes`; every loss."""
    if preset not in PRESETS:
        raise ValueError(f"bench moments --preset must be one of {', '.join(PRESETS)}, got {preset!r}")
    if steps < 1 or every < 1 or steps % every:
        raise ValueError(f"bench moments needs steps >= 1 and a multiple of every >= 1; got {steps}, {every}")
    losses, seconds = {}, {}
    for name in ("fp32", *(d for d in dtypes if d != "fp32")):
        config = _config(name, preset=preset, steps=steps, batch=batch, seq_len=seq_len, lr=lr)
        losses[name], seconds[name] = _run(config)
    return MomentsResult(preset=preset, steps=steps, every=every, losses=losses, seconds=seconds)


def _command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    result = bench_moments(
        preset=args.preset, steps=args.steps, every=args.every, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
        dtypes=tuple(args.dtypes.split(",")),
    )  # fmt: skip
    return finish(result, args.json)


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench moments`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "moments", help="8-bit (or bf16) Adam moments beside fp32 moments: the loss curve of a built-in GPT",
        description="A built-in GPT preset trained the same steps on the same batches from the same weights with "
        "optimizer.state_dtype fp32 and each of --dtypes: the loss every --every steps and the mean of the last "
        f"{TAIL} steps relative to fp32's (target within {TARGET:.0%}).",
    )  # fmt: skip
    parser.add_argument("--preset", default="30m", help=f"the built-in GPT size, one of {', '.join(PRESETS)} (default 30m)")
    parser.add_argument("--steps", type=int, default=200, help="training steps of each run (default 200)")
    parser.add_argument("--every", type=int, default=10, help="print the mean loss of every this many steps (default 10)")
    parser.add_argument("--batch", type=int, default=4, help="train.micro_batch_size (default 4)")
    parser.add_argument("--seq-len", type=int, default=64, help="train.seq_len (default 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="optimizer.lr (default 1e-3)")
    parser.add_argument("--dtypes", default="int8", help="state dtypes beside fp32, comma-separated (default int8)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", help="also write the result here")
    parser.set_defaults(func=_command)
