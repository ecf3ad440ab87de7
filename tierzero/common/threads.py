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

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

__all__ = ["one_thread", "yield_to_others"]


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


def yield_to_others() -> bool:
    """Run the calling thread only on cores nothing else wants (Linux's SCHED_IDLE); True where the
    OS took it. For a helper thread beside the compute (the decoder, [Note: decoding ahead] in
    units/decode_ahead.py): at the same priority it takes a core from the compute's second
    intra-op thread in the middle of an op, and every op waits at its join. The compute waiting
    on the helper's result blocks, which frees a core for it."""
    policy = getattr(os, "SCHED_IDLE", None)
    if policy is None:
        return False
    try:
        os.sched_setscheduler(threading.get_native_id(), policy, os.sched_param(0))
    except OSError:
        return False
    return True
