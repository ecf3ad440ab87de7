"""Every rank agrees on each step of a save or load: one rank's failure is raised on all of them.

Without this, a rank whose disk filled would raise while the others wait forever in the
next collective. The values exchanged are small Python objects (paths, file records,
error messages) between live ranks of one job: pickled in memory, never on disk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch

from tierzero.comm.collectives import CommGroup

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RankFailure:
    """What failed on one rank: its message, and its errno when it was an OSError (to say what to do)."""

    rank: int
    message: str
    errno: int | None = None

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.message}"


def on_every_rank(comm: CommGroup, fn: Callable[[], T], *, fail: Callable[[RankFailure], Exception]) -> T:
    """Run `fn` on this rank; if it failed on any rank, raise `fail(first failure)` on every rank."""
    value, local, error = None, None, None
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
        code = exc.errno if isinstance(exc, OSError) else None
        local, error = exc, RankFailure(rank=comm.rank, message=str(exc), errno=code)
    failed = [e for e in all_gather_objects(comm, error) if e is not None]
    if failed:
        raise fail(failed[0]) from local
    return cast(T, value)  # None only where fn() raised, which raised above


def all_gather_objects(comm: CommGroup, value: Any) -> list[Any]:
    """Every rank's `value`, in rank order."""
    if comm.world_size == 1:
        return [value]
    out: list[Any] = [None] * comm.world_size
    torch.distributed.all_gather_object(out, value, group=comm.group)
    return out


def from_rank0(comm: CommGroup, value: T) -> T:
    """Rank 0's `value` on every rank."""
    if comm.world_size == 1:
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=comm.global_rank(0), group=comm.group)
    return box[0]
