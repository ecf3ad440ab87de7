"""Node layout: which ranks share a machine, and the intra- and inter-node process groups.

The layout comes from the launcher: torchrun sets LOCAL_WORLD_SIZE (ranks per node) and
LOCAL_RANK on every rank, and numbers ranks contiguously by node (node n holds ranks
n * L .. n * L + L - 1 for L ranks per node). Only that layout, with the same number of
ranks on every node, is supported. Without LOCAL_WORLD_SIZE the job is taken to be one
node. Tests and users can also build a `Topology` directly, or from a `DeviceMesh` of shape
(nodes, ranks per node).

`node_groups` creates the groups with `torch.distributed.new_group`, so they use the
default group's backend unless told otherwise: NCCL on GPUs and gloo on CPUs, as
`tierzero.comm.dist.setup` chooses.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Where one rank sits: `world_size` ranks on `nodes` nodes of `local_world_size` ranks each."""

    world_size: int
    """Ranks in the job."""
    rank: int
    """This rank, 0 <= rank < world_size."""
    local_world_size: int
    """Ranks per node; the same on every node and a divisor of `world_size`."""

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size is {self.world_size}, expected >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank is {self.rank}, expected 0 <= rank < world_size ({self.world_size})")
        if self.local_world_size < 1:
            raise ValueError(f"local_world_size is {self.local_world_size}, expected >= 1")
        if self.world_size % self.local_world_size:
            raise ValueError(
                f"world_size {self.world_size} is not a multiple of local_world_size {self.local_world_size}: "
                "nodes with different numbers of ranks are not supported; run the same number of ranks on every node"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ, *, world_size: int, rank: int) -> Topology:
        """The layout torchrun describes in `env` (LOCAL_WORLD_SIZE, LOCAL_RANK), for this `rank`.

        Without LOCAL_WORLD_SIZE every rank is on one node. LOCAL_RANK, when set, must be
        `rank % local_world_size`, which holds for torchrun's contiguous numbering.
        """
        raw = env.get("LOCAL_WORLD_SIZE")
        local_world_size = world_size if raw is None else _positive_int("LOCAL_WORLD_SIZE", raw)
        if world_size % local_world_size:
            raise ValueError(
                f"LOCAL_WORLD_SIZE is {local_world_size} but the world size {world_size} is not a multiple of it: "
                "nodes with different numbers of ranks are not supported; run the same number of ranks on every node"
            )
        topology = cls(world_size=world_size, rank=rank, local_world_size=local_world_size)
        raw_local = env.get("LOCAL_RANK")
        if raw_local is not None and _int("LOCAL_RANK", raw_local) != topology.local_rank:
            source = "LOCAL_WORLD_SIZE" if raw is not None else "one node (LOCAL_WORLD_SIZE unset)"
            raise ValueError(
                f"rank {rank}: LOCAL_RANK is {raw_local}, expected {topology.local_rank} (rank % {local_world_size}, "
                f"from {source}): ranks must be numbered contiguously by node, as torchrun does; "
                "set LOCAL_WORLD_SIZE to the ranks per node"
            )
        return topology

    @classmethod
    def from_device_mesh(cls, mesh: DeviceMesh) -> Topology:
        """The layout of a `DeviceMesh` of shape (nodes, ranks per node), or (ranks,) for one node, for this rank.

        Its ranks must be numbered contiguously by node, as `init_device_mesh` and torchrun
        number them: row n holds ranks n * L .. n * L + L - 1, every rank of the job once.
        """
        ranks = mesh.mesh
        if ranks.ndim == 1:
            ranks = ranks.unsqueeze(0)
        world = dist.get_world_size()
        if ranks.ndim != 2 or ranks.numel() != world:
            raise ValueError(
                f"the device mesh has shape {tuple(mesh.mesh.shape)}, expected (nodes, ranks per node) covering all "
                f"{world} ranks of the job: build it with init_device_mesh(device, (nodes, ranks_per_node))"
            )
        nodes, per_node = ranks.shape
        if ranks.flatten().tolist() != list(range(world)):
            raise ValueError(
                f"the device mesh's rows are not nodes of consecutive ranks ({ranks.tolist()}, expected "
                f"row n to hold ranks n*{per_node}..n*{per_node}+{per_node - 1}): tierzero needs torchrun's "
                "numbering; build the mesh with init_device_mesh(device, (nodes, ranks_per_node))"
            )
        return cls(world_size=world, rank=dist.get_rank(), local_world_size=per_node)

    @property
    def node(self) -> int:
        return self.rank // self.local_world_size

    @property
    def local_rank(self) -> int:
        return self.rank % self.local_world_size

    @property
    def nodes(self) -> int:
        return self.world_size // self.local_world_size

    @property
    def intra_node_ranks(self) -> list[int]:
        """The ranks on this rank's node, in order."""
        return self._node_ranks(self.node)

    @property
    def inter_node_ranks(self) -> list[int]:
        """The ranks with this rank's local rank, one per node, in node order."""
        return self._local_ranks(self.local_rank)

    def all_intra_groups(self) -> list[list[int]]:
        """Every node's ranks, node 0 first: the same list on every rank."""
        return [self._node_ranks(n) for n in range(self.nodes)]

    def all_inter_groups(self) -> list[list[int]]:
        """Every local rank's ranks across nodes, local rank 0 first: the same list on every rank."""
        return [self._local_ranks(r) for r in range(self.local_world_size)]

    def _node_ranks(self, node: int) -> list[int]:
        start = node * self.local_world_size
        return list(range(start, start + self.local_world_size))

    def _local_ranks(self, local_rank: int) -> list[int]:
        return list(range(local_rank, self.world_size, self.local_world_size))


