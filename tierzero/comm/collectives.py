"""The collectives the stages use, as pure functions over torch.distributed, with byte counters.

Every function takes a `CommGroup` (rank, world size, process group and the engine's
`CommCounter`) and counts the bytes *this rank sends* under ring accounting, the
cost model of the ZeRO paper:

- all-gather of a full buffer of B bytes: each rank sends (N-1)/N * B;
- reduce-scatter of a full buffer of B bytes: each rank sends (N-1)/N * B;
- all-reduce of B bytes: a reduce-scatter plus an all-gather, 2(N-1)/N * B.

At world size 1 nothing is sent and nothing is counted; the functions then reduce to
local copies, so the stages call them unconditionally.

[Note: bytes inside and across nodes]
Each count is also split by where its bytes go: to peers on this rank's node (`intra`)
or on other nodes (`inter`), under the direct exchange below, where a rank sends its
1/N piece of the buffer to each of the N-1 other members. With p of them on other nodes,
an all-gather or reduce-scatter of B bytes sends p * B/N across nodes and the rest,
(N-1-p) * B/N, inside the node; an all-reduce counts as a reduce-scatter plus an
all-gather, 2p * B/N (rounded down like the ring total) across nodes. On gloo this is
exactly what goes on the wire; NCCL's own algorithms move the same total and split it
their own way, so there the split is the model, not a measurement. A group knows its
members' global ranks (`members`) and the ranks per node (`local_world_size`, torchrun's
contiguous numbering: global rank g is on node g // local_world_size).

[Note: direct exchange on gloo]
gloo's own flat all-gather and reduce-scatter cost 1.5-4x what a plain exchange of the
same bytes costs on this kind of machine (its reduce-scatter runs about as long as an
all-reduce of the whole buffer). On gloo, each rank therefore posts one send of the
right piece to every peer and one receive from every peer, all at once, and finishes
locally: an all-gather receives straight into its output, a reduce-scatter receives
the N-1 peer pieces of its own range into one (N-1)/N-sized buffer and sums them in
rank order (deterministic, the same order on every run). A rank sends exactly
(N-1)/N of the buffer either way, which is what the ring counts. Each collective gets
its own tag from a sequence that advances identically on every rank, so pieces of
collectives in flight together never match the wrong receive. NCCL keeps its own
collectives, which are already at the link's speed.

torch 2.13 names the flat-tensor collectives `all_gather_single` / `reduce_scatter_single`
(the older `*_into_tensor` / `*_tensor` names warn and forward to them); both work on
gloo and NCCL. Older torch has only the older names.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Sequence
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
    inter: dict[Collective, int] = field(default_factory=lambda: dict.fromkeys(Collective, 0))
    """The part of `sent` that went to other nodes (see [Note: bytes inside and across nodes])."""
    calls: dict[Collective, int] = field(default_factory=lambda: dict.fromkeys(Collective, 0))
    sequence: int = 0
    """Collectives issued over the group's life (never reset): the direct exchange's tags."""

    def add(self, op: Collective, nbytes: int, *, inter: int = 0) -> None:
        """Count `nbytes` sent by one call of `op`, `inter` of them to other nodes."""
        if not 0 <= inter <= nbytes:
            raise ValueError(f"{inter} bytes across nodes out of {nbytes} sent: expected 0 <= inter <= sent")
        self.sent[op] += nbytes
        self.inter[op] += inter
        self.calls[op] += 1

    def next_tag(self) -> int:
        self.sequence += 1
        return self.sequence % _TAG_SPACE

    def report(self) -> dict[str, int]:
        return {op.value: n for op, n in self.sent.items()}

    def links(self) -> dict[str, dict[str, int]]:
        """Per collective, the bytes sent inside this rank's node and across nodes."""
        return {op.value: {"intra": n - self.inter[op], "inter": self.inter[op]} for op, n in self.sent.items()}

    def reset(self) -> None:
        for op in Collective:
            self.sent[op] = 0
            self.inter[op] = 0
            self.calls[op] = 0


