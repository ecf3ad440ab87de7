"""Stage 1: optimizer states sharded; full parameters and full gradients on every rank.

Gradients accumulate into the unit's full GRAD buffer over the micro-steps. In the
last micro-step's backward, once a unit's last use has its gradients, it joins the
bucket of units ready to reduce; a full bucket (see [Note: gradient buckets] in
stages/base.py) starts one reduce-scatter that leaves this rank's summed slices in
their own ranges of those buffers, overlapped with the rest of backward when
`overlap` is on, and the step sends what is left. The optimizer steps the owned
slices, and the updated slices go back into the full parameters by all-gathers
bucketed the same way, finishing while the next forward reaches the units.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from tierzero.comm import collectives as C
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.stages.base import Stage, mark_state
from tierzero.stages.binding import bind
from tierzero.stages.options import StageOptions, StageParts
from tierzero.stages.step import StepScalars
from tierzero.stages.step_pipeline import PendingWrite
from tierzero.units.unit import Unit, UnitState


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

    def __init__(self, parts: StageParts, options: StageOptions) -> None:
        super().__init__(parts, options)
        elsewhere = self.homes.tiers("params") - {Tier.DEVICE}
        if elsewhere:
            raise ValueError(
                f"zero.stage {self.number} keeps full parameters on the device, got offload.params "
                f"{', '.join(sorted(t.value for t in elsewhere))}: set offload.params to device or use zero.stage 3"
            )
        self._gathers: dict[str, _InFlight] = {}
        self._unpublished: list[tuple[Unit, torch.Tensor]] = []
        """Updated slices waiting for their bucket's all-gather."""

    def unshard(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERED:
            if any(waiting is unit for waiting, _ in self._unpublished):
                self._send_gathers()
            gather = self._gathers.pop(unit.name, None)
            if gather is not None:
                gather.pending.wait()
            return
        key = SliceKey(unit.name, Kind.PARAM)
        unit.gathered = self.store.fetch(key, to=Tier.DEVICE).wait()
        if self.codec(unit) is not None:
            # Its codes stay home; the dequantized buffer lives until the unit's uses are done (`_drop_decoded`).
            codes, unit.gathered = unit.gathered, self.scratch(unit, unit.padded_numel, self.dtype_of(unit))
            self.decode(unit, codes, out=unit.gathered)
            self.store.release(key)
        mark_state(unit, UnitState.GATHERED)

    def post_forward(self, unit: Unit, output: Any) -> None:
        if not torch.is_grad_enabled():
            self._drop_decoded(unit)  # no backward will read it

    def after_backward(self) -> None:
        super().after_backward()
        for unit in self.units:
            self._drop_decoded(unit)

    def _drop_decoded(self, unit: Unit) -> None:
        """Free a quantized frozen unit's dequantized buffer: the next forward dequantizes it again."""
        if unit.state is UnitState.GATHERED and self.codec(unit) is not None:
            assert unit.gathered is not None
            bind(unit, [unit.gathered[:0]] * len(unit.slots))
            self.store.free(unit.gathered)
            unit.gathered = None
            mark_state(unit, UnitState.SHARDED)

    def finish(self, *, closing: bool = False) -> None:
        super().finish(closing=closing)
        self._send_gathers()
        for gather in self._gathers.values():
            gather.pending.wait()
        self._gathers.clear()

    @contextmanager
    def _master(self, unit: Unit, *, write: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.mixed(unit):
            with super()._master(unit, write=write) as pair:
                yield pair
            return
        self.unshard(unit)
        assert unit.gathered is not None
        start, end = unit.shard_range(self.comm.rank)
        yield unit.gathered[start:end], unit.gathered

    def publish(self, unit: Unit, master: torch.Tensor, *, cast: torch.Tensor | None = None) -> list[PendingWrite]:
        """Queue the all-gather of the updated slice into the full compute-dtype parameters."""
        self.unshard(unit)
        assert unit.gathered is not None
        if self.comm.world_size == 1 and not self.mixed(unit):
            # The full buffer is the fp32 parameters: the stepped slice is, or goes back into, it.
            if master.data_ptr() != unit.gathered.data_ptr():
                unit.gathered.copy_(master)
            return []
        fresh = master if cast is None else cast
        self._unpublished.append((unit, fresh.to(device=self.device, dtype=self.dtype_of(unit), copy=cast is None)))
        if sum(u.gathered.nbytes for u, _ in self._unpublished if u.gathered is not None) >= self.bucket_bytes:
            self._send_gathers()
        return []

    def step(self, scalars: StepScalars, *, clip_coef: float) -> None:
        super().step(scalars, clip_coef=clip_coef)
        self._send_gathers()

    def _send_gathers(self) -> None:
        if not self._unpublished:
            return
        units, shards = zip(*self._unpublished, strict=True)
        self._unpublished = []
        outputs = [unit.gathered for unit in units]
        pending = C.all_gather_many(outputs, shards, comm=self.comm, async_op=self.overlap)
        for unit, shard in zip(units, shards):
            self._gathers[unit.name] = _InFlight(pending=pending, buffer=shard)


class Stage1(ReplicatedParamsStage):
    number = 1
    shards_grads = False

    def __init__(self, parts: StageParts, options: StageOptions) -> None:
        super().__init__(parts, options)
        self._scatters: dict[str, _InFlight] = {}
        self._ready: list[Unit] = []
        """Units whose gradients are complete, waiting for their bucket's reduce-scatter."""

    def post_backward(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        with self.slice(unit, Kind.GRAD, write=True) as full:
            for slot, grad in zip(unit.slots, grads, strict=True):
                full.narrow(0, slot.offset, slot.numel).add_(grad.reshape(-1))
            itemsize = full.element_size()
            if self.comm.world_size == 1 and unit.pending_uses == 0:
                self.note_grad(unit, full)  # one rank: the sum is complete here, no scatter follows
        if self.last_micro_step and unit.pending_uses == 0 and self.comm.world_size > 1:
            self._ready.append(unit)
            if sum(u.padded_numel for u in self._ready) * itemsize >= self.bucket_bytes:
                self._send_scatters()

    def _send_scatters(self) -> None:
        """Start one reduce-scatter over the full GRAD buffers of the ready units."""
        if not self._ready:
            return
        units, self._ready = self._ready, []
        # The fetched GRAD tensors may be read after their slice() blocks end: stage 1
        # gradients live on the device tier (the config offloads gradients from stage 2
        # on), so each is its home tensor and stays valid.
        with ExitStack() as stack:
            fulls = [stack.enter_context(self.slice(unit, Kind.GRAD, write=False)) for unit in units]
        parts = [self.scratch(unit, unit.shard_numel, full.dtype, kind=Kind.GRAD) for unit, full in zip(units, fulls)]
        pending = C.reduce_scatter_many(parts, fulls, comm=self.comm, async_op=self.overlap)
        for unit, part in zip(units, parts):
            self._scatters[unit.name] = _InFlight(pending=pending, buffer=part)

    def prepare_grads(self) -> None:
        if self.comm.world_size == 1:
            return  # one rank's reduce-scatter is the identity: its slice is the whole buffer
        # Units whose backward did not queue a reduce-scatter (no use reached the loss)
        # join the last bucket, in unit order, the same on every rank.
        self._ready += [u for u in self.trained if u.name not in self._scatters and u not in self._ready]
        self._send_scatters()
        for unit in self.trained:
            scatter = self._scatters.pop(unit.name)
            scatter.pending.wait()
            with self.slice(unit, Kind.GRAD, write=True) as full:
                self.grad_slice(full, unit).copy_(scatter.buffer)
                if unit.has_grads:
                    self.note_grad(unit, full)
            self.store.free(scatter.buffer)

    def grad_slice(self, grads: torch.Tensor, unit: Unit) -> torch.Tensor:
        start, end = unit.shard_range(self.comm.rank)
        return grads[start:end]
