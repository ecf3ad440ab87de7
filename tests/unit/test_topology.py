"""Node layout arithmetic and reading it from launcher variables (no process group)."""

from __future__ import annotations

import pytest

from tierzero.comm.topology import Topology, node_groups


@pytest.mark.parametrize(
    ("nodes", "per_node"),
    [(2, 2), (1, 4), (4, 1), (3, 2)],
)
def test_every_rank_sits_in_one_intra_and_one_inter_group(nodes: int, per_node: int) -> None:
    world = nodes * per_node
    for rank in range(world):
        t = Topology(world_size=world, rank=rank, local_world_size=per_node)
        assert (t.nodes, t.node, t.local_rank) == (nodes, rank // per_node, rank % per_node)
        assert t.intra_node_ranks == [t.node * per_node + i for i in range(per_node)]
        assert t.inter_node_ranks == [n * per_node + t.local_rank for n in range(nodes)]
        assert t.all_intra_groups()[t.node] == t.intra_node_ranks
        assert t.all_inter_groups()[t.local_rank] == t.inter_node_ranks
        assert t.intra_node_ranks[t.local_rank] == rank and t.inter_node_ranks[t.node] == rank
    # The groups of each kind partition the ranks, and every rank computes the same lists.
    for groups in (t.all_intra_groups(), t.all_inter_groups()):
        assert sorted(r for g in groups for r in g) == list(range(world))
    other = Topology(world_size=world, rank=0, local_world_size=per_node)
    assert other.all_intra_groups() == t.all_intra_groups() and other.all_inter_groups() == t.all_inter_groups()


def test_three_nodes_of_two_spelled_out() -> None:
    t = Topology(world_size=6, rank=3, local_world_size=2)
    assert t.all_intra_groups() == [[0, 1], [2, 3], [4, 5]]
    assert t.all_inter_groups() == [[0, 2, 4], [1, 3, 5]]
    assert (t.node, t.local_rank, t.intra_node_ranks, t.inter_node_ranks) == (1, 1, [2, 3], [1, 3, 5])


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"world_size": 0, "rank": 0, "local_world_size": 1}, "world_size is 0"),
        ({"world_size": 4, "rank": 4, "local_world_size": 2}, "rank is 4"),
        ({"world_size": 4, "rank": -1, "local_world_size": 2}, "rank is -1"),
        ({"world_size": 4, "rank": 0, "local_world_size": 0}, "local_world_size is 0"),
        ({"world_size": 6, "rank": 0, "local_world_size": 4}, "not a multiple of local_world_size 4"),
    ],
)
def test_explicit_layout_is_checked(fields: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology(**fields)


def test_from_env_reads_torchrun_variables() -> None:
    t = Topology.from_env({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, world_size=4, rank=3)
    assert t == Topology(world_size=4, rank=3, local_world_size=2)
    assert Topology.from_env({"LOCAL_WORLD_SIZE": "8"}, world_size=16, rank=9).node == 1


def test_from_env_without_local_world_size_is_one_node() -> None:
    assert Topology.from_env({}, world_size=4, rank=2) == Topology(world_size=4, rank=2, local_world_size=4)
    assert Topology.from_env({"LOCAL_RANK": "2"}, world_size=4, rank=2).nodes == 1
    with pytest.raises(ValueError, match="LOCAL_RANK is 0, expected 2 .*one node .*set LOCAL_WORLD_SIZE"):
        Topology.from_env({"LOCAL_RANK": "0"}, world_size=4, rank=2)


def test_from_env_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert Topology.from_env(world_size=4, rank=2).node == 1


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"LOCAL_WORLD_SIZE": "two"}, "LOCAL_WORLD_SIZE is 'two', expected an integer"),
        ({"LOCAL_WORLD_SIZE": ""}, "LOCAL_WORLD_SIZE is '', expected an integer"),
        ({"LOCAL_WORLD_SIZE": "0"}, "LOCAL_WORLD_SIZE is 0, expected a positive integer"),
        ({"LOCAL_WORLD_SIZE": "-2"}, "LOCAL_WORLD_SIZE is -2, expected a positive integer"),
        ({"LOCAL_WORLD_SIZE": "4"}, "LOCAL_WORLD_SIZE is 4 but the world size 6 is not a multiple.*not supported"),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "x"}, "LOCAL_RANK is 'x', expected an integer"),
        ({"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}, r"rank 3: LOCAL_RANK is 0, expected 1 \(rank % 2.*contiguously"),
    ],
)
def test_from_env_rejects_bad_values(env: dict[str, str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Topology.from_env(env, world_size=6, rank=3)


def test_node_groups_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match="needs an initialised torch.distributed"):
        node_groups(Topology(world_size=1, rank=0, local_world_size=1))
