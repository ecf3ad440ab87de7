"""What the planner is doing while it measures: a minute spent timing the disk and a block is not silent.

The planner's modules log at INFO under `tierzero.placement` as each measurement starts and
ends and as the replays run. Nothing shows them unless a handler does: `tierzero train` and
`tierzero estimate` attach one while the plan is made (`said_to`), and a library caller turns
them on as for any library that uses `logging`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

__all__ = ["LOGGER", "said_to"]

#: The logger the planner's modules log under (each its own child of it).
LOGGER = "tierzero.placement"


@contextmanager
def said_to(out: TextIO) -> Iterator[None]:
    """The planner's lines written to `out` as they come, for the duration."""
    logger = logging.getLogger(LOGGER)
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("planning: %(message)s"))
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
