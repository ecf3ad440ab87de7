"""The `tierzero` command: `train`, `demo`, `estimate`, `generate`, `consolidate`, `make-checkpoint`, `config`, `bench` and `clean`.

User errors (a bad config, a full disk) print one line to stderr and exit 2,
without a traceback; anything else is a bug and keeps its traceback. Config warnings
(`TierZeroConfigWarning`) print as one `tierzero: warning: ...` line each.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from typing import Any

from tierzero import __version__
from tierzero.cli.bench import add_bench_commands
from tierzero.cli.clean import add_clean_command
from tierzero.cli.config import add_config_commands
from tierzero.cli.consolidate import add_consolidate_command
from tierzero.cli.estimate import add_estimate_command
from tierzero.cli.generate import add_generate_command
from tierzero.cli.make_checkpoint import add_make_checkpoint_command
from tierzero.cli.train import add_demo_command, add_train_command
from tierzero.config.errors import TierZeroConfigWarning
from tierzero.offload.base import TierCapacityError


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierzero", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tierzero {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_bench_commands(commands)
    add_config_commands(commands)
    add_train_command(commands)
    add_demo_command(commands)
    add_estimate_command(commands)
    add_generate_command(commands)
    add_consolidate_command(commands)
    add_make_checkpoint_command(commands)
    add_clean_command(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    args.process_ends = argv is None  # the command line, not a caller: see train's `process_ends`
    # Config warnings (an ignored DeepSpeed key, bf16 on a CPU without it) are for the user, not
    # a traceback: one line each, as the errors are, never Python's file:line format.
    with warnings.catch_warnings():
        shown = warnings.showwarning
        warnings.simplefilter("always", TierZeroConfigWarning)
        warnings.showwarning = functools.partial(_show_warning, fallback=shown)
        try:
            return int(args.func(args) or 0)
        except (ValueError, TierCapacityError, OSError) as exc:
            print(f"tierzero: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("tierzero: interrupted", file=sys.stderr)
            return 130


def _show_warning(message: Warning | str, category: type[Warning], *args: Any, fallback: Any, **kwargs: Any) -> None:
    if issubclass(category, TierZeroConfigWarning):
        print(f"tierzero: warning: {message}", file=sys.stderr, flush=True)
    else:
        fallback(message, category, *args, **kwargs)

