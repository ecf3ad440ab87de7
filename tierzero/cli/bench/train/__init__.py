"""`tierzero bench train`: an offloaded training step against plain PyTorch, on the CPU or `--device cuda`.

One command over two benches: `cpu` (step ratio and peak RSS on the CPU) and `gpu`
(TFLOPS and host<->device bandwidth on CUDA). They measure different things at different
shapes, so the shape flags default per device rather than in argparse. `--against deepspeed`
(on CUDA) adds DeepSpeed's ZeRO-3 beside tierzero, each alone in a child process (`against`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tierzero.cli.bench.contenders import PLACEMENTS
from tierzero.cli.bench.train.against import AGAINST, TARGET_RATIO, AgainstResult, check_against, compare_with_deepspeed
from tierzero.cli.bench.train.cpu import bench_train_step
from tierzero.cli.bench.train.gpu import bench_train_device, check_device

__all__ = ["add_command"]

_SHAPE_DEFAULTS = {"cpu": {"seq": 128, "batch": 4, "steps": 20}, "cuda": {"seq": 512, "batch": 8, "steps": 10}}
"""`bench train`'s shape where the command line names none, per --device."""


def _command(args: argparse.Namespace) -> int:
    given = {name: getattr(args, name) for name in ("seq", "batch", "steps")}
    shape = {name: value if given[name] is None else given[name] for name, value in _SHAPE_DEFAULTS[args.device].items()}
    against = _against(args, shape) if args.against is not None else None
    if args.device == "cpu":
        result = bench_train_step(
            nvme_path=args.nvme_path, preset=args.preset, warmup=args.warmup, measure_rss=not args.no_rss,
            clip=args.clip, dtype=args.dtype, runs=args.runs, **shape,
        )
        print(result.format())
        return 0
    device_result = bench_train_device(
        device=args.device, nvme_path=args.nvme_path, placement=args.placement, preset=args.preset,
        warmup=args.warmup, clip=args.clip, dtype=args.dtype, **shape,
    )
    print(device_result.format())
    report = device_result.to_dict()
    if against is not None:
        print(against.format())
        report["against"] = against.to_dict()
        report["summary"]["tierzero_over_deepspeed"] = against.ratio
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _against(args: argparse.Namespace, shape: dict[str, int]) -> AgainstResult:
    """`--against deepspeed`: refused in one line where it cannot run, else both contenders alone, before
    this process's own bench puts anything on the device."""
    check_against(device=args.device, placement=args.placement)
    check_device(args.device)
    print(
        f"bench train: tierzero, then DeepSpeed, each alone in a child process ({args.preset}, "
        f"{args.warmup} + {shape['steps']} steps); then plain PyTorch beside tierzero here",
        file=sys.stderr, flush=True,
    )  # fmt: skip
    return compare_with_deepspeed(
        nvme_path=args.nvme_path, preset=args.preset, warmup=args.warmup, dtype=args.dtype, clip=args.clip,
        placement=args.placement, **shape,
    )  # fmt: skip


def add_command(commands: argparse._SubParsersAction) -> None:
    """`tierzero bench train`, added to the `bench` sub-parsers."""
    parser = commands.add_parser(
        "train", help="a training step with params and optimizer on NVMe beside plain in-memory PyTorch",
        description="Stage 3 with params and optimizer states on NVMe against plain PyTorch on the same "
        "GPT, alternating step by step: step-time ratio, prefetch hit rate, peak RSS of each. "
        "--device cuda: model TFLOPS (6 x parameters x tokens / step time), host<->device GB/s against "
        "a pinned-memory copy's peak, prefetch hit rate.",
    )
    parser.add_argument("--nvme-path", required=True, help="directory for the swap files")
    parser.add_argument(
        "--device", choices=tuple(_SHAPE_DEFAULTS), default="cpu",
        help="cpu (default): step ratio and peak RSS; cuda: TFLOPS, host<->device GB/s against pinned peak, hit rate",
    )
    parser.add_argument(
        "--placement", choices=tuple(PLACEMENTS), default="params-optimizer-nvme",
        help="--device cuda: where tierzero keeps its state (default params-optimizer-nvme, as on cpu)",
    )
    parser.add_argument("--preset", default="30m", help="built-in GPT size (tierzero.models.builtin.PRESETS; default 30m)")
    parser.add_argument("--seq", type=int, help="sequence length (default 128 on cpu, 512 on cuda)")
    parser.add_argument("--batch", type=int, help="micro-batch size (default 4 on cpu, 8 on cuda)")
    parser.add_argument("--steps", type=int, help="timed steps of each (default 20 on cpu, 10 on cuda)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs in fresh processes (cpu)")
    parser.add_argument(
        "--runs", type=int, default=1,
        help="cpu: alternate runs of this many steps of each, back to back, as a training loop runs them (default 1: "
        "step by step, where one's trailing writes may land while the other computes)",
    )
    parser.add_argument("--json", help="--device cuda: also write the result here")
    parser.add_argument(
        "--against", choices=AGAINST,
        help="--device cuda: also train tierzero and DeepSpeed (ZeRO-3, offload as --placement cpu or device) each alone "
        f"in a child process on the same model and batches: the ratio of their median steps, target <= {TARGET_RATIO:g} "
        "(needs `pip install deepspeed`)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32",
        help="bf16: tierzero's precision.autocast beside plain autocast",
    )  # fmt: skip
    parser.add_argument(
        "--clip", type=float, default=0.0, help="gradient clipping of both (tierzero's gradient_clipping, torch's clip_grad_norm_)"
    )
    parser.set_defaults(func=_command)
