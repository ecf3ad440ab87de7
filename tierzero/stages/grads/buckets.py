"""Gradients on their way to the owned GRAD slices: bucketed reduce-scatters (stages 2, 3).

[Note: gradient buckets]
A collective has a fixed cost besides its bytes (about half a millisecond on gloo
here), so units whose gradients are ready wait for each other: their reduce-scatters
start together, as one exchange (`comm.reduce_scatter_many`), once `bucket_bytes`
(`zero.reduce_bucket_size`) of them are ready, or when a unit must land; stage 1
reduces what is left before the step. Units wait in gradient scratch while they are at most
`MAX_REDUCES_IN_FLIGHT` or at most a bucket's bytes, so a small model reduces in one
exchange at the end of backward, as DistributedDataParallel does, and a large one
keeps two units in scratch. Stage 1 and 2's parameter all-gathers after the step are
bucketed the same way. A unit as large as the bucket starts alone, at once, as before:
big models keep their overlap, small ones stop paying a latency per unit. Every
decision follows the order of backward and byte counts, never timing, so every rank
forms the same buckets.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol

import torch

from tierzero.comm import collectives as C
from tierzero.comm.quantized import GradHops, reduce_scatter_hierarchical
from tierzero.comm.replicated import reduce_scatter_replicated
from tierzero.common.slices import Kind
from tierzero.stages.plan import SlicePlan
from tierzero.store.protocol import SliceStore
from tierzero.units.unit import Unit

__all__ = ["DEFAULT_BUCKET_BYTES", "MAX_REDUCES_IN_FLIGHT", "GradBuckets"]

#: Units whose gradients (stages 2, 3) may wait in scratch for their reduce-scatter at once,
#: or more while they fit in one bucket (see [Note: gradient buckets]).
MAX_REDUCES_IN_FLIGHT = 2

#: `zero.reduce_bucket_size`'s default, for stages built without a config.
DEFAULT_BUCKET_BYTES = 25 * 2**20


@dataclass(frozen=True, slots=True)
class _GradReduce:
    """One unit's gradient on its way to the owned slice, with the scratch it reads and writes."""

    unit: Unit
    full: torch.Tensor
    part: torch.Tensor
    final: bool
    """No other use of the unit is left in this backward: its gradient is complete once this lands."""


@dataclass(frozen=True, slots=True)
class _ReduceBucket:
    """Units reduce-scattered in one collective (see [Note: gradient buckets])."""

    jobs: list[_GradReduce]
    pending: C.Pending


class Reducing(Protocol):
    """What the buckets ask of a stage (`tierzero.stages.base.Stage` is one)."""

    comm: C.CommGroup
    replica: C.CommGroup | None
    grad_hops: GradHops | None
    overlap: bool
    plan: SlicePlan
    store: SliceStore

    def scratch(self, unit: Unit, numel: int, dtype: torch.dtype, *, kind: Kind = ...) -> torch.Tensor: ...

    def land_grad(self, unit: Unit, part: torch.Tensor, *, final: bool) -> None: ...


class GradBuckets:
    """Units' gradients in scratch, reduce-scattered together (see the module note), landed in order."""

    def __init__(self, stage: Reducing, *, bucket_bytes: int) -> None:
        self._stage, self._bucket_bytes = stage, bucket_bytes
        self._unsent: list[_GradReduce] = []
        self._reduces: deque[_ReduceBucket] = deque()

    def add(self, unit: Unit, grads: list[torch.Tensor], *, final: bool) -> None:
        """Flatten `grads` into scratch and queue the unit's reduce-scatter."""
        stage = self._stage
        dtype = stage.plan.dtype(unit.name, Kind.GRAD)
        if self._unsent and self._unsent[0].full.dtype != dtype:
            self._send()  # one collective moves one dtype
        full = stage.scratch(unit, unit.padded_numel, dtype, kind=Kind.GRAD)
        unit.flatten(grads, out=full)
        part = stage.scratch(unit, unit.shard_numel, dtype, kind=Kind.GRAD)
        self._unsent.append(_GradReduce(unit=unit, full=full, part=part, final=final))
        if sum(job.full.nbytes for job in self._unsent) >= self._bucket_bytes:
            self._send()
        while self._backlog_full():
            self._finish_oldest()

    def finish(self) -> None:
        """Send what waits and land every reduce."""
        self._send()
        while self._reduces:
            self._finish_oldest()

    def _backlog_full(self) -> bool:
        """More units wait in gradient scratch than both bounds allow (see the module note)."""
        jobs = self._unsent + [job for bucket in self._reduces for job in bucket.jobs]
        return len(jobs) > MAX_REDUCES_IN_FLIGHT and sum(job.full.nbytes for job in jobs) > self._bucket_bytes

    def _send(self) -> None:
        if not self._unsent:
            return
        jobs, self._unsent = self._unsent, []
        fulls, parts = [job.full for job in jobs], [job.part for job in jobs]
        stage = self._stage
        if stage.grad_hops is not None:
            pending = reduce_scatter_hierarchical(parts, fulls, hops=stage.grad_hops, async_op=stage.overlap)
        elif stage.replica is None:
            pending = C.reduce_scatter_many(parts, fulls, comm=stage.comm, async_op=stage.overlap)
        else:
            pending = reduce_scatter_replicated(
                parts, fulls, shard=stage.comm, replica=stage.replica, async_op=stage.overlap
            )
        self._reduces.append(_ReduceBucket(jobs=jobs, pending=pending))

    def _finish_oldest(self) -> None:
        if not self._reduces:
            self._send()
        bucket = self._reduces.popleft()
        bucket.pending.wait()
        for job in bucket.jobs:
            self._stage.land_grad(job.unit, job.part, final=job.final)
            self._stage.store.free(job.part)
            self._stage.store.free(job.full)
