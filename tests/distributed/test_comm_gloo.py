"""The collectives on real gloo ranks: exact results, async handles, and ring byte counts."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from harness import run_ranks
from tierzero.comm import CommCounter, CommGroup, all_gather, all_reduce, reduce_scatter


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
