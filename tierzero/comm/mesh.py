"""The data-parallel groups the engine sends over, built from the node layout.

Plain ZeRO shards over the whole job: one group, `world`. Hybrid sharding
(`zero.shard_group_size` S < N ranks, HSDP / MiCS) shards inside groups of S consecutive
ranks (`shard`: ranks kS .. kS + S - 1) and keeps one replica of the shards per group; the
ranks holding the same shard form a `replica` group (ranks s, s + S, s + 2S, ...), over
which the sharded gradients are summed once per step. With S equal to the ranks per node,
every gather and reduce-scatter stays inside the node, and only the replicas' sum crosses.
ZeRO++'s hpZ (`zero.hpz_partition_size` H) shards over the whole job and adds `hpz`: groups of
H consecutive ranks (a node), over which backward gathers a unit from the secondary copy its
forward gather left (stages/stage3.py).

Every group counts its own bytes (`CommGroup.counter`), split inside and across nodes by
the `Topology` (see [Note: bytes inside and across nodes] in comm.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch.distributed as dist

from tierzero.comm.collectives import Collective, CommCounter, CommGroup
from tierzero.comm.quantized import GradHops
from tierzero.comm.topology import Topology, node_groups

__all__ = ["Mesh", "build_mesh", "launcher_topology"]

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Mesh:
    """This rank's data-parallel groups: `shard` (what ZeRO shards over), `replica` (hybrid), `secondary` (hpZ)."""

    topology: Topology
    shard: CommGroup
    replica: CommGroup | None = None
    """Hybrid sharding only: the ranks that hold this rank's shard, one per shard group."""
    secondary: CommGroup | None = None
    """hpZ only: the ranks that split the secondary copy of the parameters (this rank's node)."""
    intra: CommGroup | None = None
    """qgZ only: this rank's node, the gradients' first hop."""
    inter: CommGroup | None = None
    """qgZ only: the ranks of this rank's local rank, one per node, the gradients' second hop."""

    @property
    def groups(self) -> list[CommGroup]:
        all_groups = (self.shard, self.replica, self.secondary, self.intra, self.inter)
        return [group for group in all_groups if group is not None]

    def grad_hops(self, quantized: str, *, block_size: int) -> GradHops | None:
        """qgZ's two hops with `quantized` ("int8", "int4") across nodes, a scale per `block_size`
        elements; None for "none"."""
        if quantized == "none" or self.intra is None or self.inter is None:
            return None
        bits = {"int8": 8, "int4": 4}[quantized]
        return GradHops(intra=self.intra, inter=self.inter, bits=bits, block_size=block_size)

    @property
    def secondary_parts(self) -> int:
        """hpZ: the parts each unit's secondary copy is split into (0 without hpZ)."""
        return 0 if self.secondary is None else self.secondary.world_size

    @property
    def data_parallel_size(self) -> int:
        """Ranks that each train on their own micro-batch: the whole job."""
        return self.topology.world_size

    def report(self, *, per_group: bool) -> dict[str, Any]:
        """Bytes sent per collective, summed over the groups; or per group, inside and across nodes."""
        if per_group:
            return {group.name: group.counter.links() for group in self.groups}
        total = dict.fromkeys((op.value for op in Collective), 0)
        for group in self.groups:
            for op, sent in group.counter.report().items():
                total[op] += sent
        return total

    def reset(self) -> None:
        for group in self.groups:
            group.counter.reset()

    def on_first_replica(self, fn: Callable[[], T], *, share: bool = False) -> T | None:
        """Run `fn` on the first replica's ranks only (every rank when not hybrid): for what one
        copy of the shards does, a checkpoint's save. A collective over the job: the other
        replicas wait for global rank 0's outcome, and raise when it failed, so no rank is left
        waiting for one that raised. `share`: they return rank 0's result (picklable), else None.
        """
        if self.replica is None:
            return fn()
        value: Any = None
        outcome: tuple[str, Any] = ("ok", None)
        error: BaseException | None = None
        if self.replica.rank == 0:
            try:
                value = fn()
                outcome = ("ok", value if share else None)
            except Exception as exc:  # noqa: BLE001 - raised below, on every rank
                error, outcome = exc, ("error", f"{type(exc).__name__}: {exc}")
        box = [outcome]
        dist.broadcast_object_list(box, src=0)
        kind, shared = box[0]
        if error is not None:
            raise error
        if kind == "error":
            raise RuntimeError(f"rank 0 failed where the first replica works alone (this rank waited): {shared}")
        return value if self.replica.rank == 0 else shared


