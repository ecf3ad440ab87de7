"""`tierzero bench`: the NVMe tier against fio (`nvme`), the swapper under stress (`swap`),
CPU Adam (`adam`), an offloaded training step against plain PyTorch (`train`, on the CPU
or `--device cuda`), the ZeRO stages against plain PyTorch and DistributedDataParallel
(`zero`), and a pretrained checkpoint streamed into the engine (`load`), activation
checkpointing with and without offload (`activations`), the CUDA tests and bench in one
report (`gpu-check`), and `offload: auto` beside the oversized preset's own placement, each
run a `tierzero train` of its own (`oversized`).

matplotlib is imported only when a plot is written.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from tierzero.cli.bench import activations, gpu_check, load, nvme, swap
from tierzero.cli.bench.adam import bench_cpu_adam
from tierzero.cli.bench.contenders import PLACEMENTS
from tierzero.cli.bench.gpu import bench_train_device
from tierzero.cli.bench.oversized import add_oversized_command
from tierzero.cli.bench.placement import bench_placement
from tierzero.cli.bench.train_step import bench_train_step
from tierzero.cli.bench.zero import bench_zero
from tierzero.cli.bench.zeropp import add_zeropp_command
from tierzero.common.sizes import parse_size


def _run_adam(args: argparse.Namespace) -> int:
    result = bench_cpu_adam(parse_size(args.params), steps=args.steps, split=args.split)
    print(result.summary())
    return 0 if result.identical else 1


_TRAIN_DEFAULTS = {"cpu": {"seq": 128, "batch": 4, "steps": 20}, "cuda": {"seq": 512, "batch": 8, "steps": 10}}
"""`bench train`'s shape where the command line names none, per --device."""


def _run_train(args: argparse.Namespace) -> int:
    given = {name: getattr(args, name) for name in ("seq", "batch", "steps")}
    shape = {name: value if given[name] is None else given[name] for name, value in _TRAIN_DEFAULTS[args.device].items()}
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
    if args.json:
        Path(args.json).write_text(device_result.to_json() + "\n")
    return 0


def _run_zero(args: argparse.Namespace) -> int:
    result = bench_zero(
        d_model=args.d_model, n_layer=args.layers, seq=args.seq, batch=args.batch,
        steps=args.steps, warmup=args.warmup, threads=args.threads,
    )
    print(result.format())
    if args.json:
        Path(args.json).write_text(result.to_json() + "\n")
    return 0


def _run_placement(args: argparse.Namespace) -> int:
    bench_placement(
        nvme_path=args.nvme_path, preset=args.preset, device_share=args.device_share, cpu_share=args.cpu_share,
        rounds=args.rounds, steps=args.steps, batch=args.batch, seq=args.seq, finalists=args.finalists,
        builds=args.builds, out=sys.stdout,
    )  # fmt: skip
    return 0


