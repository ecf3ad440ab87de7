"""One intra-op thread for a loop of short host ops (a quantized base's decode, the 8-bit moments' windows).

[Note: one core for a loop of short ops]
A loop over cache-sized chunks runs tens of torch ops a chunk, each too short to gain from a
second core: split over the cores, each one costs more in its fork and join than in its work,
and when the other core is busy (the swapper's threads, another process) every op waits for it.
So such a loop runs with one intra-op thread (`one_thread`), set back when it ends. The setting
is not the calling thread's alone: torch keeps the count process-wide as well (a thread started
meanwhile takes it), so the loops run on the thread that computes, never beside it.
Measured on the 2-core dev VM: docs/benchmarks-journal.md, session 30.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["one_thread"]


@contextmanager
def one_thread(device: torch.device) -> Iterator[None]:
    """On the host, torch computes with one intra-op thread within the block; elsewhere nothing changes."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
