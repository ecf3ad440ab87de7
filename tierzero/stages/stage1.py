"""Stage 1: optimizer states sharded; full parameters and full gradients on every rank.

Gradients accumulate into the unit's full GRAD buffer over the micro-steps. In the
last micro-step's backward, as soon as a unit's last use has its gradients, one
reduce-scatter leaves this rank's summed slice in its own range of that buffer
(overlapped with the rest of backward when `overlap` is on); the optimizer steps the
owned slice, and one all-gather per unit brings every rank's updated slice back into
the full parameters, finishing while the next forward reaches the unit.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from tierzero import comm as C
from tierzero.offload.base import Kind, SliceKey, Tier
from tierzero.offload.optimizer_step import PendingWrite
from tierzero.stages.base import Stage, mark_state
from tierzero.units import Unit, UnitState


@dataclass(frozen=True, slots=True)
class _InFlight:
    """A collective still running, with the buffer it reads or writes kept alive."""

    pending: C.Pending
    buffer: torch.Tensor


class ReplicatedParamsStage(Stage):
    """What stages 1 and 2 share: the full parameters stay fetched on the device for good.

    The config only lets stage 3 offload parameters, so PARAM lives on the device tier
    here and the fetch is the home tensor itself; it is fetched once, at first use.
    """

    shards_params = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        if self.homes.params is not Tier.DEVICE:
            raise ValueError(
                f"zero.stage {self.number} keeps full parameters on the device, got offload.params "
                f"{self.homes.params.value}: set offload.params to device or use zero.stage 3"
            )
        self._gathers: dict[str, _InFlight] = {}

    def unshard(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERED:
            gather = self._gathers.pop(unit.name, None)
            if gather is not None:
                gather.pending.wait()
            return
        unit.gathered = self.store.fetch(SliceKey(unit.name, Kind.PARAM), to=Tier.DEVICE).wait()
        mark_state(unit, UnitState.GATHERED)

    def finish(self) -> None:
        super().finish()
        for gather in self._gathers.values():
            gather.pending.wait()
        self._gathers.clear()

    @contextmanager
    def _master(self, unit: Unit, *, write: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.mixed:
            with super()._master(unit, write=write) as pair:
                yield pair
            return
        self.unshard(unit)
        assert unit.gathered is not None
        start, end = unit.shard_range(self.comm.rank)
        yield unit.gathered[start:end], unit.gathered

    def publish(self, unit: Unit, master: torch.Tensor) -> list[PendingWrite]:
        """Start the all-gather of the updated slices into the full compute-dtype parameters."""
        self.unshard(unit)
        assert unit.gathered is not None
        if self.comm.world_size == 1 and not self.mixed:
            # The full buffer is the fp32 parameters: the stepped slice is, or goes back into, it.
            if master.data_ptr() != unit.gathered.data_ptr():
                unit.gathered.copy_(master)
            return []
        shard = master.to(device=self.device, dtype=self.param_dtype, copy=True)
        pending = C.all_gather(unit.gathered, shard, comm=self.comm, async_op=self.overlap)
        self._gathers[unit.name] = _InFlight(pending=pending, buffer=shard)
        return []


class Stage1(ReplicatedParamsStage):
    number = 1
    shards_grads = False

    def __init__(self, **kwargs: object) -> None:
        super().__init__(**kwargs)
        self._scatters: dict[str, _InFlight] = {}

    def post_backward(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        with self.slice(unit, Kind.GRAD, write=True) as full:
            for slot, grad in zip(unit.slots, grads, strict=True):
                full.narrow(0, slot.offset, slot.numel).add_(grad.reshape(-1))
            if self.last_micro_step and unit.pending_uses == 0 and self.comm.world_size > 1:
                self._scatters[unit.name] = self._start_scatter(unit, full)

    def _start_scatter(self, unit: Unit, full: torch.Tensor) -> _InFlight:
        # `full` may be read after its slice() block ends: stage 1 gradients live on the
        # device tier (the config offloads gradients from stage 2 on), so the fetched
        # tensor is the home tensor and stays valid.
        part = self.scratch(unit, unit.shard_numel, full.dtype, kind=Kind.GRAD)
        return _InFlight(pending=C.reduce_scatter(part, full, comm=self.comm, async_op=self.overlap), buffer=part)

    def prepare_grads(self) -> None:
        if self.comm.world_size == 1:
            return  # one rank's reduce-scatter is the identity: its slice is the whole buffer
        # Units whose backward did not start a reduce-scatter (no use reached the loss)
        # reduce here, in unit order, the same on every rank.
        for unit in self.units:
            with self.slice(unit, Kind.GRAD, write=True) as full:
                scatter = self._scatters.pop(unit.name, None) or self._start_scatter(unit, full)
                scatter.pending.wait()
                self.grad_slice(full, unit).copy_(scatter.buffer)
                self.store.free(scatter.buffer)

    def grad_slice(self, grads: torch.Tensor, unit: Unit) -> torch.Tensor:
        start, end = unit.shard_range(self.comm.rank)
        return grads[start:end]
