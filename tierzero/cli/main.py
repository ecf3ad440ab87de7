"""The `tierzero` command: `train`, `demo`, `estimate`, `generate`, `consolidate`, `make-checkpoint`, `config`, `bench` and `clean`.

Only the command asked for is imported (cli/commands.py lists them all without importing
any), so `tierzero --help` answers in a fraction of a second, and the seconds of torch's
import are spent by the commands that use it. User errors (a bad config, a full disk) print
one line to stderr and exit 2, without a traceback; anything else is a bug and keeps its
traceback (cli/guard.py). Ctrl-C, even during the imports, prints one line and exits 130.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys

from tierzero import __version__
from tierzero.cli.commands import COMMANDS
from tierzero.cli.launch import quit_quietly


def _build_parser(wanted: str | None) -> argparse.ArgumentParser:
    """Every command listed by its help; only `wanted`'s module imported, to add its arguments."""
    parser = argparse.ArgumentParser(prog="tierzero", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"tierzero {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, command in COMMANDS.items():
        if name == wanted:
            getattr(importlib.import_module(command.module), command.adder)(commands)
        else:
            commands.add_parser(name, help=command.help)
    return parser


def _wanted(argv: list[str]) -> str | None:
    """The command named on the line: the first word that is not an option (the top level's take no value)."""
    return next((word for word in argv if not word.startswith("-")), None)


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    try:
        args = _build_parser(_wanted(words)).parse_args(words)  # --help and --version end here
        guard = importlib.import_module("tierzero.cli.guard")
    except KeyboardInterrupt:
        print("tierzero: interrupted", file=sys.stderr)
        return 130
    if signal.getsignal(signal.SIGINT) is quit_quietly:  # loaded: the command handles Ctrl-C from here
        signal.signal(signal.SIGINT, signal.default_int_handler)
    args.process_ends = argv is None  # the command line, not a caller: see train's `process_ends`
    return guard.run(args)
