"""What the planner is doing while it measures: a minute spent timing the disk and a block is not silent.

The planner's modules log at INFO under `tierzero.placement` as each measurement starts and
ends and as the replays run. Nothing shows them unless a handler does: `tierzero train` and
`tierzero estimate` attach one while the plan is made (`said_to`), and a library caller turns
them on as for any library that uses `logging`.

On a terminal the replays, minutes of them for a 7B model, show as a tqdm bar instead of a
line each (replays done of the candidates planned, and the time so far); the other lines are
written above it. Anywhere else (a log file, a pipe, the tests) each replay keeps its line.
The planner marks its records for the bar with `extra`: `PLANNED` the whole-kind candidates
it starts with, `REPLAYS` the replays done so far, `REPLAYED` all of them once it is done
(splits are added as it goes, so the total grows to that).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TextIO

from tqdm import tqdm

__all__ = ["LOGGER", "PLANNED", "REPLAYED", "REPLAYS", "said_to"]

#: The logger the planner's modules log under (each its own child of it).
LOGGER = "tierzero.placement"
PLANNED, REPLAYS, REPLAYED = "planned_candidates", "replays_done", "replays_total"
"""The `extra` keys of the planner's records that drive the bar."""
_FORMAT = "planning: %(message)s"


class _Bar(logging.Handler):
    """The replays as a bar on `out`; any other record as a line above it."""

    def __init__(self, out: TextIO) -> None:
        super().__init__()
        self.out = out
        self.bar: tqdm | None = None
        self.setFormatter(logging.Formatter(_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        planned, done, total = (getattr(record, key, None) for key in (PLANNED, REPLAYS, REPLAYED))
        if planned is not None and self.bar is None:
            self.bar = tqdm(total=planned, desc="planning", unit="replay", file=self.out, dynamic_ncols=True)
            return
        if self.bar is not None and (done is not None or total is not None):
            self._advance(done if total is None else total, final=total is not None)
            if done is not None:
                return
        tqdm.write(self.format(record), file=self.out)

    def _advance(self, replays: int, *, final: bool) -> None:
        assert self.bar is not None
        if final or replays > self.bar.total:  # a split past the planned candidates, or the last count
            self.bar.total = replays
        self.bar.update(replays - self.bar.n)
        if final:
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        super().close()


def _is_terminal(out: Any) -> bool:
    isatty = getattr(out, "isatty", None)
    return bool(isatty and isatty())


@contextmanager
def said_to(out: TextIO) -> Iterator[None]:
    """The planner's lines written to `out` as they come, for the duration; the replays as a bar where `out` is a terminal."""
    logger = logging.getLogger(LOGGER)
    handler: logging.Handler
    if _is_terminal(out):
        handler = _Bar(out)
    else:
        handler = logging.StreamHandler(out)
        handler.setFormatter(logging.Formatter(_FORMAT))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        handler.close()
        logger.setLevel(level)
