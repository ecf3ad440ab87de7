"""`tierzero make-checkpoint --arch llama --size 2b OUT`: a random-weight transformers checkpoint to fine-tune."""

from __future__ import annotations

import argparse
import resource
import sys
import time
from typing import Any, TextIO

from tierzero.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, EXPORT_DTYPES
from tierzero.checkpoint.format import dtype_name
from tierzero.checkpoint.stand_in import ARCHS, SIZES, make_checkpoint
from tierzero.cli.commands import COMMANDS
from tierzero.common.sizes import format_size


def add_make_checkpoint_command(subparsers: Any) -> None:
    """Register `tierzero make-checkpoint` on the `tierzero` command's sub-parsers."""
    parser = subparsers.add_parser("make-checkpoint", help=COMMANDS["make-checkpoint"].help)
    parser.add_argument("out", help="the model directory to write (new or empty, unless --force)")
    parser.add_argument("--arch", choices=ARCHS, default="llama", help="the architecture (default llama)")
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="tiny (tests) or 2b (2.23e9 parameters)")
    parser.add_argument("--dtype", choices=["bf16", "fp32"], default="fp32", help="dtype of the weights (default fp32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights (default 0)")
    parser.add_argument(
        "--max-shard-size", default=DEFAULT_MAX_SHARD_SIZE, metavar="SIZE", help=f"largest weight file (default {DEFAULT_MAX_SHARD_SIZE})"
    )
    parser.add_argument("--force", action="store_true", help="write into OUT even when it is not empty")
    parser.set_defaults(func=run_make_checkpoint)


def run_make_checkpoint(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    began = time.perf_counter()
    made = make_checkpoint(
        args.out, arch=args.arch, size=args.size, dtype=EXPORT_DTYPES[args.dtype], seed=args.seed,
        max_shard_size=args.max_shard_size, force=args.force,
    )  # fmt: skip
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    (out or sys.stdout).write(
        f"wrote a {args.arch} of {made.parameters:,} parameters ({format_size(made.weights.nbytes)} of "
        f"{dtype_name(made.weights.dtype)} in {len(made.weights.files)} files) and a tokenizer of {made.tokenizer_vocab} ids "
        f"to {args.out} in {time.perf_counter() - began:.1f} s; peak RSS {format_size(peak)}\n"
    )
    return 0
