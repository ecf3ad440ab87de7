"""The collectives on real gloo ranks: exact results, async handles, and ring byte counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from harness import run_ranks

from tierzero.comm.collectives import (
    Collective,
    CommCounter,
    CommGroup,
    all_gather,
    all_gather_many,
    all_reduce,
    reduce_scatter,
    reduce_scatter_many,
)


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    comm = CommGroup.from_default_group(counter=CommCounter())
    shard = torch.arange(3, dtype=torch.float32) + 10 * rank
    gathered = torch.empty(3 * world_size)
    all_gather(gathered, shard, comm=comm)
    async_gathered = torch.empty(3 * world_size, dtype=torch.bfloat16)
    all_gather(async_gathered, shard.bfloat16(), comm=comm, async_op=True).wait()
    full = torch.arange(4 * world_size, dtype=torch.float32) * (rank + 1)
    part = torch.empty(4)
    reduce_scatter(part, full, comm=comm, async_op=True).wait()
    scalar = torch.tensor(float(rank + 1))
    all_reduce(scalar, comm=comm)
    return {
        "rank": comm.rank,
        "gathered": gathered,
        "async_gathered": async_gathered,
        "part": part,
        "scalar": scalar.item(),
        "sent": comm.counter.report(),
        "calls": {op.value: n for op, n in comm.counter.calls.items()},
    }


@pytest.mark.parametrize("world_size", [2, 4])
def test_collectives_on_gloo(world_size: int) -> None:
    results = run_ranks(_job, world_size=world_size)
    expected_gather = torch.cat([torch.arange(3, dtype=torch.float32) + 10 * r for r in range(world_size)])
    rank_sum = sum(r + 1 for r in range(world_size))
    for rank, out in enumerate(results):
        assert out["rank"] == rank
        assert torch.equal(out["gathered"], expected_gather)
        assert torch.equal(out["async_gathered"], expected_gather.bfloat16())
        own = torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) * rank_sum
        assert torch.equal(out["part"], own)
        assert out["scalar"] == rank_sum
        n = world_size
        # fp32 gather output 12n bytes, bf16 6n bytes; reduce-scatter input 16n bytes; scalar 4 bytes
        assert out["sent"] == {
            "all_gather": (n - 1) * 12 + (n - 1) * 6,
            "reduce_scatter": (n - 1) * 16,
            "all_reduce": 2 * (n - 1) * 4 // n,
        }
        assert out["calls"] == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 1}


def _overlapping_job(rank: int, world_size: int, _: Any) -> dict[str, torch.Tensor]:
    """Collectives of different sizes in flight together, waited for out of order."""
    comm = CommGroup.from_default_group(counter=CommCounter())
    small, large = torch.full((2,), float(rank)), torch.full((5,), 100.0 + rank)
    out_small, out_large = torch.empty(2 * world_size), torch.empty(5 * world_size)
    full = torch.arange(3 * world_size, dtype=torch.float32) + rank
    part = torch.empty(3)
    handles = [
        all_gather(out_small, small, comm=comm, async_op=True),
        reduce_scatter(part, full, comm=comm, async_op=True),
        all_gather(out_large, large, comm=comm, async_op=True),
    ]
    for handle in reversed(handles):
        handle.wait()
    return {"small": out_small, "large": out_large, "part": part}


@pytest.mark.parametrize("world_size", [2, 3])
def test_collectives_in_flight_together_keep_their_pieces_apart(world_size: int) -> None:
    results = run_ranks(_overlapping_job, world_size=world_size)
    ranks = range(world_size)
    for rank, out in enumerate(results):
        assert torch.equal(out["small"], torch.cat([torch.full((2,), float(r)) for r in ranks]))
        assert torch.equal(out["large"], torch.cat([torch.full((5,), 100.0 + r) for r in ranks]))
        own = torch.arange(3 * rank, 3 * rank + 3, dtype=torch.float32)
        assert torch.equal(out["part"], sum(own + r for r in ranks))


def _many_job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    """Buffers of different sizes reduced and gathered in one exchange, against one call each."""
    comm = CommGroup.from_default_group(counter=CommCounter())
    fulls = [torch.randn(n * world_size, generator=torch.Generator().manual_seed(rank * 10 + n)) for n in (1, 4, 7)]
    together = [torch.empty(n) for n in (1, 4, 7)]
    reduce_scatter_many(together, fulls, comm=comm, async_op=True).wait()
    alone = [torch.empty(n) for n in (1, 4, 7)]
    for part, full in zip(alone, fulls):
        reduce_scatter(part, full, comm=comm)
    shards = [torch.full((n,), float(rank * 100 + n)) for n in (3, 1, 5)]
    gathered = [torch.empty(n * world_size) for n in (3, 1, 5)]
    handle = all_gather_many(gathered, shards, comm=comm, async_op=True)
    handle.wait()
    handle.wait()  # idempotent: a bucket's handle is shared by all of its units
    exchanges_before = comm.counter.sequence
    all_gather_many([torch.empty(2 * world_size)], [torch.zeros(2)], comm=comm)
    return {
        "together": together,
        "alone": alone,
        "gathered": gathered,
        "one_exchange": comm.counter.sequence - exchanges_before,
        "calls": comm.counter.calls[Collective.ALL_GATHER],
    }


@pytest.mark.parametrize("world_size", [2, 3])
def test_many_buffers_in_one_exchange(world_size: int) -> None:
    results = run_ranks(_many_job, world_size=world_size)
    for rank, out in enumerate(results):
        # The same sum in the same rank order: bitwise equal to one call per buffer.
        for together, alone in zip(out["together"], out["alone"]):
            assert torch.equal(together, alone)
        for n, gathered in zip((3, 1, 5), out["gathered"]):
            assert torch.equal(gathered, torch.cat([torch.full((n,), float(r * 100 + n)) for r in range(world_size)]))
        assert out["one_exchange"] == 1
        assert out["calls"] == 4  # counted per buffer: three in one exchange, then one


def _mixed_dtypes_job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    comm = CommGroup.from_default_group(counter=CommCounter())
    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16)  # autocast's units: bf16, their fp32 norms, bf16
    fulls = [torch.arange(n * world_size).float().to(d) * (rank + 1) + 0.25 for n, d in zip((2, 3, 4), dtypes)]
    parts = [torch.empty(n, dtype=d) for n, d in zip((2, 3, 4), dtypes)]
    reduce_scatter_many(parts, fulls, comm=comm, async_op=True).wait()
    shards = [torch.full((n,), rank + 1.5, dtype=d) for n, d in zip((2, 3, 4), dtypes)]
    gathered = [torch.empty(n * world_size, dtype=d) for n, d in zip((2, 3, 4), dtypes)]
    all_gather_many(gathered, shards, comm=comm, async_op=True).wait()
    return {"parts": parts, "gathered": gathered}


def test_many_buffers_of_two_dtypes_keep_each_its_own() -> None:
    """One exchange moves one dtype: the bf16 buffers go together, the fp32 one apart."""
    world_size = 2
    results = run_ranks(_mixed_dtypes_job, world_size=world_size)
    dtypes = (torch.bfloat16, torch.float32, torch.bfloat16)
    for rank, out in enumerate(results):
        for n, d, part in zip((2, 3, 4), dtypes, out["parts"]):
            terms = [torch.arange(n * world_size).float().to(d) * (r + 1) + 0.25 for r in range(world_size)]
            assert part.dtype == d and torch.equal(part, (terms[0] + terms[1])[rank * n : (rank + 1) * n])
        for n, d, gathered in zip((2, 3, 4), dtypes, out["gathered"]):
            assert torch.equal(gathered, torch.cat([torch.full((n,), r + 1.5, dtype=d) for r in range(world_size)]))
