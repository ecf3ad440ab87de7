"""The `tierzero` script's entry point: Ctrl-C while the command is still loading is one line, never a traceback.

Python turns SIGINT into KeyboardInterrupt wherever the main thread happens to be, and during
the first tens of milliseconds that is inside an import (argparse, the command table, the
command's module), where no `except` of ours encloses it: Python then prints the traceback of
the import machinery and dies. So `run` hands SIGINT to `quit_quietly` before importing
anything of weight, and `main` gives it back to Python's KeyboardInterrupt once the command
line is parsed: from there the commands handle Ctrl-C themselves (cli/guard.py, cli/stops.py).

Still uncovered: the interpreter's own start (site, the script's first line), before any code
of tierzero runs; this module and the two package `__init__`s above it import nothing heavy,
to keep that window as short as Python allows.
"""

from __future__ import annotations

import importlib
import signal
import sys
from types import FrameType

__all__ = ["quit_quietly", "run"]


def quit_quietly(signum: int, frame: FrameType | None) -> None:
    """SIGINT before the command runs: nothing started, so nothing to clean up but the message."""
    sys.stderr.write("tierzero: interrupted\n")
    raise SystemExit(130)


def run() -> int:
    """`tierzero ...`: cli/main.py's `main`, with Ctrl-C ending the loading quietly.

    Only Python's own handler is replaced: a SIGINT ignored (a background job) or one a caller
    installed stays as it is.
    """
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, quit_quietly)
    return importlib.import_module("tierzero.cli.main").main()