def launcher_topology(
    *, world_size: int, rank: int, given: Topology | None = None, env: Mapping[str, str] = os.environ
) -> Topology:
    """The node layout torchrun describes (LOCAL_WORLD_SIZE), unless one is `given` (checked against
    this rank); a single process is one node."""
    if given is not None:
        if (given.world_size, given.rank) != (world_size, rank):
            raise ValueError(
                f"the topology is rank {given.rank} of {given.world_size}, the process group's rank "
                f"{rank} of {world_size}: build the Topology from the group's rank and size"
            )
        return given
    if world_size == 1:
        return Topology(world_size=1, rank=0, local_world_size=1)
    return Topology.from_env(env, world_size=world_size, rank=rank)


def build_mesh(
    topology: Topology,
    *,
    shard_group_size: int = 0,
    hpz_partition_size: int = 0,
    node_hops: bool = False,
    dry_run: bool = False,
) -> Mesh:
    """The groups for `topology`, sharding over groups of `shard_group_size` ranks (0: the whole job),
    with hpZ's groups of `hpz_partition_size` ranks (0: none), and with `node_hops` (qgZ) the
    intra- and inter-node groups (tierzero/comm/topology.py).

    A collective call when hybrid or with hpZ, and not `dry_run`: every rank creates every
    shard group (in order), then every replica group, or every hpZ group, as `new_group`
    requires. A dry run (`tierzero estimate`) creates no process group; its groups only count.
    """
    n, rank, per_node = topology.world_size, topology.rank, topology.local_world_size
    size = shard_group_size or n
    if n % size:
        raise ValueError(
            f"zero.shard_group_size is {size}, which does not divide the {n} ranks of the job: "
            f"set it to a divisor of {n} (the ranks per node, {per_node}, is the usual choice), or 0 to shard over all"
        )
    if size == n:
        group = CommGroup(rank=rank, world_size=n, counter=CommCounter(), dry_run=dry_run, local_world_size=per_node)
        secondary = _secondary(topology, hpz_partition_size, dry_run=dry_run)
        intra, inter = _node_hops(topology, dry_run=dry_run) if node_hops else (None, None)
        return Mesh(topology=topology, shard=group, secondary=secondary, intra=intra, inter=inter)
    shard_ranks = [list(range(k * size, (k + 1) * size)) for k in range(n // size)]
    replica_ranks = [list(range(s, n, size)) for s in range(size)]
    shard_pg = _new_groups(shard_ranks, rank // size, dry_run=dry_run)
    replica_pg = _new_groups(replica_ranks, rank % size, dry_run=dry_run)
    common = {"dry_run": dry_run, "local_world_size": per_node}
    shard = CommGroup(
        rank=rank % size, world_size=size, counter=CommCounter(), group=shard_pg, name="shard",
        members=tuple(shard_ranks[rank // size]), **common,
    )  # fmt: skip
    replica = CommGroup(
        rank=rank // size, world_size=n // size, counter=CommCounter(), group=replica_pg, name="replica",
        members=tuple(replica_ranks[rank % size]), **common,
    )  # fmt: skip
    return Mesh(topology=topology, shard=shard, replica=replica)


def _secondary(topology: Topology, size: int, *, dry_run: bool) -> CommGroup | None:
    """hpZ's group of `size` consecutive ranks holding this rank (None when `size` is 0)."""
    if not size:
        return None
    n, rank = topology.world_size, topology.rank
    if n % size:
        raise ValueError(
            f"zero.hpz_partition_size is {size}, which does not divide the {n} ranks of the job: set it to "
            f"a divisor of {n} (the ranks per node, {topology.local_world_size}, is the usual choice), or 0 for no hpZ"
        )
    ranks = [list(range(k * size, (k + 1) * size)) for k in range(n // size)]
    group = dist.group.WORLD if size == n and not dry_run else _new_groups(ranks, rank // size, dry_run=dry_run)
    return CommGroup(
        rank=rank % size, world_size=size, counter=CommCounter(), group=group, name="hpz", dry_run=dry_run,
        members=tuple(ranks[rank // size]), local_world_size=topology.local_world_size,
    )  # fmt: skip


def _node_hops(topology: Topology, *, dry_run: bool) -> tuple[CommGroup, CommGroup]:
    """qgZ's groups: this rank's node, and its local rank's ranks on every node."""
    groups = None if dry_run else node_groups(topology)
    made = []
    for name, ranks, pg in (
        ("intra", topology.intra_node_ranks, groups and groups.intra),
        ("inter", topology.inter_node_ranks, groups and groups.inter),
    ):
        made.append(CommGroup(
            rank=ranks.index(topology.rank), world_size=len(ranks), counter=CommCounter(), group=pg, name=name,
            members=tuple(ranks), dry_run=dry_run, local_world_size=topology.local_world_size,
        ))  # fmt: skip
    return made[0], made[1]


def _new_groups(groups: list[list[int]], mine: int, *, dry_run: bool) -> dist.ProcessGroup | None:
    """Create each group in order (every rank takes part in every call) and return group `mine`."""
    if dry_run:
        return None
    created = [dist.new_group(ranks) for ranks in groups]
    return created[mine]
