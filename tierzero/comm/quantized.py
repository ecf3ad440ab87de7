"""Collectives that send quantised bytes: ZeRO++ qwZ's parameter all-gather, qgZ's gradient reduce-scatter.

[Note: qwZ]
With `zero.quantized_weights`, stage 3's parameter gathers over the data-parallel group
send int8 instead of the compute dtype: each rank quantises its shard block-wise
(tierzero/comm/quant.py, one fp32 scale per b = `zero.quantization_block_size` elements), the
ranks all-gather the packed bytes (payload then scales, `quantized_nbytes` of them per
shard), and every rank dequantises every piece, its own included, into the gathered buffer.
So all ranks compute with the same weights, each within half a block scale of the master's,
and the masters, gradients and optimizer states never see a quantised value. Units are
padded so that every shard is whole blocks (tierzero/units/unit.py): no block straddles two
shards, and the gathered weights are those of the unit's whole buffer quantised at once,
whatever the number of ranks. The bytes a rank sends per gather are (N - 1) x
quantized_nbytes(shard) = (N - 1) x (s + 4 s / b) for a shard of s elements: about a
quarter of an fp32 gather and half of a bf16 one, plus the scales. Forward and backward
gathers of a step are quantised alike, so backward differentiates the weights forward used;
with hpZ the backward gathers inside the node from the secondary copy, which holds the
dequantised weights.

[Note: qgZ]
With `zero.quantized_gradients`, the gradients' reduce-scatter over N = M nodes x L ranks
takes two hops. Inside the node, each rank sends each node peer that peer's shards of every
node (M shards, in the gradients' dtype, unquantised) and sums what it receives in fp32, in
local-rank order: it now holds its node's partial sums of the M shards owned by the ranks
of its local rank. Across nodes, among those M ranks, each sends every other node's partial
sum quantised (int8 or int4, a scale per b elements) to its owner, which dequantises and
adds the M partial sums in fp32, in node order, its own unquantised. A rank sends (L-1) x M
shards inside the node and (M-1) x quantized_nbytes(shard) across: L times fewer shards
cross than in a flat reduce-scatter, each 8 (int4) or 4 (int8) times smaller in fp32. The
error is one quantisation of each node's partial sum; masters and optimizer states stay fp32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tierzero.comm import collectives as C
from tierzero.comm.quant import Quantized, dequantize, quantize, quantized_nbytes

__all__ = ["GradHops", "all_gather_quantized", "reduce_scatter_hierarchical"]

_BITS = 8


def all_gather_quantized(
    output: torch.Tensor, shard: torch.Tensor, *, comm: C.CommGroup, block_size: int, async_op: bool = False
) -> C.Pending:
    """`comm.all_gather` of `shard` into `output` through int8, one scale per `block_size` elements
    (see [Note: qwZ]); counts the packed bytes."""
    numel = shard.numel()
    if output.numel() != numel * comm.world_size:
        raise ValueError(
            f"all_gather output holds {output.numel()} elements, expected "
            f"{comm.world_size} x {numel}: size the output as world_size x shard"
        )
    if comm.world_size == 1:
        return C.all_gather(output, shard, comm=comm)  # nothing is sent: nothing to quantise
    nbytes = quantized_nbytes(numel, bits=_BITS, block_size=block_size)
    payload = nbytes - 4 * -(-numel // block_size)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=shard.device)
    received = torch.empty((comm.world_size, nbytes), dtype=torch.uint8, device=shard.device)
    if shard.is_meta:  # the estimate's dry run: count the bytes, move none
        return C.all_gather(received.view(-1), packed, comm=comm)
    q = quantize(shard, bits=_BITS, block_size=block_size)
    packed[:payload].copy_(q.data)
    packed[payload:].copy_(q.scales.view(torch.uint8))
    inner = C.all_gather(received.view(-1), packed, comm=comm, async_op=True)
    pieces = output.view(comm.world_size, -1)

    def finish() -> None:
        inner.wait()
        for row, piece in zip(received, pieces):
            scales = row[payload:].clone().view(torch.float32)  # a copy: the row may not be 4-byte aligned
            got = Quantized(
                data=row[:payload], scales=scales, numel=numel, bits=_BITS, block_size=block_size, dtype=shard.dtype
            )
            dequantize(got, out=piece)

    return C.settle(C.Pending((), finish, keep=(packed, received)), async_op=async_op)


@dataclass(frozen=True, slots=True)
class GradHops:
    """qgZ's two hops for the gradients' reduce-scatter: inside the node, then across nodes quantised."""

    intra: C.CommGroup
    """This rank's node (local ranks in order)."""
    inter: C.CommGroup
    """The ranks with this rank's local rank, one per node, in node order."""
    bits: int
    """8 or 4: what a partial sum crosses nodes in."""
    block_size: int
    """Elements per fp32 scale of a partial sum that crosses (`zero.quantization_block_size`)."""


