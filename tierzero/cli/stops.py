"""What stops a training run from outside, said in one line: Ctrl-C (`CtrlC`), and a rank of the
job that died or hung (`lost_rank`, which asks the others in a roll call who is still there)."""

from __future__ import annotations

import signal
import threading
from typing import Any

import torch

from tierzero.comm.dist import launch_tag, roll_call_s, unanswered_ranks


class CtrlC:
    """Ctrl-C during a run: the first one raises KeyboardInterrupt, later ones are only counted.

    A KeyboardInterrupt raised inside a finalizer or a callback that swallows errors is lost,
    so the loop also checks the count after each step. A second one (pressed again while the
    run winds down) would break the clean-up itself, leaving swap files and the checkpoint
    lock behind, with tracebacks. Once `closing` (set by the run's close) even the first only counts.
    It does nothing outside the main thread, or where SIGINT is ignored (a background job).

    On the way out the caller's handler comes back, unless `ignore_after` and Ctrl-C was
    pressed: then the process is about to exit, the user may still be pressing, and a
    KeyboardInterrupt raised while Python shuts down (joining threads, running finalizers)
    prints a traceback after the run's last line; so SIGINT is ignored from then on, set in
    one call in place of the counting handler, leaving no moment for a press to land between.
    """

    def __init__(self, *, ignore_after: bool = False) -> None:
        self.count = 0
        self.closing = False
        self.ignore_after = ignore_after
        self._previous: Any = None

    def __enter__(self) -> CtrlC:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, signal.SIG_IGN if self.count and self.ignore_after else self._previous)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.count += 1
        if self.count == 1 and not self.closing:
            raise KeyboardInterrupt

    def check(self) -> None:
        if self.count:
            raise KeyboardInterrupt


def lost_rank(exc: BaseException, *, rank: int, world: int, step: int, timeout_s: float) -> ConnectionError | None:
    """A one-line error for a collective that failed because a peer died (its sockets closed) or hung (timeout).

    The roll call waits its share of `dist.timeout` (`timeout_s`), so that a hung rank stops the job within it.

    A ConnectionError is an OSError, which the command prints as one line and exits 2.
    """
    if world == 1 or not isinstance(exc, RuntimeError):
        return None
    text = str(exc).strip()
    if not (isinstance(exc, torch.distributed.DistError) or "gloo" in text or "NCCL" in text):
        return None
    cause = text.splitlines()[0] if text else type(exc).__name__
    gone = unanswered_ranks(rank=rank, world_size=world, tag=launch_tag(), wait_s=roll_call_s(timeout_s))
    who, those = "another rank", "that rank"  # no store to ask, or every rank answered: the cause says more
    if gone:
        who = f"rank {gone[0]}" if len(gone) == 1 else f"ranks {', '.join(map(str, gone))}"
        those = "that rank" if len(gone) == 1 else "those ranks"
    return ConnectionError(
        f"rank {rank} of {world} lost contact with {who} in step {step} ({cause}): {those} died or hung, "
        "so the job stops; relaunch it with --resume to continue from the last checkpoint"
    )