def add_bench_commands(subparsers: Any) -> None:
    """Adds `bench` and its subcommands (nvme, swap, adam, train, zero, ...) to the `tierzero` command's sub-parsers."""
    bench = subparsers.add_parser("bench", help="measure the NVMe tier and stress the swapper")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    nvme_parser = commands.add_parser(
        "nvme", help="sweep NVMe tier settings against fio; print the best as config",
        description="Sweep block size x queue depth x threads x backend through the NVMe tier, beside fio.",
    )
    nvme.add_arguments(nvme_parser)
    nvme_parser.set_defaults(func=nvme.command)
    swap_parser = commands.add_parser(
        "swap", help="stress the store and swapper with random concurrent transfers, verifying every byte",
        description="Concurrent fetches, write-backs and releases of random slices across device, cpu and nvme.",
    )
    swap.add_arguments(swap_parser)
    swap_parser.set_defaults(func=swap.command)
    adam = commands.add_parser(
        "adam", help="CPU Adam: tierzero's flat step beside torch.optim.AdamW(fused=True)",
        description="Parameters updated per second, both optimizers alternating step by step, results compared bitwise.",
    )
    adam.add_argument("--params", default="100M", help="fp32 parameters to update (default 100M; 'M' is 10^6)")
    adam.add_argument("--steps", type=int, default=10, help="timed steps of each (default 10)")
    adam.add_argument("--split", type=int, default=1, help="sub-slices stepped on as many threads (default 1)")
    adam.set_defaults(func=_run_adam)
    train = commands.add_parser(
        "train", help="a training step with params and optimizer on NVMe beside plain in-memory PyTorch",
        description="Stage 3 with params and optimizer states on NVMe against plain PyTorch on the same "
        "GPT, alternating step by step: step-time ratio, prefetch hit rate, peak RSS of each. "
        "--device cuda: model TFLOPS (6 x parameters x tokens / step time), host<->device GB/s against "
        "a pinned-memory copy's peak, prefetch hit rate.",
    )
    train.add_argument("--nvme-path", required=True, help="directory for the swap files")
    train.add_argument(
        "--device", choices=tuple(_TRAIN_DEFAULTS), default="cpu",
        help="cpu (default): step ratio and peak RSS; cuda: TFLOPS, host<->device GB/s against pinned peak, hit rate",
    )
    train.add_argument(
        "--placement", choices=tuple(PLACEMENTS), default="params-optimizer-nvme",
        help="--device cuda: where tierzero keeps its state (default params-optimizer-nvme, as on cpu)",
    )
    train.add_argument("--preset", default="30m", help="built-in GPT size (tierzero.models.builtin.PRESETS; default 30m)")
    train.add_argument("--seq", type=int, help="sequence length (default 128 on cpu, 512 on cuda)")
    train.add_argument("--batch", type=int, help="micro-batch size (default 4 on cpu, 8 on cuda)")
    train.add_argument("--steps", type=int, help="timed steps of each (default 20 on cpu, 10 on cuda)")
    train.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    train.add_argument("--no-rss", action="store_true", help="skip the peak-RSS runs in fresh processes (cpu)")
    train.add_argument(
        "--runs", type=int, default=1,
        help="cpu: alternate runs of this many steps of each, back to back, as a training loop runs them (default 1: "
        "step by step, where one's trailing writes may land while the other computes)",
    )
    train.add_argument("--json", help="--device cuda: also write the result here")
    train.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32",
        help="bf16: tierzero's precision.autocast beside plain autocast",
    )  # fmt: skip
    train.add_argument(
        "--clip", type=float, default=0.0, help="gradient clipping of both (tierzero's gradient_clipping, torch's clip_grad_norm_)"
    )
    train.set_defaults(func=_run_train)
    acts = commands.add_parser(
        "activations", help="activation checkpointing alone beside checkpointing with offload to the cpu tier",
        description="Stage 3 on a GPT at a long sequence, alternating: step time, device-tier peak, the estimate's.",
    )
    activations.add_arguments(acts)
    acts.set_defaults(func=activations.command)
    load_parser = commands.add_parser(
        "load", help="stream model.pretrained into the engine's slices: bytes read, seconds, peak RSS",
        description="Build the engine from a pretrained checkpoint as tierzero train does, and measure the load.",
    )
    load.add_arguments(load_parser)
    load_parser.set_defaults(func=load.command)
    zero = commands.add_parser(
        "zero", help="ZeRO stages 1-3 beside plain PyTorch (N=1) and DistributedDataParallel (N=2, gloo)",
        description="Median step time of each stage on a built-in GPT, alternating contenders step by step, "
        "in one process and in two forked gloo ranks.",
    )
    zero.add_argument("--d-model", type=int, default=256, help="model width (default 256; heads of 64)")
    zero.add_argument("--layers", type=int, default=4, help="transformer blocks (default 4)")
    zero.add_argument("--seq", type=int, default=64, help="sequence length (default 64)")
    zero.add_argument("--batch", type=int, default=8, help="micro-batch per rank (default 8)")
    zero.add_argument("--steps", type=int, default=30, help="timed steps of each (default 30)")
    zero.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    zero.add_argument("--threads", type=int, default=1, help="torch threads per rank (default 1: two ranks, two cores)")
    zero.add_argument("--json", help="also write the result here")
    zero.set_defaults(func=_run_zero)
    placement = commands.add_parser(
        "placement", help="offload: auto beside every whole-kind placement that fits the same budgets",
        description="Stage 3 on a built-in GPT, one engine per placement, in rounds: median step of each against auto's; "
        "then the fastest, and the device for everything, beside auto again in pairs built anew.",
    )
    placement.add_argument("--nvme-path", required=True, help="directory for the contenders' swap directories")
    placement.add_argument("--preset", default="30m", help="built-in GPT size (default 30m)")
    placement.add_argument("--device-share", type=int, help="the device tier holds 1/D of the model's state")
    placement.add_argument("--cpu-share", type=int, help="the cpu tier holds 1/C of the model's state")
    placement.add_argument("--rounds", type=int, default=9, help="rounds of steps (default 9)")
    placement.add_argument("--steps", type=int, default=3, help="timed steps of each contender per round (default 3)")
    placement.add_argument("--batch", type=int, default=1, help="micro-batch (default 1, as the oversized preset)")
    placement.add_argument("--seq", type=int, default=64, help="sequence length (default 64, as the oversized preset)")
    placement.add_argument("--finalists", type=int, default=2, help="fastest placements set beside auto again (default 2)")
    placement.add_argument("--builds", type=int, default=5, help="fresh pairs of auto and each finalist (default 5)")
    placement.set_defaults(func=_run_placement)
    check = commands.add_parser(
        "gpu-check", help="tests/gpu and bench train --device cuda in one run, one JSON of results (make gpu-check)",
        description="Run the CUDA tests and the CUDA training bench, and write what they found, with the torch and "
        "CUDA versions and the device, to one JSON file. Fails without CUDA unless --dry-run.",
    )
    gpu_check.add_arguments(check)
    check.set_defaults(func=gpu_check.command)
    add_zeropp_command(commands)
    add_oversized_command(commands)