def reduce_scatter_hierarchical(
    outputs: Sequence[torch.Tensor], fulls: Sequence[torch.Tensor], *, hops: GradHops, async_op: bool = False
) -> C.Pending:
    """Sum each of `fulls` over every rank into this rank's shard of it, in two hops (see [Note: qgZ])."""
    intra, inter = hops.intra, hops.inter
    nodes, per_node = inter.world_size, intra.world_size
    for output, full in zip(outputs, fulls, strict=True):
        if full.numel() != output.numel() * nodes * per_node:
            raise ValueError(
                f"reduce_scatter input holds {full.numel()} elements, expected {nodes * per_node} x "
                f"{output.numel()}: pad the input to a multiple of world_size"
            )
    # Shard k of a buffer belongs to global rank k = node * per_node + local: view it as (node, local, shard).
    grids = [full.view(nodes, per_node, -1) for full in fulls]
    sizes = [output.numel() for output in outputs]
    item = fulls[0].element_size()
    C.count_sent(intra, C.Collective.REDUCE_SCATTER, [(nodes * sum(sizes) * item, p) for p in _peers(intra)])
    wire = sum(quantized_nbytes(size, bits=hops.bits, block_size=hops.block_size) for size in sizes)
    C.count_sent(inter, C.Collective.REDUCE_SCATTER, [(wire, p) for p in _peers(inter)])
    if fulls[0].is_meta:
        return C.Pending()  # the estimate's dry run: counted, nothing moves
    # Hop 1, inside the node: this rank gets every node's shard of its local rank from each node peer,
    # node by node, each node's shards of every buffer end to end.
    sends = [(_node_major(grids, p), intra.global_rank(p)) for p in _peers(intra)]
    received = fulls[0].new_empty((per_node - 1, nodes * sum(sizes)))
    works = C.exchange(sends, list(zip(received, (intra.global_rank(p) for p in _peers(intra)))), comm=intra)

    def finish() -> None:
        for work in works:
            work.wait()
        own = _node_major(grids, intra.rank)
        rows = [*received[: intra.rank], own, *received[intra.rank :]]
        partial = torch.zeros(nodes * sum(sizes), dtype=torch.float32, device=own.device)
        for row in rows:  # fp32 sums, local rank order
            partial.add_(row)
        _across_nodes(partial.view(nodes, -1), outputs, sizes, hops)

    keep = tuple(t for t, _ in sends)
    return C.settle(C.Pending((), finish, keep=(*keep, received)), async_op=async_op)


def _node_major(grids: list[torch.Tensor], local: int) -> torch.Tensor:
    """The shards of local rank `local` on every node, node by node, each node's buffers end to end."""
    return torch.cat([grid[node, local] for node in range(grids[0].shape[0]) for grid in grids])


def _across_nodes(partial: torch.Tensor, outputs: Sequence[torch.Tensor], sizes: list[int], hops: GradHops) -> None:
    """Hop 2: each node's partial sum of this rank's shard, quantised, to the rank owning it; summed in fp32."""
    inter, peers = hops.inter, _peers(hops.inter)
    wire = sum(quantized_nbytes(size, bits=hops.bits, block_size=hops.block_size) for size in sizes)
    received = [torch.empty(wire, dtype=torch.uint8, device=partial.device) for _ in peers]
    sends = [(_pack(partial[p], sizes, hops), inter.global_rank(p)) for p in peers]
    for work in C.exchange(sends, list(zip(received, (inter.global_rank(p) for p in peers))), comm=inter):
        work.wait()
    pieces = {p: _unpack(row, sizes, hops) for p, row in zip(peers, received)}
    pieces[inter.rank] = partial[inter.rank]  # this node's own partial sum never leaves it: exact
    total = torch.zeros_like(partial[inter.rank])
    for node in range(inter.world_size):  # fp32, node order
        total.add_(pieces[node])
    for output, part in zip(outputs, total.split(sizes)):
        output.copy_(part)


def _pack(values: torch.Tensor, sizes: list[int], hops: GradHops) -> torch.Tensor:
    """Each buffer's part of `values` quantised, scales then payload, end to end as bytes."""
    parts = []
    for part in values.split(sizes):
        q = quantize(part, bits=hops.bits, block_size=hops.block_size)
        parts += [q.scales.view(torch.uint8), q.data]
    return torch.cat(parts)


def _unpack(row: torch.Tensor, sizes: list[int], hops: GradHops) -> torch.Tensor:
    out, start, bits, block = [], 0, hops.bits, hops.block_size
    for size in sizes:
        blocks = -(-size // block)
        scales = row[start : start + 4 * blocks].clone().view(torch.float32)
        start += 4 * blocks
        payload = quantized_nbytes(size, bits=bits, block_size=block) - 4 * blocks
        data = row[start : start + payload]
        start += payload
        q = Quantized(data=data, scales=scales, numel=size, bits=bits, block_size=block, dtype=torch.float32)
        out.append(dequantize(q))
    return torch.cat(out)


def _peers(comm: C.CommGroup) -> list[int]:
    return [r for r in range(comm.world_size) if r != comm.rank]
