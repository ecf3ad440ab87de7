"""What stages 1, 2 and 3 share: slice registration, the gradients' way home, the optimizer step.

Parameters reach the modules through stages/binding.py ([Note: binding parameters]).
The gradients go home through `GradBuckets` (stages/grad_buckets.py, [Note: gradient buckets])
and land where `GradLanding` (stages/grad_landing.py) puts them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any, ClassVar

import torch

from tierzero.comm import collectives as C
from tierzero.common.cgroup import host_headroom
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.optim.flat import FlatOptimizer
from tierzero.optim.moments import SIGNED, MomentFormat
from tierzero.stages.activations import recomputing
from tierzero.stages.binding import UnitParams, bind
from tierzero.stages.grads.buckets import GradBuckets
from tierzero.stages.grads.held import HeldGrads
from tierzero.stages.grads.landing import GradLanding
from tierzero.stages.grads.norm import GradNorm
from tierzero.stages.options import StageOptions, StageParts
from tierzero.stages.plan import Homes, SlicePlan, SliceSpec, plan_slices
from tierzero.stages.step import BackwardStep, StepScalars, run_step
from tierzero.stages.step_pipeline import PendingWrite, PipelineReport, Prepared
from tierzero.units.decode_ahead import DecodeAhead
from tierzero.units.quantized_base import BaseCodec, CodesInFlight
from tierzero.units.unit import Unit, UnitState


class Stage(GradLanding, ABC):
    """One ZeRO stage over a list of units; every slice is reached through the store."""

    number: ClassVar[int]
    shards_grads: ClassVar[bool]
    shards_params: ClassVar[bool]

    def __init__(self, parts: StageParts, options: StageOptions) -> None:
        self.units, self.plan, self.store, self.comm = parts.units, parts.plan, parts.store, parts.comm
        self.optimizer: FlatOptimizer = parts.optimizer
        self.replica = parts.replica
        """Hybrid sharding: the ranks holding this rank's shards, over which gradients are summed too."""
        self.grad_hops = parts.grad_hops
        """qgZ: the gradients' reduce-scatter in two hops ([Note: qgZ] in quantized_comm.py)."""
        self.homes: Homes = parts.homes
        self.param_dtype, self.device, self.overlap = options.param_dtype, options.device, options.overlap
        self.bucket_bytes = options.bucket_bytes
        """Collectives wait for this many bytes of ready units before they start (`zero.reduce_bucket_size`)."""
        self._buckets = GradBuckets(self, bucket_bytes=options.bucket_bytes)
        self.activations = parts.activations
        """Books (or offloads) what autograd saves in forward; None: nothing counted (tierzero/stages/activations.py)."""
        self.last_micro_step = True
        """Set by the engine before each backward: this micro-step ends an accumulation window."""
        self._anchor = torch.empty(0, device=self.device, requires_grad=True)
        self.last_step_report: PipelineReport | None = None
        """What the last optimizer step's pipeline did (resident groups, seconds waiting on reads)."""
        self._backward_step: BackwardStep | None = None
        """The step run during this backward, when the engine asked for one."""
        self.grad_norm = GradNorm()
        """The squares of this step's gradients, added as each lands (stages/grad_norm.py)."""
        self.held_grads = HeldGrads(self.store, headroom=_unbounded if self.device.type == "meta" else host_headroom)
        """Units' gradients kept as autograd made them for the step after backward ([Note: held gradient pieces])."""
        self._codes_gathering: dict[str, CodesInFlight] = {}
        """A quantized frozen unit's gathered codes, by unit, until `decode_gathered` dequantizes them."""
        self._decoder = DecodeAhead()
        """The thread quantized units are decoded on ahead of their use (units/decode_ahead.py)."""

    # ---- slices -------------------------------------------------------------------

    @classmethod
    def plan_slices(
        cls,
        units: list[Unit],
        *,
        param_dtype: torch.dtype,
        grad_dtype: torch.dtype | None = None,
        state_kinds: tuple[Kind, ...],
        homes: Homes,
        secondary_parts: int = 0,
        moments: MomentFormat = MomentFormat(),
        base: BaseCodec | None = None,
    ) -> SlicePlan:
        """The slices this stage keeps per unit (see stages/plan.py): what the stage is built with."""
        return plan_slices(
            units,
            shards_params=cls.shards_params,
            shards_grads=cls.shards_grads,
            param_dtype=param_dtype,
            grad_dtype=grad_dtype,
            state_kinds=state_kinds,
            homes=homes,
            secondary_parts=secondary_parts,
            moments=moments,
            base=base,
        )

    def slice_specs(self, unit: Unit) -> tuple[SliceSpec, ...]:
        """Every slice this rank keeps for the unit, with its size and home tier."""
        return self.plan.of(unit)

    def register(self, unit: Unit, values: torch.Tensor, *, offset: int = 0) -> None:
        """Register the unit's slices with the store and write their initial values.

        `values` holds the unit's fp32 parameters from element `offset` of its padded buffer:
        the whole buffer, or (where parameters are sharded) at least this rank's slice of it.
        """
        start, end = unit.shard_range(self.comm.rank)
        full = (0, unit.padded_numel) if not self.shards_params else (start, end)
        if offset > full[0] or offset + values.numel() < full[1]:
            raise ValueError(
                f"unit {unit.name}: values cover elements {offset}-{offset + values.numel()}, "
                f"this rank registers {full[0]}-{full[1]}"
            )
        initial = {
            Kind.PARAM: values[full[0] - offset : full[1] - offset],
            Kind.MASTER: values[start - offset : end - offset],
        }
        # int8 moments start as quantized zeros: the code of 0 in every element ([Note: compact moments]).
        moments = self.optimizer.moments
        for spec in self.slice_specs(unit):
            if spec.codec is not None:
                initial[spec.kind] = spec.codec.encode(initial[spec.kind], pieces=spec.parameters // unit.shard_numel)
            elif spec.elements is not None:
                initial[spec.kind] = moments.zeros(spec.parameters, signed=SIGNED[spec.kind], device=values.device)
        # Zeroed kinds share one buffer per dtype (writes only read it): set-up holds a unit's values and one zero slice.
        zeros: dict[torch.dtype, torch.Tensor] = {}
        for spec in self.slice_specs(unit):
            if spec.kind not in initial and (spec.dtype not in zeros or zeros[spec.dtype].numel() < spec.numel):
                zeros[spec.dtype] = torch.zeros(spec.numel, dtype=spec.dtype, device=values.device)
            value = initial[spec.kind].to(spec.dtype) if spec.kind in initial else zeros[spec.dtype][: spec.numel]
            self._init(SliceKey(unit.name, spec.kind), value, spec.home)
            if spec.kind is Kind.GRAD:
                unit.grads_zero = True  # registered as zeros

    def _init(self, key: SliceKey, value: torch.Tensor, home: Tier) -> None:
        self.store.register(key, numel=value.numel(), dtype=value.dtype, home=home)
        self.store.write_back(key, value.contiguous()).wait()

    @contextmanager
    def slice(self, unit: Unit, kind: Kind, *, write: bool, unread: bool = False) -> Iterator[torch.Tensor]:
        """The slice on the compute device for the duration of the block, written home if `write`.
        `unread`: the block writes every element without reading one, so a stale GRAD slice is
        handed over as it is rather than as zeros."""
        key = SliceKey(unit.name, kind)
        if kind is Kind.GRAD and unit.name in self.held_grads:
            self.land_held(unit)
        if kind is Kind.GRAD and write:
            unit.grads_zero = False  # whatever the caller does with it
        if kind is Kind.GRAD and unit.grads_stale and not unread:
            yield from self._fresh_grads(unit, key)
            return
        tensor = self.store.fetch(key, to=Tier.DEVICE).wait()
        try:
            yield tensor
            if write:
                self.store.write_back(key).wait()
        finally:
            self.store.release(key)

    def _fresh_grads(self, unit: Unit, key: SliceKey) -> Iterator[torch.Tensor]:
        """A stale GRAD slice (`Unit.grads_stale`) as zeros in scratch, written home in full, unread."""
        spec = self.plan.spec(unit.name, Kind.GRAD)
        zeros = self.scratch(unit, spec.numel, spec.dtype, kind=Kind.GRAD).zero_()
        try:
            yield zeros
            self.store.write_back(key, zeros).wait()
            unit.grads_stale = False
        finally:
            self.store.free(zeros)

    def leaves_grads_stale(self, unit: str) -> bool:
        """Whether the step leaves the unit's used GRAD slice home unzeroed (`Unit.grads_stale`) for
        the next reduce to write over, never read (stages 2 and 3): zeroing it would cost a pass over
        the gradients, and on NVMe a write and a read of zeros, for bits the next sum does not need
        ([Note: stale gradients] in grads/landing.py)."""
        return self.shards_grads

    def dtype_of(self, unit: Unit) -> torch.dtype:
        """The dtype the unit's parameters are gathered and computed in (`Unit.dtype`)."""
        return unit.dtype or self.param_dtype

    def mixed(self, unit: Unit) -> bool:
        """Whether the unit computes below fp32, from an fp32 MASTER slice of its own."""
        return self.dtype_of(unit) != torch.float32

    def scratch(self, unit: Unit, numel: int, dtype: torch.dtype, *, kind: Kind = Kind.GATHERED) -> torch.Tensor:
        """Device memory for the unit's full parameters (GATHERED) or gradients in flight (GRAD)."""
        return self.store.allocate(kind=kind, numel=numel, dtype=dtype, tier=Tier.DEVICE, label=unit.name)

    # ---- a quantized frozen base ([Note: quantized base] in units/quantized_base.py) -----

    def codec(self, unit: Unit) -> BaseCodec | None:
        """How the unit's PARAM slice is quantized; None: it holds values in the compute dtype."""
        return self.plan.spec(unit.name, Kind.PARAM).codec

    def gather_codes(self, unit: Unit, shard: torch.Tensor, comm: C.CommGroup, *, into: torch.Tensor) -> C.Pending:
        """Start the all-gather of a quantized unit's codes (its shards' bytes), which `decode_gathered`
        dequantizes into `into` (the unit's gathered buffer) once the gather is done. With one rank the
        shard is all the codes: read where it was fetched, not copied (kept until `decode_gathered`),
        and decoded from now on the decoder's thread where the native kernels take it
        ([Note: decoding ahead] in units/decode_ahead.py)."""
        if comm.world_size == 1:
            codec = self.codec(unit)
            assert codec is not None
            decoding = self._decoder.start(codec, shard, into=into, pieces=unit.world_size, what=f"unit {unit.name}")
            self._codes_gathering[unit.name] = CodesInFlight(codes=shard, owned=False, decoding=decoding)
            return C.Pending()
        codes = self.scratch(unit, shard.numel() * comm.world_size, torch.uint8)
        self._codes_gathering[unit.name] = CodesInFlight(codes=codes, owned=True)
        return C.all_gather(codes, shard, comm=comm, async_op=self.overlap)

    def decode_gathered(self, unit: Unit) -> None:
        """Dequantize the codes `gather_codes` gathered into `unit.gathered`, then free them (no-op for others)."""
        gathering = self._codes_gathering.pop(unit.name, None)
        if gathering is None:
            return
        assert unit.gathered is not None
        try:
            if gathering.decoding is None or not gathering.decoding.finish():
                self.decode(unit, gathering.codes, out=unit.gathered)
        finally:
            if gathering.owned:
                self.store.free(gathering.codes)

    def decode(self, unit: Unit, codes: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
        """A quantized unit's full codes (all its pieces) dequantized into `out`."""
        codec = self.codec(unit)
        assert codec is not None
        return codec.decode(codes, out=out, pieces=unit.world_size, what=f"unit {unit.name}")

    # ---- forward and backward -----------------------------------------------------

    @property
    def trained(self) -> list[Unit]:
        """The units the optimizer steps: all but the frozen ones."""
        return [unit for unit in self.units if unit.trainable]

    def pre_forward(self, unit: Unit, inputs: Any = ()) -> None:
        """Before the unit's module runs on `inputs` (its positional and keyword arguments); in
        backward, a checkpointed unit's recomputation, whose use was counted in forward."""
        self.unshard(unit)
        if torch.is_grad_enabled():
            self.bind_params(unit, counts_as_use=not recomputing())
        else:
            bind(unit, unit.views(unit.gathered.detach()))

    def bind_params(self, unit: Unit, *, counts_as_use: bool) -> None:
        """Bind views of the gathered buffer whose gradients reach `post_backward` (plain views for a frozen unit).

        `counts_as_use` is False for bindings whose backward may never run (stage 3's
        re-binding for activation checkpointing), so they do not hold back stage 1's
        reduce-scatter, which waits for the last use of a unit.
        """
        if not unit.trainable:
            assert unit.gathered is not None
            bind(unit, unit.views(unit.gathered.detach()))
            return
        if counts_as_use:
            unit.pending_uses += 1
        bind(unit, UnitParams.apply(self._anchor, self, unit))

    def post_forward(self, unit: Unit, output: Any) -> None:
        """Stage 3 frees the gathered parameters here; stages 1 and 2 keep them."""

    def forward_context(self) -> AbstractContextManager[None]:
        """Entered around the model's forward: the saved-tensor hooks ([Note: saved activations])."""
        if self.activations is None:
            return nullcontext()
        return torch.autograd.graph.saved_tensors_hooks(self.activations.pack, self.activations.unpack)

    def after_backward(self) -> None:
        """Called once `loss.backward()` returns: finish what the unit hooks left in flight."""
        self.finish_reduces()
        for unit in self.units:
            unit.pending_uses = 0  # uses whose output never reached the loss

    def finish(self, *, closing: bool = False) -> None:
        """Wait for every collective and write-back in flight (`closing`: the store closes next)."""
        if closing:
            self._decoder.close(gathering.decoding for gathering in self._codes_gathering.values())
        self.finish_reduces()
        if self._backward_step is not None:
            self._backward_step.abort()  # a backward that never ended: no unit is half-stepped
            self._backward_step = None
        if closing:
            self.held_grads.drop()
        self._land_last_step()

    @abstractmethod
    def unshard(self, unit: Unit) -> None:
        """Make `unit.gathered` hold the full parameters (idempotent)."""

    @abstractmethod
    def post_backward(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        """Take one use's parameter gradients (one per slot, zeros where unused)."""

    # ---- the optimizer step -------------------------------------------------------

    def prepare_grads(self) -> None:
        """Before the step: stage 1 reduce-scatters its full gradients here."""

    @abstractmethod
    def grad_slice(self, grads: torch.Tensor, unit: Unit) -> torch.Tensor:
        """This rank's summed gradient slice inside the fetched GRAD tensor."""

    def note_grad(self, unit: Unit, grads: torch.Tensor) -> None:
        """`grads` (the fetched GRAD tensor) holds the unit's summed gradient for this step."""
        if self.grad_norm.enabled and self.last_micro_step:
            self.grad_norm.add(unit.name, self.grad_slice(grads, unit))

    def grad_sq_sum(self, scale: float) -> torch.Tensor:
        """Sum of squares of this rank's scaled gradient slices, in fp32 (one 0-d tensor).

        Most units were counted as their gradients landed (`note_grad`); one whose gradient
        never completed there (a use whose output missed the loss, a unit that ran in an
        earlier micro-step only) is read here.
        """
        late = [u for u in self.trained if u.has_grads and not self.grad_norm.counted(u.name)]
        for unit in late:
            with self.slice(unit, Kind.GRAD, write=False) as grads:
                self.grad_norm.add(unit.name, self.grad_slice(grads, unit))
        total = self.grad_norm.take(device=self.device)
        return total * (scale * scale) if scale != 1.0 else total

    def zero_grads(self) -> None:
        """Drop this step's gradients (an fp16 overflow skips the step)."""
        self.grad_norm.reset()
        self.held_grads.drop()
        for unit in self.trained:
            unit.has_grads = False
            if self.leaves_grads_stale(unit.name):
                unit.grads_stale = True
                continue
            with self.slice(unit, Kind.GRAD, write=True) as grads:
                grads.zero_()
            unit.grads_zero = True

    def step(self, scalars: StepScalars, *, clip_coef: float, prepared: Sequence[Prepared] = ()) -> None:
        """Step every unit with gradients where the optimizer states live (stages/step.py)."""
        self._land_last_step()
        report = run_step(self, scalars, clip_coef=clip_coef, prepared=prepared, **self._step_hooks())
        if report.groups or self.last_step_report is None:
            self.last_step_report = report

    def begin_backward_step(self, scalars: StepScalars) -> None:
        """Step each unit during the coming backward, as soon as its gradient is complete (stage 3)."""
        self._land_last_step()
        hooks = self._step_hooks()
        self._backward_step = BackwardStep(self, scalars, written=hooks.get("written"), hand_off=hooks.get("hand_off"))

    def finish_backward_step(self) -> None:
        """Step the last unit of the backward step (after every gradient has landed)."""
        job, self._backward_step = self._backward_step, None
        if job is not None:
            # The last units' write-backs land while the caller goes on to the next batch and
            # forward: a read of one of those slices waits for its write (the swapper orders
            # a key's operations), and the next step, or close, waits for them all, so a
            # failed write still raises within one step.
            self.last_step_report = job.finish()

    def _land_last_step(self) -> None:
        if self.last_step_report is not None:
            self.last_step_report.wait()

    def _step_hooks(self) -> dict[str, Any]:
        """`first` and `written` for `run_step` (stage 3 starts the next forward's fetches from them)."""
        return {}

    @contextmanager
    def _master(self, unit: Unit, *, write: bool = True) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """(fp32 slice the optimizer steps, the fetched tensor holding it).

        The slice is MASTER in mixed precision; in fp32 the PARAM slice is its own master
        (the owned range of the full PARAM buffer in stages 1 and 2).
        """
        kind = Kind.MASTER if self.mixed(unit) else Kind.PARAM
        with self.slice(unit, kind, write=write) as fetched:
            master = fetched
            if kind is Kind.PARAM and not self.shards_params:
                start, end = unit.shard_range(self.comm.rank)
                master = fetched[start:end]
            yield master, fetched

    def cast_slice(self, unit: Unit, master: torch.Tensor) -> torch.Tensor | None:
        """Where a mixed unit's converting step casts its new parameters as it goes, `publish`'s `cast`
        (None for an fp32 unit): a slice of their own, pinned when they go up to a GPU, so that their
        copy does not block."""
        if not self.mixed(unit):
            return None
        pinned = self.device.type == "cuda" and master.device.type == "cpu"
        return torch.empty(master.numel(), dtype=self.dtype_of(unit), device=master.device, pin_memory=pinned)

    @abstractmethod
    def publish(self, unit: Unit, master: torch.Tensor, *, cast: torch.Tensor | None = None) -> list[PendingWrite]:
        """Bring the compute-dtype parameters up to date with the stepped fp32 slice (`cast`: that slice
        already in the unit's compute dtype, where the step made it on its way).

        Returns the writes it started whose sources must outlive the call.
        """

    def gather_fp32(self, unit: Unit) -> torch.Tensor:
        """The unit's full parameters in fp32 (a collective: every rank must call it).

        A frozen unit has no fp32 copy: its compute-dtype parameters, widened.
        """
        full = torch.empty(unit.padded_numel, dtype=torch.float32, device=self.device)
        if not unit.trainable:
            with self.slice(unit, Kind.PARAM, write=False) as param:
                gathered = param.clone()
                if self.shards_params:
                    gathered = torch.empty(param.numel() * self.comm.world_size, dtype=param.dtype, device=self.device)
                    C.all_gather(gathered, param.clone(), comm=self.comm)
            return full.copy_(gathered) if self.codec(unit) is None else self.decode(unit, gathered, out=full)
        with self._master(unit, write=False) as (master, _):
            C.all_gather(full, master.clone(), comm=self.comm)
        return full


def mark_state(unit: Unit, to: UnitState) -> None:
    allowed = {
        UnitState.GATHERING: (UnitState.SHARDED,),
        UnitState.GATHERED: (UnitState.GATHERING, UnitState.SHARDED),
        UnitState.SHARDED: (UnitState.GATHERED,),
    }[to]
    unit.transition(to, allowed_from=allowed)


def _unbounded() -> int:
    """The estimate's dry run: host memory as a machine with the room has it ([Note: held gradient pieces])."""
    return 1 << 62
