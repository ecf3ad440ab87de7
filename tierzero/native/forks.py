"""Whether this process is a fork()ed child of one that imported tierzero: its native kernels then start
threads of their own (native/build.py's note). The package imports this module, so the hook is in place
before any fork a program makes after `import tierzero`, whether or not its kernels were loaded yet."""

from __future__ import annotations

import os
from collections.abc import Callable

__all__ = ["forked", "on_fork"]

_child = False
_callbacks: list[Callable[[], None]] = []


def forked() -> bool:
    """Whether this process was fork()ed after tierzero's import."""
    return _child


def on_fork(callback: Callable[[], None]) -> None:
    """Call `callback` in each fork()ed child, right after the fork."""
    _callbacks.append(callback)


def _after_fork_in_child() -> None:
    global _child
    _child = True
    for callback in _callbacks:
        callback()


os.register_at_fork(after_in_child=_after_fork_in_child)