@dataclass(frozen=True, slots=True)
class NodeGroups:
    """This rank's process groups for its node (`intra`) and for its peers on other nodes (`inter`).

    Both are always real groups, so collectives over them need no special case: a group
    that spans the whole job is the default group, and one of a single rank (`inter` on
    one node, `intra` at one rank per node) is a group of that rank alone.
    """

    topology: Topology
    intra: dist.ProcessGroup
    inter: dist.ProcessGroup


def node_groups(topology: Topology, *, backend: str | None = None) -> NodeGroups:
    """Create every intra- and inter-node group and return this rank's two.

    A collective call: every rank of the default group must call it with the same layout.
    `new_group` runs for every node's group (node order), then every local rank's group
    (local-rank order), the same sequence on every rank; a group equal to the whole job
    reuses the default group. `backend=None` takes the default group's backend. The ranks first
    exchange their layouts (`all_gather_object`), so on NCCL the CUDA device must be set
    beforehand, as `tierzero.comm.dist.setup` does.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "node_groups needs an initialised torch.distributed default group: "
            "call tierzero.comm.dist.setup or torch.distributed.init_process_group first"
        )
    _check_agreement(topology)
    intra = _create(topology.all_intra_groups(), topology.node, world_size=topology.world_size, backend=backend)
    inter = _create(topology.all_inter_groups(), topology.local_rank, world_size=topology.world_size, backend=backend)
    return NodeGroups(topology=topology, intra=intra, inter=inter)


def _create(groups: list[list[int]], mine: int, *, world_size: int, backend: str | None) -> dist.ProcessGroup:
    """Create each group of `groups` in order (all ranks take part in every call); return group `mine`."""
    out = None
    for index, ranks in enumerate(groups):
        group = dist.group.WORLD if len(ranks) == world_size else dist.new_group(ranks, backend=backend)
        if index == mine:
            out = group
    assert out is not None, f"group {mine} of {len(groups)} was not created"
    return out


def _check_agreement(topology: Topology) -> None:
    """Raise on every rank when any rank's layout disagrees with the default group or with the others.

    Checked on all ranks together: a rank that raised alone would leave the others
    waiting in `new_group` for it.
    """
    world = dist.get_world_size()
    seen: list[tuple[int, int, int] | None] = [None] * world
    dist.all_gather_object(seen, (topology.rank, topology.world_size, topology.local_world_size))
    wrong = [f"rank {r}: {s[0]} of {s[1]}" for r, s in enumerate(seen) if s is not None and s[:2] != (r, world)]
    if wrong:
        raise ValueError(
            f"the topology's rank and world size differ from the default group's ({', '.join(wrong)}; "
            f"expected rank r of {world}): build the Topology from the default group's rank and size"
        )
    per_node = {s[2] for s in seen if s is not None}
    if len(per_node) > 1:
        layout = ", ".join(f"rank {r}: {s[2]}" for r, s in enumerate(seen) if s is not None)
        raise ValueError(
            f"ranks disagree on the ranks per node ({layout}): set the same LOCAL_WORLD_SIZE on every rank"
        )


def _int(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name} is {raw!r}, expected an integer: set it as torchrun does, or unset it") from None


def _positive_int(name: str, raw: str) -> int:
    value = _int(name, raw)
    if value < 1:
        raise ValueError(f"{name} is {value}, expected a positive integer (ranks per node): fix or unset it")
    return value
