"""`tierzero bench`: the NVMe tier against fio (`nvme`), the swapper under stress (`swap`),
CPU Adam (`adam`), an offloaded training step against plain PyTorch (`train`, on the CPU
or `--device cuda`), the ZeRO stages against plain PyTorch and DistributedDataParallel
(`zero`), and a pretrained checkpoint streamed into the engine (`load`), activation
checkpointing with and without offload (`activations`), the CUDA tests and bench in one
report (`gpu-check`), and `offload: auto` beside the oversized preset's own placement, each
run a `tierzero train` of its own (`oversized`). `moments`: a GPT's loss with 8-bit Adam moments beside fp32's.
`lora-base`: a LoRA step over a checkpoint with its frozen base in bf16 beside NF4.

matplotlib is imported only when a plot is written.
"""

from __future__ import annotations

from typing import Any

from tierzero.cli.bench import (
    activations,
    adam,
    gpu_check,
    load,
    lora_base,
    moments,
    nvme,
    oversized,
    placement,
    step_host,
    swap,
    train,
    zero,
    zeropp,
)
from tierzero.cli.commands import COMMANDS

BENCH_COMMANDS = (nvme, swap, adam, train, step_host, activations, load, zero, placement, gpu_check, zeropp, oversized, moments, lora_base)
"""The modules of the `bench` subcommands, in the order `tierzero bench --help` lists them; each adds its own."""


def add_bench_commands(subparsers: Any) -> None:
    """Adds `bench` and its subcommands (nvme, swap, adam, train, zero, ...) to the `tierzero` command's sub-parsers."""
    bench = subparsers.add_parser("bench", help=COMMANDS["bench"].help)
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    for module in BENCH_COMMANDS:
        module.add_command(commands)