@dataclass(frozen=True, slots=True)
class CommGroup:
    """The data-parallel group the stages talk over; `group=None` means the default group."""

    rank: int
    world_size: int
    counter: CommCounter
    group: dist.ProcessGroup | None = None
    dry_run: bool = False
    """Count every collective's bytes and move none: `tierzero estimate` runs the engine at a
    world size it does not have, over tensors that hold no values (the meta device)."""
    name: str = "world"
    """What `engine.comm_report(per_group=True)` calls the group."""
    members: tuple[int, ...] = ()
    """Global ranks of the group's members, in group-rank order; empty: 0 .. world_size - 1."""
    local_world_size: int = 0
    """Ranks per node in the job, numbered contiguously by node; 0: every rank on one node."""

    def global_rank(self, rank: int) -> int:
        return self.members[rank] if self.members else rank

    def node_of(self, rank: int) -> int:
        """The node of the member with group rank `rank`."""
        return self.global_rank(rank) // self.local_world_size if self.local_world_size else 0

    def peers_across_nodes(self) -> int:
        """Members on another node than this rank's (see [Note: bytes inside and across nodes])."""
        node = self.node_of(self.rank)
        return sum(self.node_of(r) != node for r in range(self.world_size))

    @classmethod
    def single(cls) -> CommGroup:
        return cls(rank=0, world_size=1, counter=CommCounter())

    @classmethod
    def from_default_group(cls, *, counter: CommCounter | None = None) -> CommGroup:
        if not dist.is_available() or not dist.is_initialized():
            return cls(rank=0, world_size=1, counter=counter or CommCounter())
        return cls(rank=dist.get_rank(), world_size=dist.get_world_size(), counter=counter or CommCounter())


#: Direct-exchange tags wrap around here; far more collectives than are ever in flight at once.
_TAG_SPACE = 1 << 20

_all_gather_flat = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def count(comm: CommGroup, op: Collective, full: torch.Tensor) -> None:
    """Count `op` over `full` (the whole buffer: gather output, scatter input, all-reduce tensor)."""
    nbytes = full.numel() * full.element_size()
    factor = 2 if op is Collective.ALL_REDUCE else 1
    inter = factor * comm.peers_across_nodes() * nbytes // comm.world_size
    comm.counter.add(op, ring_bytes(op, nbytes=nbytes, world_size=comm.world_size), inter=inter)


def count_sent(comm: CommGroup, op: Collective, sends: Sequence[tuple[int, int]]) -> None:
    """Count one call of `op` that sends each (bytes, group rank of the peer) of `sends`: for
    collectives whose sends are not the same piece to every peer (a chain, a broadcast)."""
    node = comm.node_of(comm.rank)
    inter = sum(nbytes for nbytes, peer in sends if comm.node_of(peer) != node)
    comm.counter.add(op, sum(nbytes for nbytes, _ in sends), inter=inter)


@dataclass(slots=True)
class Pending:
    """A collective in flight; `wait()` returns once its output is ready (at once when done locally).

    `wait()` is idempotent: several units reduced or gathered in one exchange share one handle.
    """

    works: tuple[dist.Work, ...] = ()
    finish: Callable[[], None] | None = None
    """The local part that needs every piece (a direct reduce-scatter's sum); run by `wait()`."""
    keep: tuple[torch.Tensor, ...] = ()
    """Packed send buffers the exchange reads until it is done."""

    def wait(self) -> None:
        for work in self.works:
            work.wait()
        finish = self.finish
        self.works, self.finish, self.keep = (), None, ()
        if finish is not None:
            finish()


def is_direct(comm: CommGroup) -> bool:
    """Whether this group exchanges pieces directly (gloo) instead of calling the backend's collective."""
    return dist.get_backend(comm.group) == dist.Backend.GLOO


def _peers(comm: CommGroup) -> list[tuple[int, int]]:
    """(group rank, global rank) of every other rank, in group-rank order."""
    out = []
    for r in range(comm.world_size):
        if r != comm.rank:
            out.append((r, r if comm.group is None else dist.get_global_rank(comm.group, r)))
    return out


def exchange(
    sends: list[tuple[torch.Tensor, int]],
    recvs: list[tuple[torch.Tensor, int]],
    *,
    comm: CommGroup,
    tag: int | None = None,
) -> list[dist.Work]:
    """Post every send and receive of one collective under one tag (default: the group's next), to and
    from global ranks: see [Note: direct exchange on gloo]."""
    tag = comm.counter.next_tag() if tag is None else tag
    works = [dist.irecv(buf, src=peer, group=comm.group, tag=tag) for buf, peer in recvs]
    works += [dist.isend(buf, dst=peer, group=comm.group, tag=tag) for buf, peer in sends]
    return [w for w in works if w is not None]


