"""Benches that run several gloo ranks fork them on this machine: forking keeps start-up to a
fraction of a second, where spawning re-imports torch in each."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["forked_ranks"]


def forked_ranks(
    fn: Callable[[int, Any], Any], arg: Any, *, world_size: int, what: str, threads: int | None = None
) -> Any:
    """Rank 0's `fn(rank, arg)` from `world_size` forked gloo ranks (`threads` torch threads each,
    where given); raises with a failed rank's error, named after `what`."""
    ctx = mp.get_context("fork")
    queue = ctx.SimpleQueue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [(rank, port, world_size, fn, arg, threads, queue) for rank in range(world_size)]
    procs = [ctx.Process(target=_entry, args=a) for a in args]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in procs:
            rank, value, error = queue.get()
            if error is not None:
                raise RuntimeError(f"{what} rank {rank} failed: {error}")
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results[0]


def _entry(
    rank: int, port: int, world_size: int, fn: Callable[[int, Any], Any], arg: Any, threads: int | None, queue: Any
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name, None)
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        queue.put((rank, fn(rank, arg), None))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
        queue.put((rank, None, f"{type(exc).__name__}: {exc}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
