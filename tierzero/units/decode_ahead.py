"""A quantized unit's decode started as soon as its codes are fetched, on a thread of its own.

[Note: decoding ahead]
On the host, with the native kernels, stage 3 at one rank starts a fetched unit's decode at once on
the decoder's thread, while the compute thread runs the unit before it: the kernels take no lock and
no torch thread count, and ctypes lets go of the GIL for them. Where it used to decode
(`Stage.decode_gathered`), the stage finishes it: the compute thread decodes the chunks still left
beside the decoder's thread, then waits for the chunk that thread is on ([Note: a shared decode] in
native/dequant.cpp). Only the native path goes there: the torch path's ops would share the compute's
intra-op threads. A piece the kernels leave to the torch path (a corrupt scale) is decoded again,
all of it, on the compute thread, which raises the torch path's error.

The thread runs only on cores the compute leaves idle (`yield_to_others`, common/threads.py): at the
same priority it took the core of the compute's second intra-op thread in the middle of ops.

On the 2-core dev VM the compute thread was the step's critical path, the other core idle for over
half of it. A 2B LoRA step (NF4 base on NVMe, 64 tokens, gather_ahead 2) took a median 4.39 s decoded
ahead on an idle-priority thread against 5.13 s at normal priority, beside 10.7 s for a bf16 base; in
an earlier run, 5.84 s decoded ahead (normal priority) against 6.38 s on the compute thread. With
gather_ahead 1 the compute still waited 0.39 s a step for decodes, on one core; finishing them itself
cut that to 0.19-0.22 s and the step from 2.69-2.80 s to 2.34-2.45 s (docs/benchmarks-journal.md,
sessions 32 and 33).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from tierzero.common.threads import yield_to_others
from tierzero.native.dequant import SharedDecode
from tierzero.units.quantized_base import BaseCodec

__all__ = ["DecodeAhead"]


class DecodeAhead:
    """The decoder's thread, started on first need ([Note: decoding ahead])."""

    __slots__ = ("_pool",)

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None

    def start(self, codec: BaseCodec, codes: torch.Tensor, *, into: torch.Tensor, pieces: int, what: str) -> SharedDecode | None:
        """`codec.share_natively` of `codes` into `into`, started on the decoder's thread, which the
        caller finishes (`SharedDecode.finish`); None where the native kernels do not take it (the
        caller decodes it when needed)."""
        shared = codec.share_natively(codes, out=into, pieces=pieces, what=what)
        if shared is None:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierzero-decode", initializer=yield_to_others)
        self._pool.submit(shared.help)
        return shared

    def close(self, started: Iterable[SharedDecode | None]) -> None:
        """Finish the decodes `started` (their buffers are freed next), then stop the thread."""
        for shared in started:
            if shared is not None:
                shared.finish()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
