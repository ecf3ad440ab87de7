"""Sharded gradients summed over the whole job when each shard group holds a replica (hybrid sharding).

[Note: the replicas' sum in rank order]
Plain ZeRO's reduce-scatter adds the N ranks' pieces of a range in global rank order,
((g0 + g1) + g2) + g3 (comm.py). Reduce-scattering inside each shard group and then
all-reducing the groups' partial sums would add (g0 + g1) + (g2 + g3): other bits. So the
replicas add in a chain instead. Ranks s, s + S, s + 2S, ... own the same range (S ranks a
shard group, R groups). Each reduce-scatters inside its group without summing yet; the
first replica adds its group's pieces in rank order and sends the partial sum to the
second, which adds its group's pieces to it one by one, in rank order, and so on; the
last replica holds the sum of all N pieces, added exactly as plain ZeRO adds them, and
sends it back to the others. Every rank then holds the same bits as plain ZeRO at the
same world size. On the replica group each rank but the last sends its range once (the
partial sum) and the last sends it R - 1 times (the result): (R - 1) ranges per replica
group in each direction, 2(R - 1)/R ranges a rank on average, the ring all-reduce's volume;
at R = 2 every rank sends exactly one range. `comm_report` counts these sends as the
replica group's all_reduce. The chain adds latency (R - 1 hops, then one), not bytes.

NCCL sums in its own order anyway: there the groups reduce-scatter and all-reduce.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from tierzero.comm import collectives as C

__all__ = ["reduce_scatter_replicated"]


def reduce_scatter_replicated(
    outputs: Sequence[torch.Tensor],
    fulls: Sequence[torch.Tensor],
    *,
    shard: C.CommGroup,
    replica: C.CommGroup,
    async_op: bool = False,
) -> C.Pending:
    """Sum each of `fulls` over every rank of the job; leave this rank's shard of each sum in `outputs`.

    `shard` is this rank's shard group (whose ranks split the buffer), `replica` the ranks
    holding the same shard. See [Note: the replicas' sum in rank order].
    """
    C.check_scatter(outputs, fulls, comm=shard)
    if shard.world_size > 1 and not shard.dry_run and not C.is_direct(shard):
        C.reduce_scatter_many(outputs, fulls, comm=shard)
        for output in outputs:
            C.all_reduce(output, comm=replica)
        return C.Pending()
    _count_chain(outputs, replica)
    if shard.dry_run or replica.dry_run:
        return C.reduce_scatter_many(outputs, fulls, comm=shard)  # counts the shard group's part
    if shard.world_size == 1:
        scattered, terms = None, [[full] for full in fulls]
    else:
        for full in fulls:
            C.count(shard, C.Collective.REDUCE_SCATTER, full)
        scattered = C.post_scatter(outputs, fulls, comm=shard)
        terms = [scattered.terms(i) for i in range(len(outputs))]

    def finish() -> None:
        if scattered is not None:
            _wait(scattered.works)
        _chain(outputs, terms, replica)

    return C.settle(C.Pending((), finish, keep=scattered.sends if scattered else ()), async_op=async_op)


def _count_chain(outputs: Sequence[torch.Tensor], replica: C.CommGroup) -> None:
    """The chain's sends, as the replica group's all-reduce: the partial sum on, or the result back."""
    nbytes = sum(output.numel() * output.element_size() for output in outputs)
    last = replica.world_size - 1
    sends = [(nbytes, replica.rank + 1)] if replica.rank < last else [(nbytes, peer) for peer in range(last)]
    C.count_sent(replica, C.Collective.ALL_REDUCE, sends)


def _chain(outputs: Sequence[torch.Tensor], terms: list[list[torch.Tensor]], replica: C.CommGroup) -> None:
    """Add this group's terms to the previous replica's partial sum, pass it on; take the last's result."""
    rank, last = replica.rank, replica.world_size - 1
    sizes = [output.numel() for output in outputs]
    packed = outputs[0].new_empty(sum(sizes))
    # Two tags, taken in the same order by every member: the partial sums', the result's.
    on, back = replica.counter.next_tag(), replica.counter.next_tag()
    if rank > 0:
        _wait(C.exchange([], [(packed, replica.global_rank(rank - 1))], comm=replica, tag=on))
        for output, part, own in zip(outputs, packed.split(sizes), terms):
            C.add_in_order([part, *own], out=output)
    else:
        for output, own in zip(outputs, terms):
            C.add_in_order(own, out=output)
    if rank < last:
        partial = torch.cat(list(outputs))
        sent = C.exchange([(partial, replica.global_rank(rank + 1))], [], comm=replica, tag=on)
        _wait(C.exchange([], [(packed, replica.global_rank(last))], comm=replica, tag=back))
        _wait(sent)
        for output, part in zip(outputs, packed.split(sizes)):
            output.copy_(part)
    else:
        result = torch.cat(list(outputs))
        _wait(C.exchange([(result, replica.global_rank(peer)) for peer in range(last)], [], comm=replica, tag=back))


def _wait(works: Sequence[dist.Work]) -> None:
    for work in works:
        work.wait()
