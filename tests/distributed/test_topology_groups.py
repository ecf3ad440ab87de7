"""Intra- and inter-node groups built from launcher variables on 4 real gloo ranks.

Each rank sees LOCAL_WORLD_SIZE=2 and its LOCAL_RANK, as torchrun sets them on two
nodes of two ranks; an all-reduce of the rank number over each group shows who is in it.
The one-node and one-rank-per-node layouts run in the same job, and so do layouts the
ranks disagree on, which every rank must refuse (none left waiting in `new_group`).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import run_ranks

from tierzero.comm.topology import Topology, node_groups


def _sums(topology: Topology) -> dict[str, Any]:
    groups = node_groups(topology)
    out: dict[str, Any] = {}
    for name, group in (("intra", groups.intra), ("inter", groups.inter)):
        value = torch.tensor(float(topology.rank))
        dist.all_reduce(value, group=group)
        out[name] = (value.item(), dist.get_world_size(group), group is dist.group.WORLD)
    return out


def _refusal(topology: Topology) -> str:
    with pytest.raises(ValueError) as caught:
        node_groups(topology)
    return str(caught.value)


def _job(rank: int, world_size: int, _: Any) -> dict[str, Any]:
    uneven = 4 if rank == 0 else 2
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    os.environ["LOCAL_RANK"] = str(rank % 2)
    return {
        "two_by_two": _sums(Topology.from_env(world_size=dist.get_world_size(), rank=dist.get_rank())),
        "one_node": _sums(Topology(world_size=world_size, rank=rank, local_world_size=world_size)),
        "one_per_node": _sums(Topology(world_size=world_size, rank=rank, local_world_size=1)),
        "per_node_differs": _refusal(Topology(world_size=world_size, rank=rank, local_world_size=uneven)),
        "rank_differs": _refusal(Topology(world_size=world_size, rank=(rank + 1) % world_size, local_world_size=2)),
    }


def test_groups_from_launcher_variables_hold_the_right_ranks() -> None:
    results = run_ranks(_job, world_size=4)
    for rank, out in enumerate(results):
        node, local = divmod(rank, 2)
        # node 0 holds ranks 0 and 1, node 1 ranks 2 and 3; local rank 0 is ranks 0 and 2
        assert out["two_by_two"]["intra"] == (float(2 * node + 2 * node + 1), 2, False)
        assert out["two_by_two"]["inter"] == (float(local + local + 2), 2, False)
        assert out["one_node"]["intra"] == (6.0, 4, True)
        assert out["one_node"]["inter"] == (float(rank), 1, False)
        assert out["one_per_node"]["intra"] == (float(rank), 1, False)
        assert out["one_per_node"]["inter"] == (6.0, 4, True)
        assert "ranks disagree on the ranks per node (rank 0: 4, rank 1: 2" in out["per_node_differs"]
        assert "rank 0: 1 of 4" in out["rank_differs"] and "expected rank r of 4" in out["rank_differs"]
