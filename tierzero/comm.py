"""The collectives the stages use, as pure functions over torch.distributed, with byte counters.

Every function takes a `CommGroup` (rank, world size, process group and the engine's
`CommCounter`) and counts the bytes *this rank sends* under ring accounting, the
cost model of the ZeRO paper:

- all-gather of a full buffer of B bytes: each rank sends (N-1)/N * B;
- reduce-scatter of a full buffer of B bytes: each rank sends (N-1)/N * B;
- all-reduce of B bytes: a reduce-scatter plus an all-gather, 2(N-1)/N * B.

At world size 1 nothing is sent and nothing is counted; the functions then reduce to
local copies, so the stages call them unconditionally.

torch 2.13 names the flat-tensor collectives `all_gather_single` / `reduce_scatter_single`
(the older `*_into_tensor` / `*_tensor` names warn and forward to them); both work on
gloo and NCCL. Older torch has only the older names.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class Collective(enum.Enum):
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


def ring_bytes(op: Collective, *, nbytes: int, world_size: int) -> int:
    """Bytes one rank sends for `op` over a buffer of `nbytes` (the full buffer for gather/scatter)."""
    if world_size == 1:
        return 0
    factor = 2 if op is Collective.ALL_REDUCE else 1
    return factor * (world_size - 1) * nbytes // world_size


@dataclass(slots=True)
class CommCounter:
    """Bytes this rank sent per collective since the last reset."""

    sent: dict[Collective, int] = field(default_factory=lambda: dict.fromkeys(Collective, 0))
    calls: dict[Collective, int] = field(default_factory=lambda: dict.fromkeys(Collective, 0))

    def add(self, op: Collective, nbytes: int) -> None:
        self.sent[op] += nbytes
        self.calls[op] += 1

    def report(self) -> dict[str, int]:
        return {op.value: n for op, n in self.sent.items()}

    def reset(self) -> None:
        for op in Collective:
            self.sent[op] = 0
            self.calls[op] = 0


@dataclass(frozen=True, slots=True)
class CommGroup:
    """The data-parallel group the stages talk over; `group=None` means the default group."""

    rank: int
    world_size: int
    counter: CommCounter
    group: dist.ProcessGroup | None = None

    @classmethod
    def single(cls) -> CommGroup:
        return cls(rank=0, world_size=1, counter=CommCounter())

    @classmethod
    def from_default_group(cls, *, counter: CommCounter | None = None) -> CommGroup:
        if not dist.is_available() or not dist.is_initialized():
            return cls(rank=0, world_size=1, counter=counter or CommCounter())
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), counter=counter or CommCounter())


_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _count(comm: CommGroup, op: Collective, full: torch.Tensor) -> None:
    """Count `op` over `full` (the whole buffer: gather output, scatter input, all-reduce tensor)."""
    nbytes = full.numel() * full.element_size()
    comm.counter.add(op, ring_bytes(op, nbytes=nbytes, world_size=comm.world_size))


@dataclass(frozen=True, slots=True)
class Pending:
    """A collective in flight; `wait()` returns once its output is ready (at once when done locally)."""

    work: dist.Work | None = None

    def wait(self) -> None:
        if self.work is not None:
            self.work.wait()


def all_gather(output: torch.Tensor, shard: torch.Tensor, *, comm: CommGroup, async_op: bool = False) -> Pending:
    """Fill `output` (N x shard numel) with every rank's `shard`, rank order.

    With `async_op` the call returns at once; leave both tensors alone until `wait()`.
    """
    if output.numel() != shard.numel() * comm.world_size:
        raise ValueError(
            f"all_gather output holds {output.numel()} elements, expected "
            f"{comm.world_size} x {shard.numel()}: size the output as world_size x shard"
        )
    if comm.world_size == 1:
        output.copy_(shard)
        return Pending()
    work = _all_gather_flat(output, shard, group=comm.group, async_op=async_op)
    _count(comm, Collective.ALL_GATHER, output)
    return Pending(work if async_op else None)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, *, comm: CommGroup, async_op: bool = False) -> Pending:
    """Sum `full` over ranks and leave this rank's contiguous 1/N of the sum in `output`.

    With `async_op` the call returns at once; `output` and `full` must stay untouched
    until the returned handle's `wait()`.
    """
    if full.numel() != output.numel() * comm.world_size:
        raise ValueError(
            f"reduce_scatter input holds {full.numel()} elements, expected "
            f"{comm.world_size} x {output.numel()}: pad the input to a multiple of world_size"
        )
    if comm.world_size == 1:
        output.copy_(full)
        return Pending()
    work = _reduce_scatter_flat(output, full, op=dist.ReduceOp.SUM, group=comm.group, async_op=async_op)
    _count(comm, Collective.REDUCE_SCATTER, full)
    return Pending(work if async_op else None)


def all_reduce(tensor: torch.Tensor, *, comm: CommGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """Reduce `tensor` in place over all ranks (sum by default)."""
    if comm.world_size == 1:
        return
    dist.all_reduce(tensor, op=op, group=comm.group)
    _count(comm, Collective.ALL_REDUCE, tensor)
