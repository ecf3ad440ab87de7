"""Collectives at world size 1 and the ring byte accounting."""

from __future__ import annotations

import pytest
import torch

from tierzero.comm.collectives import Collective, CommCounter, CommGroup, all_gather, all_reduce, reduce_scatter, ring_bytes


@pytest.mark.parametrize(
    ("op", "nbytes", "world", "expected"),
    [
        (Collective.ALL_GATHER, 4096, 1, 0),
        (Collective.ALL_GATHER, 4096, 2, 2048),
        (Collective.ALL_GATHER, 4096, 4, 3072),
        (Collective.REDUCE_SCATTER, 4096, 4, 3072),
        (Collective.ALL_REDUCE, 4, 2, 4),
        (Collective.ALL_REDUCE, 4, 4, 6),
        (Collective.ALL_REDUCE, 4096, 1, 0),
    ],
)
def test_ring_bytes(op: Collective, nbytes: int, world: int, expected: int) -> None:
    assert ring_bytes(op, nbytes=nbytes, world_size=world) == expected


def test_counter_reports_and_resets() -> None:
    counter = CommCounter()
    counter.add(Collective.ALL_GATHER, 10)
    counter.add(Collective.ALL_GATHER, 5)
    counter.add(Collective.ALL_REDUCE, 2)
    assert counter.report() == {"all_gather": 15, "reduce_scatter": 0, "all_reduce": 2}
    assert counter.calls[Collective.ALL_GATHER] == 2
    counter.reset()
    assert counter.report() == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}


def test_world_size_one_copies_and_sends_nothing() -> None:
    comm = CommGroup.single()
    shard = torch.arange(6.0)
    out = torch.zeros(6)
    all_gather(out, shard, comm=comm)
    assert torch.equal(out, shard)
    part = torch.zeros(6)
    reduce_scatter(part, shard * 2, comm=comm)
    assert torch.equal(part, shard * 2)
    value = torch.tensor(3.0)
    all_reduce(value, comm=comm)
    assert value.item() == 3.0
    assert comm.counter.report() == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}


def test_size_mismatch_is_a_clear_error() -> None:
    comm = CommGroup(rank=0, world_size=2, counter=CommCounter())
    with pytest.raises(ValueError, match="all_gather output holds 5 elements, expected 2 x 3"):
        all_gather(torch.zeros(5), torch.zeros(3), comm=comm)
    with pytest.raises(ValueError, match="reduce_scatter input holds 7 elements, expected 2 x 3"):
        reduce_scatter(torch.zeros(3), torch.zeros(7), comm=comm)


def test_default_group_absent_means_single_process() -> None:
    comm = CommGroup.from_default_group()
    assert (comm.rank, comm.world_size) == (0, 1)


def test_a_dry_run_group_counts_what_a_real_one_sends_and_needs_no_process_group() -> None:
    """`tierzero estimate` runs the stages at a world size it does not have, over meta tensors."""
    comm = CommGroup(rank=1, world_size=4, counter=CommCounter(), dry_run=True)
    meta = {"device": "meta", "dtype": torch.bfloat16}
    all_gather(torch.empty(4096, **meta), torch.empty(1024, **meta), comm=comm, async_op=True).wait()
    reduce_scatter(torch.empty(1024, **meta), torch.empty(4096, **meta), comm=comm)
    all_reduce(torch.empty((), device="meta"), comm=comm)
    assert comm.counter.report() == {"all_gather": 3 * 8192 // 4, "reduce_scatter": 3 * 8192 // 4, "all_reduce": 6}
    assert comm.counter.calls[Collective.ALL_GATHER] == 1
    with pytest.raises(ValueError, match="expected 4 x 1000"):
        all_gather(torch.empty(4096, **meta), torch.empty(1000, **meta), comm=comm)


def test_bytes_split_by_node_follow_the_members_global_ranks() -> None:
    """Two nodes of two ranks; a group of global ranks 1, 2, 3 seen from rank 2 (node 1)."""
    comm = CommGroup(rank=1, world_size=3, counter=CommCounter(), dry_run=True, members=(1, 2, 3), local_world_size=2)
    assert comm.peers_across_nodes() == 1  # rank 1 is on node 0, rank 3 shares node 1
    meta = {"device": "meta", "dtype": torch.float32}
    all_gather(torch.empty(3 * 1024, **meta), torch.empty(1024, **meta), comm=comm)
    reduce_scatter(torch.empty(1024, **meta), torch.empty(3 * 1024, **meta), comm=comm)
    all_reduce(torch.empty(3, **meta), comm=comm)
    # a 4096-byte piece to each of two peers, one across; the all-reduce: 2 x 12 / 3 bytes a peer
    assert comm.counter.links() == {
        "all_gather": {"intra": 4096, "inter": 4096},
        "reduce_scatter": {"intra": 4096, "inter": 4096},
        "all_reduce": {"intra": 8, "inter": 8},
    }
    assert comm.counter.report() == {"all_gather": 8192, "reduce_scatter": 8192, "all_reduce": 16}
    comm.counter.reset()
    assert comm.counter.links()["all_gather"] == {"intra": 0, "inter": 0}
    one_node = CommGroup(rank=0, world_size=4, counter=CommCounter(), dry_run=True)
    assert one_node.peers_across_nodes() == 0
