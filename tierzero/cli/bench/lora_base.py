"""`tierzero bench lora-base`: a LoRA step over a pretrained checkpoint with its frozen base stored in
bf16, beside the same step with the base quantized (NF4 by default), engines side by side.

Issue 43's check of `model.lora.base_dtype`: stage 3, the base on NVMe, gradients and optimizer
states in host memory. Each engine holds the same checkpoint with the same adapters, and their
steps alternate on the same tokens in one process, so a slow minute from other tenants falls on
every engine alike. The figure is each engine's median step after its first (which learns the
prefetch order) beside the first engine's, with the NVMe bytes each reads a step and the bytes its
base holds a parameter. Peak RSS needs a process of its own: run the bench with one base dtype
under `/usr/bin/time -v`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tierzero.api import initialize
from tierzero.cli.bench.report import finish
from tierzero.common.slices import Kind
from tierzero.config.model import BASE_DTYPES
from tierzero.pretrained import build_meta_model
from tierzero.pretrained.lora import apply_lora

__all__ = ["TARGET", "LoraBaseResult", "add_command", "bench_lora_base"]

TARGET = 2.5
"""How many times faster an NF4 base's step must be than a bf16 base's (issue 43)."""
LLAMA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraBaseResult:
    pretrained: str
    tokens: int
    """Tokens a step (batch x sequence)."""
    gather_ahead: int
    steps: dict[str, list[float]]
    """Base dtype -> seconds of each step, in the order they ran (the first learns the prefetch order)."""
    read_bytes: dict[str, int]
    """Base dtype -> NVMe bytes its last step read."""
    base_bytes_per_parameter: dict[str, float]
    losses: dict[str, list[float]]

    def median(self, name: str) -> float:
        return statistics.median(self.steps[name][1:] or self.steps[name])

    def speedup(self, name: str) -> float:
        """How many times faster `name`'s step is than the first base dtype's."""
        return self.median(next(iter(self.steps))) / self.median(name)

    def judged(self) -> bool:
        """Whether the run has the target's pair: an nf4 base beside a first engine in the compute dtype."""
        return "nf4" in self.steps and next(iter(self.steps)) in ("bf16", "param")

    def met(self) -> bool:
        return not self.judged() or self.speedup("nf4") >= TARGET

    def format(self) -> str:
        names = list(self.steps)
        lines = [
            f"LoRA step over {self.pretrained}, {self.tokens} tokens, base on NVMe, zero.gather_ahead {self.gather_ahead}; "
            f"engines side by side, steps alternated",
            f"{'base':>6} {'median s':>9} {'speedup':>8} {'GB read':>8} {'B/param':>8}  steps (s)",
        ]
        for n in names:
            steps = " ".join(f"{s:.2f}" for s in self.steps[n])
            lines.append(
                f"{n:>6} {self.median(n):9.2f} {self.speedup(n):7.2f}x {self.read_bytes[n] / 1e9:8.3f} "
                f"{self.base_bytes_per_parameter[n]:8.4f}  {steps}"
            )
        if self.judged():
            lines.append(f"target: an nf4 base >= {TARGET}x a bf16 base's step: {self.met()}")
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


def _config(base_dtype: str, *, r: int, gather_ahead: int, swap: Path) -> dict[str, object]:
    return {
        "zero": {"stage": 3, "gather_ahead": gather_ahead},
        "precision": {"param_dtype": "bf16"},
        "optimizer": {"lr": 1e-4},
        "model": {"lora": {"r": r, "base_dtype": base_dtype}},
        "offload": {"params": "nvme", "optimizer": "cpu", "gradients": "cpu"},
        "tiers": {"nvme": {"path": str(swap)}},
    }


