"""`tierzero bench`: measure the NVMe tier against fio (`nvme`) and stress the swapper (`swap`).

The tiers, the store and matplotlib are imported only when a subcommand runs.
"""

from __future__ import annotations

import argparse
from typing import Any


def _run_nvme(args: argparse.Namespace) -> int:
    from tierzero.bench.nvme import command

    return command(args)


def _run_swap(args: argparse.Namespace) -> int:
    from tierzero.bench.swap import command

    return command(args)


def add_bench_commands(subparsers: Any) -> None:
    """Adds `bench nvme` and `bench swap` to the `tierzero` command's sub-parsers."""
    from tierzero.bench.nvme import add_arguments as add_nvme_arguments
    from tierzero.bench.swap import add_arguments as add_swap_arguments

    bench = subparsers.add_parser("bench", help="measure the NVMe tier and stress the swapper")
    commands = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    nvme = commands.add_parser(
        "nvme", help="sweep NVMe tier settings against fio; print the best as config",
        description="Sweep block size x queue depth x threads x backend through the NVMe tier, beside fio.",
    )
    add_nvme_arguments(nvme)
    nvme.set_defaults(func=_run_nvme)
    swap = commands.add_parser(
        "swap", help="stress the store and swapper with random concurrent transfers, verifying every byte",
        description="Concurrent fetches, write-backs and releases of random slices across device, cpu and nvme.",
    )
    add_swap_arguments(swap)
    swap.set_defaults(func=_run_swap)
