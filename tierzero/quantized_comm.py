"""Collectives that send quantised bytes: ZeRO++ qwZ's parameter all-gather.

[Note: qwZ]
With `zero.quantized_weights`, stage 3's parameter gathers over the data-parallel group
send int8 instead of the compute dtype: each rank quantises its shard block-wise
(tierzero/quant.py, one fp32 scale per `QWZ_BLOCK` elements), the ranks all-gather the
packed bytes (payload then scales, `quantized_nbytes` of them per shard), and every rank
dequantises every piece, its own included, into the gathered buffer. So all ranks compute
with the same weights, each within half a block scale of the master's, and the masters,
gradients and optimizer states never see a quantised value. The bytes a rank sends per
gather are (N - 1) x quantized_nbytes(shard): about a quarter of an fp32 gather and half of
a bf16 one, plus 4 bytes per block. Forward and backward gathers of a step are quantised
alike, so backward differentiates the weights forward used; with hpZ the backward gathers
inside the node from the secondary copy, which holds the dequantised weights.
"""

from __future__ import annotations

import torch

from tierzero import comm as C
from tierzero.quant import Quantized, dequantize, quantize, quantized_nbytes

__all__ = ["QWZ_BLOCK", "all_gather_quantized"]

#: Elements per scale in qwZ's gathers: a shard is a multiple of it (units pad to 2048 x N elements).
QWZ_BLOCK = 2048
_BITS = 8


def all_gather_quantized(
    output: torch.Tensor, shard: torch.Tensor, *, comm: C.CommGroup, async_op: bool = False
) -> C.Pending:
    """`comm.all_gather` of `shard` into `output` through int8 (see [Note: qwZ]); counts the packed bytes."""
    numel = shard.numel()
    if output.numel() != numel * comm.world_size:
        raise ValueError(
            f"all_gather output holds {output.numel()} elements, expected "
            f"{comm.world_size} x {numel}: size the output as world_size x shard"
        )
    if comm.world_size == 1:
        return C.all_gather(output, shard, comm=comm)  # nothing is sent: nothing to quantise
    nbytes = quantized_nbytes(numel, bits=_BITS, block_size=QWZ_BLOCK)
    payload = nbytes - 4 * -(-numel // QWZ_BLOCK)
    packed = torch.empty(nbytes, dtype=torch.uint8, device=shard.device)
    received = torch.empty((comm.world_size, nbytes), dtype=torch.uint8, device=shard.device)
    if shard.is_meta:  # the estimate's dry run: count the bytes, move none
        return C.all_gather(received.view(-1), packed, comm=comm)
    q = quantize(shard, bits=_BITS, block_size=QWZ_BLOCK)
    packed[:payload].copy_(q.data)
    packed[payload:].copy_(q.scales.view(torch.uint8))
    inner = C.all_gather(received.view(-1), packed, comm=comm, async_op=True)
    pieces = output.view(comm.world_size, -1)

    def finish() -> None:
        inner.wait()
        for row, piece in zip(received, pieces):
            scales = row[payload:].clone().view(torch.float32)  # a copy: the row may not be 4-byte aligned
            got = Quantized(
                data=row[:payload], scales=scales, numel=numel, bits=_BITS, block_size=QWZ_BLOCK, dtype=shard.dtype
            )
            dequantize(got, out=piece)

    return C.settle(C.Pending((), finish, keep=(packed, received)), async_op=async_op)