def all_gather(output: torch.Tensor, shard: torch.Tensor, *, comm: CommGroup, async_op: bool = False) -> Pending:
    """Fill `output` (N x shard numel) with every rank's `shard`, rank order.

    With `async_op` the call returns at once; leave both tensors alone until `wait()`.
    """
    return all_gather_many([output], [shard], comm=comm, async_op=async_op)


def all_gather_many(
    outputs: Sequence[torch.Tensor], shards: Sequence[torch.Tensor], *, comm: CommGroup, async_op: bool = False
) -> Pending:
    """`all_gather` of each (output, shard) pair, as one exchange per peer and dtype on gloo.

    Several small buffers cost one message's latency instead of one each; the shards
    are packed into one send and the received pieces unpacked on `wait()`.
    """
    for output, shard in zip(outputs, shards, strict=True):
        if output.numel() != shard.numel() * comm.world_size:
            raise ValueError(
                f"all_gather output holds {output.numel()} elements, expected "
                f"{comm.world_size} x {shard.numel()}: size the output as world_size x shard"
            )
    if len(groups := _dtype_groups(shards)) > 1:
        return _joined(
            all_gather_many([outputs[i] for i in g], [shards[i] for i in g], comm=comm, async_op=async_op)
            for g in groups
        )
    if _done_locally(comm, Collective.ALL_GATHER, outputs, shards, counted=outputs):
        return Pending()
    if not is_direct(comm):
        works = [_all_gather_flat(o, s, group=comm.group, async_op=async_op) for o, s in zip(outputs, shards)]
        return Pending(tuple(works) if async_op else ())
    pieces = [output.view(comm.world_size, -1) for output in outputs]
    for piece, shard in zip(pieces, shards):
        piece[comm.rank].copy_(shard)
    peers = _peers(comm)
    if len(outputs) == 1:
        works = exchange([(shards[0], g) for _, g in peers], [(pieces[0][r], g) for r, g in peers], comm=comm)
        return settle(Pending(tuple(works)), async_op=async_op)
    sizes = [shard.numel() for shard in shards]
    packed = torch.cat([shard.reshape(-1) for shard in shards])
    received = packed.new_empty((len(peers), packed.numel()))
    works = exchange([(packed, g) for _, g in peers], list(zip(received, (g for _, g in peers))), comm=comm)

    def finish() -> None:
        for (r, _), row in zip(peers, received):
            for piece, part in zip(pieces, row.split(sizes)):
                piece[r].copy_(part)

    return settle(Pending(tuple(works), finish, keep=(packed,)), async_op=async_op)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, *, comm: CommGroup, async_op: bool = False) -> Pending:
    """Sum `full` over ranks and leave this rank's contiguous 1/N of the sum in `output`.

    With `async_op` the call returns at once; `output` and `full` must stay untouched
    until the returned handle's `wait()`. On gloo the pieces from peers land in a
    buffer of (N-1)/N of `full`'s size, held until `wait()`.
    """
    return reduce_scatter_many([output], [full], comm=comm, async_op=async_op)


def reduce_scatter_many(
    outputs: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor], *, comm: CommGroup, async_op: bool = False
) -> Pending:
    """`reduce_scatter` of each (output, full) pair, as one exchange per peer and dtype on gloo."""
    check_scatter(outputs, fulls, comm=comm)
    if len(groups := _dtype_groups(fulls)) > 1:
        return _joined(
            reduce_scatter_many([outputs[i] for i in g], [fulls[i] for i in g], comm=comm, async_op=async_op)
            for g in groups
        )
    if _done_locally(comm, Collective.REDUCE_SCATTER, outputs, fulls, counted=fulls):
        return Pending()
    if not is_direct(comm):
        sum_ = dist.ReduceOp.SUM
        works = [_reduce_scatter_flat(o, f, op=sum_, group=comm.group, async_op=async_op) for o, f in zip(outputs, fulls)]
        return Pending(tuple(works) if async_op else ())
    scattered = post_scatter(outputs, fulls, comm=comm)

    def finish() -> None:
        for i, output in enumerate(outputs):
            add_in_order(scattered.terms(i), out=output)

    return settle(Pending(scattered.works, finish, keep=scattered.sends), async_op=async_op)


