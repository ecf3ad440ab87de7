"""`tierzero consolidate CKPT OUT [--hf]`: a sharded checkpoint's full model as safetensors or a transformers directory
(for a LoRA run, its base with the adapters merged, or with `--adapters-only` the adapters in peft's format)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, TextIO

from tierzero.checkpoint.consolidate import consolidate, consolidate_adapters, consolidate_pretrained
from tierzero.checkpoint.export import DEFAULT_MAX_SHARD_SIZE, EXPORT_DTYPES, shard_limit
from tierzero.checkpoint.formats import TransformersDirectory
from tierzero.cli.commands import COMMANDS
from tierzero.common.sizes import format_size


def add_consolidate_command(subparsers: Any) -> None:
    """Register `tierzero consolidate CKPT OUT [--hf ...]` on the `tierzero` command's sub-parsers."""
    parser = subparsers.add_parser("consolidate", help=COMMANDS["consolidate"].help)
    parser.add_argument("checkpoint", help="a checkpoint directory, or a checkpoint root (its newest complete checkpoint)")
    parser.add_argument(
        "out", help="the .safetensors file to write, or a directory for model.safetensors (and a transformers config.json)"
    )
    parser.add_argument(
        "--hf", action="store_true",
        help="write OUT as save_pretrained does: sharded safetensors, index, config.json and the tokenizer",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", choices=sorted(EXPORT_DTYPES), default=None,
        help="--hf: dtype written (default: the training dtype; bf16 for a LoRA run's merged model)",
    )  # fmt: skip
    parser.add_argument(
        "--max-shard-size", default=None, metavar="SIZE", help=f"--hf: largest weight file (default {DEFAULT_MAX_SHARD_SIZE})"
    )
    parser.add_argument(
        "--tokenizer", default=None, metavar="DIR",
        help="--hf: tokenizer directory to copy (default: the run's data.tokenizer, or its model.pretrained's tokenizer)",
    )  # fmt: skip
    parser.add_argument(
        "--adapters-only", action="store_true",
        help="--hf of a LoRA run: its adapters in peft's format, as train --export writes them, instead of the merged model",
    )  # fmt: skip
    parser.set_defaults(func=run_consolidate)


def run_consolidate(args: argparse.Namespace, *, out: TextIO | None = None) -> int:
    target = Path(args.out)
    given = (("--dtype", args.dtype), ("--max-shard-size", args.max_shard_size), ("--tokenizer", args.tokenizer))
    shaping = [flag for flag, value in given if value]
    hf_only = shaping + (["--adapters-only"] if args.adapters_only else [])
    if hf_only and not args.hf:
        raise ValueError(f"{hf_only[0]} shapes a transformers directory: add --hf")
    if args.adapters_only and shaping:
        raise ValueError(
            f"{shaping[0]} shapes the merged model, and --adapters-only writes peft's adapter files alone (fp32, no "
            f"tokenizer, as train --export writes them): drop {shaping[0]} or --adapters-only"
        )
    if args.hf and target.suffix == ".safetensors":
        raise ValueError(f"--hf writes a directory, got output {args.out}: name a directory, or drop --hf for one file")
    if not args.hf and target.suffix and target.suffix != ".safetensors":
        raise ValueError(
            f"consolidate writes safetensors, got output {args.out}: name it <something>.safetensors, or give a directory"
        )
    if args.max_shard_size is not None:
        shard_limit(args.max_shard_size, what="--max-shard-size")  # before anything is read or made
    stream = out or sys.stdout

    def note(line: str) -> None:
        stream.write(f"{line}\n")

    if args.adapters_only:
        done = consolidate_adapters(args.checkpoint, target, note=note)
    elif args.hf:
        hf = TransformersDirectory(
            dtype=EXPORT_DTYPES[args.dtype] if args.dtype else None, tokenizer=args.tokenizer,
            max_shard_size=args.max_shard_size or DEFAULT_MAX_SHARD_SIZE,
        )  # fmt: skip
        done = hf.convert(args.checkpoint, target, note=note)
    elif target.suffix:
        done = consolidate(args.checkpoint, target, note=note)
    else:
        done = consolidate_pretrained(args.checkpoint, target, note=note)
    stream.write(
        f"wrote {done.tensors} tensors ({format_size(done.nbytes)}) of step {done.step} to {done.path}; "
        f"largest unit held in memory {format_size(done.largest_unit_bytes)}\n"
    )
    return 0
