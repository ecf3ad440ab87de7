"""Stage 3: parameters sharded at rest, gathered per unit just in time.

Forward, per unit: all-gather before, free after. Backward, per unit: all-gather again
when the gradient of the unit's output arrives; when the unit's post-backward runs,
free the parameters and queue the gradients' reduce-scatter into the owned slice (in
buckets: see [Note: gradient buckets] in stages/base.py). Between the two,
the parameter views that autograd saved are stand-ins (see [Note: binding parameters]
in stages/binding.py), so freeing a unit really frees its memory.

The root unit (parameters outside the wrapped blocks) wraps the whole model, so it is
gathered from the start of forward to its end and again through all of backward: the
peak of gathered bytes is the root plus the units in flight, never the whole model.
Units with fewer parameters than `zero.param_persistence_threshold` are the exception
a user opts into: they stay gathered from their forward to the end of backward, which
saves their backward all-gather and costs their full size on the device meanwhile. A unit
whose gather is its PARAM home itself stays gathered so too, at no cost ([Note: homes kept across
the turn] in stages/gather_ahead.py), and the gathers ahead of the hooks are that module's.

Below the gathers, the PARAM slices themselves come up the tiers ahead of use: the
engine builds the stage with a `ParamPrefetch` (stages/param_prefetch.py), which follows the
unit order learned in the first step. Without clipping or fp16 overflow checks, the
optimizer step runs during backward: each unit steps as soon as its gradient is
complete (`BackwardStep` in stages/step.py), its states read while backward goes
on, and the next forward's first units start coming up as soon as they are stepped.

[Note: hpZ's secondary copy]
With a `secondary` group (ZeRO++ hpZ, `zero.hpz_partition_size` H: this rank's node), each
forward gather over all N ranks leaves this rank's 1/H of the gathered parameters in the
unit's SECONDARY slice, and a gather in backward (the unit's own, a recomputation, a tied
weight) all-gathers the SECONDARY slices inside the group instead: the same bytes, so the
same bits, and none of them crosses nodes. A copy serves only the backward after the
forward that wrote it (`after_backward` forgets them all): in between, no step changes
the parameters, while a unit's step in backward comes after its last use. The SECONDARY
slice is fetched when its gather starts, not ahead by the prefetcher.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from tierzero.comm import collectives as C
from tierzero.comm.quantized import all_gather_quantized
from tierzero.common.slices import Kind, SliceKey, Tier, storage_id
from tierzero.common.transfer import Transfer
from tierzero.prefetch import Phase
from tierzero.stages.activations import recomputing
from tierzero.stages.base import Stage, mark_state
from tierzero.stages.binding import InputGradHooks, SavedView, bind, tensors_in
from tierzero.stages.gather_ahead import GatherAhead
from tierzero.stages.options import StageOptions, StageParts
from tierzero.stages.param_prefetch import ParamPrefetch
from tierzero.stages.step import ForwardStep, computes_on_host
from tierzero.stages.step_in_time import StepAhead, StepInTime
from tierzero.stages.step_pipeline import PendingWrite
from tierzero.units.unit import Unit, UnitState, is_root

#: `prefetch.max_live_bytes`'s default, for stages built without a config.


class Stage3(StepInTime, GatherAhead, Stage):
    number = 3
    shards_grads = True
    shards_params = True

    def __init__(self, parts: StageParts, options: StageOptions) -> None:
        super().__init__(parts, options)
        self.weight_block = options.weight_block
        """qwZ: gathers over `comm` send int8, a scale per this many elements ([Note: qwZ] in
        quantized_comm.py); None: unquantised."""
        self.secondary = parts.secondary
        """hpZ: the group that splits each unit's secondary copy ([Note: hpZ's secondary copy])."""
        self._secondary_fresh: set[str] = set()
        """Units whose SECONDARY slice holds this step's parameters."""
        self._secondary_writes: dict[str, Transfer[None]] = {}
        """SECONDARY writes reading a gathered buffer, waited for before it is freed."""
        self._from_secondary: set[str] = set()
        """Units whose gather in flight reads their SECONDARY slice."""
        self.persistence_threshold = options.persistence_threshold
        """Units with fewer parameters stay gathered from forward to backward (`zero.param_persistence_threshold`)."""
        self.gather_ahead = options.gather_ahead
        """Block units gathered ahead of the one computing (`zero.gather_ahead`)."""
        self.gather_budget = options.gather_budget
        """Bytes the units gathered ahead may hold beyond the first (`prefetch.max_live_bytes`)."""
        # Storage address of each gathered buffer -> its unit, for the pack hook.
        self._by_storage: dict[int, Unit] = {}
        self._gathering: dict[str, C.Pending] = {}
        self._lent: dict[str, bool] = {}
        """Units whose gathered buffer is their fetched PARAM slice itself (`_lends`): whether the
        prefetcher keeps that slice for the unit's next occurrence."""
        self._empty = torch.empty(0, dtype=self.param_dtype, device=self.device)
        self._order: list[Unit] = []
        """Units in the order the last forward first ran them: what to prefetch next."""
        self._order_now: list[Unit] = []
        self._input_grads = InputGradHooks()
        """The frozen units' release hooks (`_release_after_backward`), removed as each backward ends."""
        self.param_prefetch = parts.param_prefetch
        """Fetches PARAM slices up the tiers ahead of their gathers (None: each on demand)."""
        self._phase = Phase.FORWARD
        self._forward_step: ForwardStep | None = None
        """An optimizer step deferred into the next forward (`defer_step`)."""
        self._stepping_in_forward = False
        """Whether a `ForwardStep` steps units now (it hands each unit's new parameters to the forward)."""
        self._step_ahead: StepAhead | None = None
        """The first reads of a step that waits for the end of backward (`begin_step_ahead`)."""
        if self.param_prefetch is not None:
            self.param_prefetch.blocked = self._awaits_step
        self._decoded_across = self._across_the_turn()
        """Quantized frozen units that stay gathered from their forward to their backward (`_across_the_turn`)."""
        self._kept: set[str] = set()
        """Those of them gathered now, kept since their forward: they count in no gather-ahead bound."""

    # ---- gather and free ----------------------------------------------------------

    def start_gather(self, unit: Unit) -> None:
        """Start the unit's all-gather (asynchronous when overlapping); idempotent."""
        if unit.state is not UnitState.SHARDED:
            return
        if self._forward_step is not None:
            self._forward_step.need(unit)  # its parameters are the stepped ones from here on
        mark_state(unit, UnitState.GATHERING)
        # The fetched shard is released only once the gather has read it (unshard), or, lent, at reshard.
        comm = self.comm
        if self._phase is Phase.BACKWARD and unit.name in self._secondary_fresh:
            assert self.secondary is not None
            shard, comm = self.store.fetch(SliceKey(unit.name, Kind.SECONDARY), to=Tier.DEVICE).wait(), self.secondary
            self._from_secondary.add(unit.name)
        elif self.param_prefetch is None:
            shard = self.store.fetch(SliceKey(unit.name, Kind.PARAM), to=Tier.DEVICE).wait()
        else:
            shard = self.param_prefetch.acquire(unit.name, self._phase)
        if self._lends(unit, shard, comm):
            gathered, self._gathering[unit.name] = shard, C.Pending()
            self._lent[unit.name] = False
        elif self.codec(unit) is not None:
            gathered = self.scratch(unit, unit.padded_numel, self.dtype_of(unit))
            self._gathering[unit.name] = self.gather_codes(unit, shard, comm, into=gathered)  # dequantized by unshard
        else:
            gathered, block = self.scratch(unit, unit.padded_numel, self.dtype_of(unit)), self.weight_block
            if block is not None and comm is self.comm:
                pending = all_gather_quantized(gathered, shard, comm=comm, block_size=block, async_op=self.overlap)
            else:
                pending = C.all_gather(gathered, shard, comm=comm, async_op=self.overlap)
            self._gathering[unit.name] = pending
        unit.gathered = gathered
        self._by_storage[storage_id(gathered)] = unit

    def unshard(self, unit: Unit, *, take: Callable[[SliceKey], bool] | None = None) -> None:
        """Gather the unit; `take` may take its fetched shard over once read (`ParamPrefetch.done_with`)."""
        self.start_gather(unit)
        if unit.state is UnitState.GATHERING:
            self._gathering.pop(unit.name).wait()
            self.decode_gathered(unit)
            if unit.name in self._from_secondary:
                self._from_secondary.discard(unit.name)
                self.store.release(SliceKey(unit.name, Kind.SECONDARY))
            elif unit.name in self._lent:
                # Kept for its next occurrence, or given back at reshard, once the unit is done with it.
                self._lent[unit.name] = self.param_prefetch is not None and self.param_prefetch.keeps(unit.name)
            else:
                if self.param_prefetch is None:
                    self.store.release(SliceKey(unit.name, Kind.PARAM))
                else:
                    self.param_prefetch.done_with(unit.name, take=take)
                self._keep_secondary(unit)
            mark_state(unit, UnitState.GATHERED)

    def _lends(self, unit: Unit, shard: torch.Tensor, comm: C.CommGroup) -> bool:
        """Whether the fetched shard itself is the gathered buffer, until `reshard`: one rank holds
        all of the unit (a gather would only copy it) and no step reads its PARAM slice meanwhile:
        a forward's unit is freed before backward (but a persistent one), a backward's before its
        gradient goes to its step (`post_backward`), unless its gathered copy moves down to it."""
        whole = comm.world_size == 1 and self.weight_block is None and shard.numel() == unit.padded_numel
        if not whole or shard.dtype != self.dtype_of(unit):
            return False
        if self._phase is Phase.FORWARD:
            return not (torch.is_grad_enabled() and self._persists(unit))
        return not (self._backward_step is not None and self.last_micro_step and self._moves_down(unit))

    def _keep_secondary(self, unit: Unit) -> None:
        """Write this rank's part of a forward gather to the unit's SECONDARY slice ([Note: hpZ's secondary copy])."""
        if self.secondary is None or self._phase is not Phase.FORWARD or not torch.is_grad_enabled():
            return
        assert unit.gathered is not None
        size = unit.padded_numel // self.secondary.world_size
        part = unit.gathered.narrow(0, self.secondary.rank * size, size)
        self._secondary_writes[unit.name] = self.store.write_back(SliceKey(unit.name, Kind.SECONDARY), part)
        self._secondary_fresh.add(unit.name)

    def reshard(self, unit: Unit) -> None:
        if unit.state is UnitState.GATHERING:
            self.unshard(unit)  # a prefetch nobody used: let it land, then drop it
        if unit.state is not UnitState.GATHERED:
            return
        assert unit.gathered is not None
        written = self._secondary_writes.pop(unit.name, None)
        if written is not None:
            written.wait()  # it reads the buffer freed below
        del self._by_storage[storage_id(unit.gathered)]
        self._kept.discard(unit.name)
        bind(unit, [self._empty] * len(unit.slots))
        if unit.name in self._lent:
            kept = self._lent.pop(unit.name)
            if self.param_prefetch is None:
                self.store.release(SliceKey(unit.name, Kind.PARAM))
            elif not kept:
                self.param_prefetch.give_back(unit.name)
        else:
            self.store.free(unit.gathered)
        unit.gathered = None
        mark_state(unit, UnitState.SHARDED)

    # ---- hooks --------------------------------------------------------------------

    def pre_forward(self, unit: Unit, inputs: Any = ()) -> None:
        if recomputing():
            # Activation checkpointing re-runs the unit's forward in its backward, hooks and all
            # (torch's composable checkpoint): bind the weights again, as `pre_backward` does.
            self.unshard(unit)
            self.bind_params(unit, counts_as_use=False)
            return
        self._phase = Phase.FORWARD
        super().pre_forward(unit, inputs)
        if torch.is_grad_enabled():
            if unit not in self._order_now:
                self._order_now.append(unit)
            if not unit.trainable:
                self._release_after_backward(unit, inputs)
            self._prefetch(unit, step=1)

    def _release_after_backward(self, unit: Unit, inputs: Any) -> None:
        """A frozen unit has no gradients, hence no post-backward: it is released once the gradients of its
        inputs are complete, which needs every op of its backward done. One whose inputs need no gradient
        (the first layers of a LoRA model) is released by `after_backward`, right after its backward, the last."""
        needing = [t for t in tensors_in(inputs) if t.requires_grad]
        if needing:
            self._input_grads.after_grads(needing, lambda: self.reshard(unit))

    def post_forward(self, unit: Unit, output: Any) -> None:
        if recomputing():
            return  # the unit's backward runs next and needs it gathered: post_backward releases it
        outputs = [t for t in tensors_in(output) if t.requires_grad]
        if len(outputs) == 1 and torch.is_grad_enabled():
            outputs[0].register_hook(lambda _: self.pre_backward(unit))  # once a backward, as "any" of one is
        elif outputs and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(outputs, lambda _: self.pre_backward(unit), mode="any")
        if torch.is_grad_enabled() and self._keeps_across(unit):
            self._kept.add(unit.name)
        elif not (torch.is_grad_enabled() and self._persists(unit)):
            self.reshard(unit)  # a persistent unit stays gathered for its backward (after_backward frees it)

    def pre_backward(self, unit: Unit) -> None:
        self._phase = Phase.BACKWARD
        job = self._backward_step
        if job is not None and self.last_micro_step and unit.pending_uses == 1 and not is_root(unit):
            # The unit's last use: it steps once this backward ends, so its states can come up
            # already, and its PARAM slice too (fp32: the master) once the gather has read it:
            # moved down from the gather's copy where there is room, rather than read again. Not
            # the root, whose backward starts first and ends last: it would hold a group all along.
            given: dict[Kind, Any] = {}
            self.unshard(unit, take=lambda key: self._hand_down(key, job, unit, given))
            job.expect(unit, given=given)
            self._read_ahead(job, unit)
        else:
            self.unshard(unit)
            if self._step_ahead is not None and self.last_micro_step and unit.pending_uses == 1:
                self._step_ahead.expect(unit)
        # Activation checkpointing (non-reentrant) re-runs the unit's forward without its
        # module hooks: it must find the weights bound, and requiring grad as in the first
        # forward (it checks that the same tensors get saved). Its gradients flow through
        # the first forward's graph, so this Function's backward never runs.
        if not (unit.trainable and unit.name in self._kept):  # else bound since its forward, as it found them
            with torch.enable_grad():
                self.bind_params(unit, counts_as_use=False)
        self._prefetch(unit, step=-1)

    def post_backward(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        self.reshard(unit)  # first: the step the reduce may start reads the PARAM slice a lent gather holds
        self.reduce_grads(unit, grads)

    def after_backward(self) -> None:
        super().after_backward()
        self._input_grads.clear()
        for unit in self.units:
            self.reshard(unit)
        if self._order_now:
            self._order, self._order_now = self._order_now, []
        self._secondary_fresh.clear()  # the next step changes the parameters
        if self.param_prefetch is not None:
            self.param_prefetch.end_step(keep_warm=True)
        # After end_step, so that the last units' new slices can start up for the next forward.
        self.finish_backward_step()
        if self.param_prefetch is not None and not self.last_micro_step:
            # The next micro-step's forward comes without an optimizer step in between:
            # its first units can start coming up now.
            self.param_prefetch.begin_step()

    def gather_fp32(self, unit: Unit) -> torch.Tensor:
        self.settle_step()
        if self.param_prefetch is not None:
            self.param_prefetch.end_step()  # it reads the slices itself: drop the copies fetched ahead
        return super().gather_fp32(unit)

    def finish(self, *, closing: bool = False) -> None:
        try:
            # A save or an export must see the deferred step; at close nothing can read it any more.
            self.drop_step_ahead()
            if closing:
                self.drop_step()
            else:
                self.settle_step()
        finally:
            self._input_grads.clear()
            super().finish(closing=closing)
            if self.param_prefetch is not None:
                self.param_prefetch.end_step(cut_short=closing)

    def forward_context(self) -> AbstractContextManager[None]:
        if self.param_prefetch is not None and not torch.is_grad_enabled():
            return self._reading_ahead(self.param_prefetch)
        if self.param_prefetch is not None:
            self.param_prefetch.begin_step()
        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    @contextmanager
    def _reading_ahead(self, fetches: ParamPrefetch) -> Iterator[None]:
        """A no-grad forward: its units' slices come up ahead along the order of the no-grad forwards
        before it ([Note: reading ahead without grad] in stages/param_prefetch.py)."""
        fetches.begin_reading()
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield
        except BaseException:
            try:
                for unit in self.units:
                    self.reshard(unit)  # the units whose forward never ended: no backward needs them
            finally:
                fetches.end_reading(cut_short=True)
            raise
        fetches.end_reading()

    def _pack(self, tensor: torch.Tensor) -> Any:
        try:
            unit = self._by_storage.get(storage_id(tensor))
        except (RuntimeError, NotImplementedError):
            return tensor
        saved = None if unit is None else SavedView.within(unit, tensor)
        if saved is None:  # an activation
            return tensor if self.activations is None else self.activations.pack(tensor)
        return saved

    def _unpack(self, saved: Any) -> torch.Tensor:
        if isinstance(saved, torch.Tensor):
            return saved
        if not isinstance(saved, SavedView):
            assert self.activations is not None
            return self.activations.unpack(saved)
        # Normally the output hook gathered the unit already; a parameter used outside
        # its unit's forward (a tied weight) is gathered here, on first need.
        self.unshard(saved.unit)
        return saved.view()

    # ---- step ---------------------------------------------------------------------

    def grad_slice(self, grads: torch.Tensor, unit: Unit) -> torch.Tensor:
        return grads

    def cast_slice(self, unit: Unit, master: torch.Tensor) -> torch.Tensor | None:
        """The PARAM home itself where it is host memory and the units compute on the host: its fetches are
        the home, so no copy of it is left stale, and `publish` has none to make ([Note: the converting step])."""
        if self._casts_home(unit):
            return self.store.home_tensor(SliceKey(unit.name, Kind.PARAM))
        return super().cast_slice(unit, master)

    def _casts_home(self, unit: Unit) -> bool:
        return self.mixed(unit) and not self.plan.staged(unit.name, Kind.PARAM) and computes_on_host(self.device)

    def publish(self, unit: Unit, master: torch.Tensor, *, cast: torch.Tensor | None = None) -> list[PendingWrite]:
        if not self.mixed(unit) or (cast is not None and self._casts_home(unit)):
            return []  # its own master, which the step pipeline writes home; or cast into the home (`cast_slice`)
        # Straight to the home tier in the compute dtype, without reading the old slice first.
        key = SliceKey(unit.name, Kind.PARAM)
        if cast is not None:
            value = cast  # made by the step on its way ([Note: the converting step]); pinned for a GPU
        elif self.device.type == "cuda" and master.device.type == "cpu":
            # Pinned (torch's caching host allocator), so that its copy up does not block.
            value = torch.empty(master.numel(), dtype=self.dtype_of(unit), pin_memory=True).copy_(master)
        else:
            value = master.to(self.dtype_of(unit))
        written = PendingWrite(self.store.write_back(key, value), value)
        if self._wants_new_param(unit.name):
            assert self.param_prefetch is not None
            self.param_prefetch.adopt(unit.name, self.store.adopt(key, to=Tier.DEVICE, src=value))
        return [written]