def bench_lora_base(
    pretrained: Path, nvme_path: Path, *, base_dtypes: tuple[str, ...] = ("bf16", "nf4"), r: int = 16, alpha: int = 32,
    targets: tuple[str, ...] = LLAMA_TARGETS, seq: int = 64, batch: int = 1, rounds: int = 6, gather_ahead: int = 1,
) -> LoraBaseResult:  # fmt: skip
    """`rounds` alternated steps of one engine per base dtype, each over `pretrained` with LoRA adapters
    (rank `r`) on `targets`; swap files under `nvme_path`."""
    bad = [d for d in base_dtypes if d not in BASE_DTYPES]
    if bad or not base_dtypes:
        raise ValueError(f"bench lora-base --base-dtypes takes {', '.join(BASE_DTYPES)}, comma-separated; got {','.join(base_dtypes)!r}")
    if rounds < 2:
        raise ValueError(f"bench lora-base --rounds must be at least 2 (the first step learns the prefetch order); got {rounds}")
    engines, base_bytes = {}, {}
    with ExitStack() as stack:
        for dtype in base_dtypes:
            swap = nvme_path / f"lora-base-{os.getpid()}-{dtype}"
            swap.mkdir(parents=True, exist_ok=True)
            base = build_meta_model(pretrained)
            vocab = int(base.config.vocab_size)
            model = apply_lora(base, r=r, alpha=alpha, target_modules=list(targets))
            config = _config(dtype, r=r, gather_ahead=gather_ahead, swap=swap)
            engine = stack.enter_context(initialize(model, config, pretrained=pretrained))
            engines[dtype] = engine
            frozen = [engine.plan.spec(u.name, Kind.PARAM) for u in engine.units if not u.trainable]
            base_bytes[dtype] = sum(s.nbytes for s in frozen) / sum(s.parameters for s in frozen)
        tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
        steps: dict[str, list[float]] = {d: [] for d in base_dtypes}
        losses: dict[str, list[float]] = {d: [] for d in base_dtypes}
        read = dict.fromkeys(base_dtypes, 0)
        for _ in range(rounds):
            for dtype, engine in engines.items():
                before = engine.store.nvme_traffic()[0]
                start = time.perf_counter()
                loss = engine(input_ids=tokens, labels=tokens).loss
                engine.backward(loss)
                engine.step()
                steps[dtype].append(time.perf_counter() - start)
                losses[dtype].append(float(loss.detach()))
                read[dtype] = engine.store.nvme_traffic()[0] - before
    return LoraBaseResult(
        pretrained=str(pretrained), tokens=batch * seq, gather_ahead=gather_ahead, steps=steps, read_bytes=read,
        base_bytes_per_parameter=base_bytes, losses=losses,
    )  # fmt: skip


def _command(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    result = bench_lora_base(
        Path(args.pretrained), Path(args.nvme_path), base_dtypes=tuple(args.base_dtypes.split(",")), r=args.r,
        alpha=args.alpha, targets=tuple(args.targets.split(",")), seq=args.seq, batch=args.batch, rounds=args.rounds,
        gather_ahead=args.gather_ahead,
    )  # fmt: skip
    return finish(result, args.json)


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench lora-base`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "lora-base", help="a LoRA step with the frozen base in bf16 beside NF4 (or int8), base on NVMe",
        description="One engine per --base-dtypes over the same pretrained checkpoint and LoRA adapters, stage 3 with "
        "the base on NVMe, steps alternated on the same tokens: each median step after the first beside the first "
        f"base dtype's (target: nf4 >= {TARGET}x bf16), NVMe bytes read a step, base bytes a parameter.",
    )  # fmt: skip
    parser.add_argument("--pretrained", required=True, help="a Hugging Face checkpoint directory (safetensors)")
    parser.add_argument("--nvme-path", required=True, help="directory for the swap files")
    parser.add_argument("--base-dtypes", default="bf16,nf4", help="model.lora.base_dtype of each engine, the first the reference (default bf16,nf4)")
    parser.add_argument("--r", type=int, default=16, help="LoRA rank (default 16)")
    parser.add_argument("--alpha", type=int, default=32, help="LoRA alpha (default 32)")
    parser.add_argument("--targets", default=",".join(LLAMA_TARGETS), help="module names that get adapters (default: a Llama's projections)")
    parser.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    parser.add_argument("--batch", type=int, default=1, help="sequences a step (default 1)")
    parser.add_argument("--rounds", type=int, default=6, help="steps of each engine, alternated (default 6)")
    parser.add_argument("--gather-ahead", type=int, default=1, help="zero.gather_ahead of every engine (default 1)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", help="also write the result here")
    parser.set_defaults(func=_command)
