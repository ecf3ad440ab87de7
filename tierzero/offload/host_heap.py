"""Freed host memory kept for reuse, where the C library allows it (glibc on Linux).

[Note: freed host memory]
glibc maps every block of 32 MiB or more with its own mmap and unmaps it when freed, so
each such block comes fresh from the kernel: zeroed page by page and, in a VM whose freed
pages go back to the host, faulted in there again. An offloaded step frees and allocates
unit-sized host blocks all the time (autograd's weight gradients, landing scratch, fetched
copies): on the 2B preset this was about a third of the step (docs/benchmarks-journal.md, session
8). `keep_freed_memory` makes every block come from the heap, whose freed blocks malloc
reuses, and keeps up to `top` bytes of free heap at its top instead of trimming them. It
first trims what the set-up freed. Like every malloc setting it holds for the whole
process, after the engine too.

What the heap keeps is resident beyond what the store counts: the 2B preset's peak RSS was
0.6-1.0 GiB higher than with `keep_freed: 0` (docs/benchmarks-journal.md, session 27). So the
placement planner leaves room for it (`kept_heap_limit`) when it moves units' slices into host
memory: up to `top`, and never more than the step's transient host bytes, which are what the
heap's free blocks once held.
"""

from __future__ import annotations

import ctypes
import sys

__all__ = ["keep_freed_memory", "kept_heap_limit"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2**31 - 1


def kept_heap_limit(top: int) -> int:
    """The most free heap `keep_freed_memory(top)` may keep resident on this platform: `top` on
    Linux, 0 where it changes nothing. The placement planner leaves room for it."""
    return top if top > 0 and sys.platform.startswith("linux") else 0


def keep_freed_memory(top: int) -> bool:
    """Reuse freed host memory (see the note); True where glibc took the settings, False where
    `top` is 0 or the C library is not glibc."""
    if not kept_heap_limit(top):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt, trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return False
    trim(0)
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, min(top, _INT_MAX)))
