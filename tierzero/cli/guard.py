"""How a command's outcome reaches the user: a user error as one line and exit 2, Ctrl-C as one
line and exit 130, a config warning as one `tierzero: warning: ...` line; a bug keeps its traceback.

Imported by cli/main.py once a command is chosen: the error classes it names come with torch.
"""

from __future__ import annotations

import argparse
import functools
import sys
import warnings
from typing import Any

from tierzero.config.errors import TierZeroConfigWarning
from tierzero.offload.base import TierCapacityError


def run(args: argparse.Namespace) -> int:
    """`args.func(args)`'s exit status, its errors and warnings said in one line each."""
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