def _dtype_groups(tensors: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices of `tensors` by dtype, dtypes in first-seen order (the same on every rank): one
    packed exchange moves one dtype (units of `precision.autocast` mix bf16 and fp32)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    return list(groups.values())


def _joined(parts: Iterable[Pending]) -> Pending:
    """One handle over several collectives started already."""
    started = list(parts)

    def finish() -> None:
        for pending in started:
            pending.wait()

    return Pending(finish=finish)


def check_scatter(outputs: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor], *, comm: CommGroup) -> None:
    """Raise unless each full buffer holds world_size x its output's elements."""
    for output, full in zip(outputs, fulls, strict=True):
        if full.numel() != output.numel() * comm.world_size:
            raise ValueError(
                f"reduce_scatter input holds {full.numel()} elements, expected "
                f"{comm.world_size} x {output.numel()}: pad the input to a multiple of world_size"
            )


@dataclass(frozen=True, slots=True)
class Scattered:
    """A direct reduce-scatter in flight: every rank's piece of this rank's range of each buffer, unsummed."""

    works: tuple[dist.Work, ...]
    received: torch.Tensor
    """One row per peer, in rank order; a row holds the peer's pieces of every buffer, end to end."""
    own: tuple[torch.Tensor, ...]
    """This rank's own piece of each buffer."""
    sends: tuple[torch.Tensor, ...]
    """Packed send buffers the exchange reads until it is done."""
    rank: int
    sizes: tuple[int, ...]

    def terms(self, i: int) -> list[torch.Tensor]:
        """Buffer i's pieces in rank order (peer row j holds rank j below this rank, j + 1 from it on)."""
        rows = [row.split(self.sizes)[i] for row in self.received]
        return [*rows[: self.rank], self.own[i], *rows[self.rank :]]


def post_scatter(outputs: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor], *, comm: CommGroup) -> Scattered:
    """Post a direct reduce-scatter's sends and receives (see [Note: direct exchange on gloo])."""
    pieces = [full.view(comm.world_size, -1) for full in fulls]
    peers = _peers(comm)
    if len(fulls) == 1:
        sends = [(pieces[0][r], g) for r, g in peers]
    else:
        sends = [(torch.cat([piece[r] for piece in pieces]), g) for r, g in peers]
    sizes = tuple(output.numel() for output in outputs)
    received = outputs[0].new_empty((len(peers), sum(sizes)))
    works = exchange(sends, list(zip(received, (g for _, g in peers))), comm=comm)
    own = tuple(piece[comm.rank] for piece in pieces)
    return Scattered(tuple(works), received, own, tuple(t for t, _ in sends), comm.rank, sizes)


def add_in_order(terms: Sequence[torch.Tensor], *, out: torch.Tensor) -> torch.Tensor:
    """`out` = ((terms[0] + terms[1]) + terms[2]) + ...: one order, the same bits on every run."""
    if len(terms) == 1:
        return out.copy_(terms[0])
    torch.add(terms[0], terms[1], out=out)
    for term in terms[2:]:
        out.add_(term)
    return out


def _done_locally(
    comm: CommGroup,
    op: Collective,
    outputs: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    *,
    counted: Sequence[torch.Tensor],
) -> bool:
    """Whether the collective needs no exchange: at world size 1 each source is its output
    (copied), and a dry run only counts the bytes of `counted`."""
    if comm.world_size == 1:
        for output, source in zip(outputs, sources):
            output.copy_(source)
        return True
    for full in counted:
        count(comm, op, full)
    return comm.dry_run


def settle(pending: Pending, *, async_op: bool) -> Pending:
    """A synchronous call returns with its output ready, like the backend's own collectives."""
    if async_op:
        return pending
    pending.wait()
    return Pending()


def all_reduce(tensor: torch.Tensor, *, comm: CommGroup, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
    """Reduce `tensor` in place over all ranks (sum by default)."""
    if comm.world_size == 1:
        return
    count(comm, Collective.ALL_REDUCE, tensor)
    if not comm.dry_run:
        dist.all_reduce(tensor, op=op, group=comm.group)
