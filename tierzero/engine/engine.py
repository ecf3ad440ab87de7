"""The training engine `tierzero.initialize` returns: forward, backward, step, reports.

The engine owns one stage (which holds the units and their hooks), one tiered store
(where every slice lives), one flat optimizer and the collective byte counter. It
decides the per-step scalars — accumulation boundary, gradient scale, clipping
coefficient, fp16 overflow — identically on every rank, and lets the stage move bytes.
"""

from __future__ import annotations

import math
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierzero.checkpoint import RootLock, ShardedCheckpoint, claim_root, probe_root
from tierzero.comm import collectives as C
from tierzero.comm import dist as D
from tierzero.comm.mesh import Mesh, build_mesh, launcher_topology
from tierzero.comm.topology import Topology
from tierzero.common.slices import IO_ALIGNMENT, Tier
from tierzero.config import Config
from tierzero.engine.materialize import flat_fp32, has_meta, materialize_rest, materialize_unit, unit_on_meta
from tierzero.engine.states import OffloadedStates, offload_states, reload_states, require_ready
from tierzero.offload.host_heap import keep_freed_memory
from tierzero.optim.flat import make_optimizer
from tierzero.optim.groups import GroupRules
from tierzero.optim.schedule import Schedule
from tierzero.optim.schedule import lr_lambda as schedule_lambda
from tierzero.optim.unit_states import states_by_tier
from tierzero.prefetch import Prefetcher
from tierzero.pretrained import PretrainedWeights
from tierzero.stages import STAGES, Homes, Stage3, StepScalars
from tierzero.stages.activations import SavedActivations, checkpoint_units
from tierzero.stages.binding import bind, unregister_params
from tierzero.stages.grads.norm import clip_coefficient
from tierzero.stages.options import StageOptions, StageParts
from tierzero.stages.param_prefetch import ParamPrefetch
from tierzero.store import TieredStore
from tierzero.store.protocol import SliceStore
from tierzero.units.kernels import use_linear_kernel
from tierzero.units.precision import autocast, dtype_of, make_loss_scaler, reads_fp32_under_autocast
from tierzero.units.quantized_base import BaseCodec
from tierzero.units.unit import Unit, plan_units


class Engine:
    """A model trained with ZeRO over tiered storage.

    While the engine lives, the parameters of `module`, trained and frozen, are not
    nn.Parameters: each unit's slots are plain tensor attributes bound by the stage (views
    of the gathered buffer during compute, empty between), so `module.parameters()` is
    empty. `full_state_dict()` is the way to read the weights. A torch optimizer over them
    would train nothing: one that steps with no parameters while an engine lives raises
    (`_refuse_parameterless_step`); tierzero.integrations drive the engine from trainers.
    """

    def __init__(
        self,
        model: nn.Module,
        cfg: Config,
        *,
        ctx: D.DistContext,
        store: SliceStore | None = None,
        mesh: Mesh | None = None,
        weights: PretrainedWeights | None = None,
        lr_lambda: Callable[[int], float] | None = None,
        homes: Homes | None = None,
        topology: Topology | None = None,
    ) -> None:
        """`store` and `mesh` default to a `TieredStore` built from `cfg` and groups over the default
        process group (tierzero/comm/mesh.py) laid out by `topology` (default: the launcher's, from
        LOCAL_WORLD_SIZE); `tierzero estimate` passes a counting store and dry-run groups.
        `weights` (checked against `model`) gives every parameter and persistent buffer its
        pretrained value, streamed unit by unit; without it a meta-built model is initialised.
        `lr_lambda(k)` multiplies `optimizer.lr` for optimizer step k (0 first), as
        `torch.optim.lr_scheduler.LambdaLR` does; default: the config's `scheduler`. `homes`: where
        each slice lives, as the placement planner chose it (tierzero/placement/planner.py);
        required when an `offload` key is auto, default: the `offload` section's tiers."""
        self.cfg, self._ctx, self._weights = cfg, ctx, weights
        # The model reaches the device unit by unit in _install, never whole: a meta-built one is
        # materialised a unit at a time (see [Note: meta init] in materialize.py), a materialised
        # one has each unit copied and its own parameters dropped in turn.
        self._meta = has_meta(model)
        self.module = model
        self.mesh = mesh or build_mesh(
            launcher_topology(world_size=ctx.world_size, rank=ctx.rank, given=topology),
            shard_group_size=cfg.zero.shard_group_size, hpz_partition_size=cfg.zero.hpz_partition_size,
            node_hops=cfg.zero.quantized_gradients != "none",
        )  # fmt: skip
        """The groups this engine sends over, and the node layout comm_report splits their bytes by."""
        self.comm = self.mesh.shard
        """What ZeRO shards over: the whole job, or this rank's shard group (hybrid sharding)."""
        self.global_step = 0
        self.grad_norm: float | None = None
        """The last optimizer step's gradient norm before clipping (inf on an fp16 overflow); None where the
        step did not need it (no clipping, no fp16), since the norm costs a pass over the gradients."""
        self.run_id = secrets.token_hex(8)
        """Which run this engine's checkpoints belong to: new for a fresh run, taken from the checkpoint a load resumes."""
        self._lr_lambda = lr_lambda or schedule_lambda(Schedule.of(cfg.scheduler, train_steps=cfg.train.steps))
        self.lr = self._scheduled_lr()
        """The learning rate of the next optimizer step (a checkpoint saves and restores it)."""
        self._micro_steps = 0
        self._param_names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
        self._param_dtype = dtype_of(cfg.precision.param_dtype)
        self._scaler = make_loss_scaler(cfg.precision)
        # Only fp16 can overflow where fp32 would not; bf16 shares fp32's exponent range.
        self._skips_overflow = self._param_dtype == torch.float16
        rules = GroupRules.from_config(cfg.optimizer)
        self.units = plan_units(
            model, world_size=self.comm.world_size, unit_classes=list(cfg.zero.unit_classes), group_of=rules.group_of,
            quant_block=cfg.zero.quant_block, keep_fp32=reads_fp32_under_autocast if cfg.precision.autocast else None,
        )  # fmt: skip
        stage_class = STAGES[cfg.zero.stage]
        optimizer = make_optimizer(cfg.optimizer, rules.groups)
        homes = homes or Homes.configured(cfg.offload)
        self.placement: Any = None
        """The planner's `PlacementPlan` when it chose `homes` (set by `tierzero.initialize`), else None."""
        self.plan = stage_class.plan_slices(
            self.units, param_dtype=self._param_dtype, state_kinds=optimizer.state_kinds, homes=homes,
            moments=optimizer.moments,
            grad_dtype=dtype_of(cfg.precision.reduce_dtype or cfg.precision.param_dtype),
            secondary_parts=self.mesh.secondary_parts,
            base=BaseCodec.of(cfg.model.lora.quantized(cfg.precision.param_dtype), double_quant=cfg.model.lora.double_quant),
        )  # fmt: skip
        self.store = store if store is not None else self._make_store()
        self._hooks: list[Any] = []
        self._closed = False
        self._offloaded: OffloadedStates | None = None
        self._root_locks: dict[Path, RootLock | None] = {}
        """Checkpoint roots this engine saves into, each locked against other runs until close."""
        try:
            self.param_prefetch: ParamPrefetch | None = self._make_prefetch() if stage_class.shards_params else None
            parts = StageParts(
                units=self.units, plan=self.plan, store=self.store, comm=self.comm, optimizer=optimizer, homes=homes,
                activations=self._saved_activations(), replica=self.mesh.replica,
                grad_hops=self.mesh.grad_hops(cfg.zero.quantized_gradients, block_size=cfg.zero.quant_block),
                secondary=self.mesh.secondary if stage_class.shards_params else None,
                param_prefetch=self.param_prefetch,
            )  # fmt: skip
            options = StageOptions.from_config(cfg, param_dtype=self._param_dtype, device=ctx.device)
            self.stage = stage_class(parts, options)
            self.stage.grad_norm.enabled = float(cfg.gradient_clipping) > 0 or self._skips_overflow
            self._install()
            self._hooks.append(register_optimizer_step_pre_hook(_refuse_parameterless_step))
            if self._ctx.device.type != "meta":  # see [Note: freed host memory]
                keep_freed_memory(cfg.tiers.cpu.keep_freed)
        except BaseException:
            # A tier that is too small fails here: leave no swap file or group behind.
            self.close()
            raise

    # ---- set-up -------------------------------------------------------------------

    def _make_store(self) -> TieredStore:
        # Unless the config sizes the swap file, it holds exactly this rank's NVMe-homed slices.
        capacity = max(self.plan.home_bytes(Tier.NVME), IO_ALIGNMENT) if self.cfg.tiers.nvme.capacity is None else None
        return TieredStore.from_config(
            self.cfg.tiers, self.cfg.swapper, nvme=any(spec.home is Tier.NVME for spec in self.plan.all()),
            rank=self._ctx.rank, device=self._ctx.device, nvme_capacity=capacity,
        )  # fmt: skip

    def _saved_activations(self) -> SavedActivations | None:
        """Counted (and offloaded) where the `activations` section asks for it (tierzero/stages/activations.py)."""
        acts = self.cfg.activations
        if acts.checkpoint == 0 and acts.offload == "none":
            return None
        return SavedActivations(self.store, offload=acts.offload == "cpu")

    def _make_prefetch(self) -> ParamPrefetch:
        """Stage 3 fetches parameter slices ahead of their gathers, within `cfg.prefetch`'s budgets."""
        policy = Prefetcher.from_config(self.cfg.prefetch, unit_bytes=self.plan.fetched_param_bytes())
        return ParamPrefetch(store=self.store, policy=policy)

    def _install(self) -> None:
        empty = torch.empty(0, dtype=self._param_dtype, device=self._ctx.device)
        for index, unit in enumerate(self.units):
            values, offset = self._unit_values(index, unit)
            self.stage.register(unit, values, offset=offset)
            # The store holds this rank's slices now; the unit's values must not outlive this pass.
            del values
            unregister_params(unit)
            bind(unit, [empty] * len(unit.slots))
            self._hooks.append(unit.module.register_forward_pre_hook(self._pre_hook(unit), with_kwargs=True))
            self._hooks.append(unit.module.register_forward_hook(self._post_hook(unit)))
        checkpoint_units(self.units, int(self.cfg.activations.checkpoint))  # inside the unit hooks
        use_linear_kernel(self.module, self.cfg.precision.linear_kernel)
        if self._meta and self._ctx.device.type != "meta":
            materialize_rest(self.module, seed=int(self.cfg.train.seed) + len(self.units))
        if self._weights is not None:
            self._weights.load_rest(self.module)
            self._weights.close()
        self.module.to(self._ctx.device)  # what no unit took: frozen parameters and buffers

    def _unit_values(self, index: int, unit: Unit) -> tuple[torch.Tensor, int]:
        """(the unit's fp32 values on the device, the element of its padded buffer they start at)."""
        device = self._ctx.device
        if device.type == "meta":
            # The estimator's dry run: shapes only, no values to initialise or share.
            return torch.empty(unit.padded_numel, dtype=torch.float32, device="meta"), 0
        if self._weights is not None:
            # Pretrained files: each rank reads only what it keeps (its slice, where parameters are sharded).
            start, end = unit.shard_range(self.comm.rank) if self.stage.shards_params else (0, unit.padded_numel)
            return self._weights.unit_range(unit, start=start, end=end).to(device), start
        if unit_on_meta(unit):
            return materialize_unit(self.module, unit, seed=int(self.cfg.train.seed) + index).to(device), 0
        full = flat_fp32(unit, device=device)
        if self.mesh.data_parallel_size > 1:
            # Every rank starts from rank 0's weights, as DistributedDataParallel does.
            torch.distributed.broadcast(full, src=0)
        return full, 0

    def _pre_hook(self, unit: Unit) -> Callable[..., None]:
        return lambda _module, args, kwargs: self.stage.pre_forward(unit, (args, kwargs))

    def _post_hook(self, unit: Unit) -> Callable[..., None]:
        return lambda _module, _args, output: self.stage.post_forward(unit, output)

    # ---- training -----------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self._require_open("a forward")
        with self.stage.forward_context(), autocast(self._ctx.device, self.cfg.precision):
            return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self._require_open("backward()")
        self._settle_step()
        scale = self._scaler.scale
        self.stage.last_micro_step = (self._micro_steps + 1) % self.cfg.gradient_accumulation_steps == 0
        if self.stage.last_micro_step and self._steps_in_backward():
            # Nothing of the step waits for all gradients: each unit steps as soon as its own
            # gradient is complete, overlapping the rest of backward; step() then only counts.
            grad_scale = 1.0 / (self.mesh.data_parallel_size * self.cfg.gradient_accumulation_steps * scale)
            self.stage.begin_backward_step(self._scalars(grad_scale))
        elif self.stage.last_micro_step and isinstance(self.stage, Stage3) and self.cfg.zero.overlap_step:
            # The step waits for every gradient: its first units' states are read while backward ends.
            self.stage.begin_step_ahead(in_forward=self.cfg.zero.step_in_forward)
        (loss * scale if scale != 1.0 else loss).backward()
        self.stage.after_backward()

    def step(self) -> None:
        """Count one micro-step; at each accumulation boundary step the optimizer and clear grads."""
        self._require_open("step()")
        self._micro_steps += 1
        if self._micro_steps % self.cfg.gradient_accumulation_steps:
            return
        self.stage.prepare_grads()
        grad_scale = 1.0 / (self.mesh.data_parallel_size * self.cfg.gradient_accumulation_steps * self._scaler.scale)
        clip = float(self.cfg.gradient_clipping)
        norm = self._global_grad_norm(grad_scale) if clip > 0 or self._skips_overflow else 0.0
        self.grad_norm = norm if clip > 0 or self._skips_overflow else None
        if self._skips_overflow:
            # The norm is all-reduced, so every rank sees the same overflow and skips together.
            overflow = not math.isfinite(norm)
            self._scaler.update(overflow)
            if overflow:
                self.stage.zero_grads()
                return
        if isinstance(self.stage, Stage3) and self.cfg.zero.step_in_forward:
            self.stage.defer_step(self._scalars(grad_scale), clip_coef=clip_coefficient(norm, clip))
        else:
            self.stage.step(self._scalars(grad_scale), clip_coef=clip_coefficient(norm, clip))
        self.global_step += 1
        self.lr = self._scheduled_lr()

    def _scheduled_lr(self) -> float:
        return float(self.cfg.optimizer.lr) * float(self._lr_lambda(self.global_step))

    def _scalars(self, grad_scale: float) -> StepScalars:
        factor = float(self._lr_lambda(self.global_step))
        return StepScalars(grad_scale=grad_scale, step=self.global_step + 1, lr_factor=factor)

    def _steps_in_backward(self) -> bool:
        """Stage 3 without clipping (or with it, speculated: stages/speculative.py) or fp16 overflow checks."""
        no_global = not self._skips_overflow and (float(self.cfg.gradient_clipping) <= 0 or self.cfg.zero.step_schedule == "speculative")
        return isinstance(self.stage, Stage3) and self.cfg.zero.overlap_step and no_global

    def _settle_step(self) -> None:  # stage 3 may owe the last step to units no forward reached yet
        if isinstance(self.stage, Stage3):
            self.stage.settle_step()

    def _global_grad_norm(self, grad_scale: float) -> float:
        """‖g‖ over all ranks: one all-reduce of this rank's sum of squares."""
        sq = self.stage.grad_sq_sum(grad_scale)
        C.all_reduce(sq, comm=self.comm)
        if sq.is_meta:
            return 0.0  # the estimator's dry run holds no values: a finite norm, as most steps have
        total = sq.item()
        return math.sqrt(total) if math.isfinite(total) else math.inf

    # ---- state and reports --------------------------------------------------------

    @property
    def loss_scaler(self) -> Any:
        """The `tierzero.units.precision` loss scaler (static 1.0 unless fp16): its state is part of a checkpoint."""
        return self._scaler

    @property
    def micro_steps(self) -> int:
        """Micro-steps counted by `step()`; a multiple of the accumulation steps at a boundary."""
        return self._micro_steps

    @micro_steps.setter
    def micro_steps(self, value: int) -> None:
        # Only a checkpoint load sets it, together with global_step.
        self._micro_steps = value

    def save_checkpoint(self, root: str | os.PathLike[str] | None = None, *, keep: int | None = None) -> Path:
        """Save this step under `root` (default checkpoint.dir), keeping the newest `keep` (default checkpoint.keep).

        Collective: every rank calls it after the same `step()`. See tierzero/checkpoint/save_load.py.
        """
        self._require_open("save_checkpoint()")
        self._settle_step()
        path = self.claim_checkpoint_root(root)
        keep = self.cfg.checkpoint.keep if keep is None else keep
        # Hybrid sharding: one replica's shards are the whole state; the first replica saves them.
        return self.mesh.on_first_replica(lambda: ShardedCheckpoint(keep=keep).write(self, path), share=True)

    def claim_checkpoint_root(self, root: str | os.PathLike[str] | None = None, *, fresh: bool = False) -> Path:
        """Lock the checkpoint root (default checkpoint.dir) for this engine's life, and check one
        checkpoint fits in it; idempotent. Collective. `fresh`: a run that resumes nothing, refused
        in a root that holds another run's checkpoints (`refuse_used_root`).

        Another run that saves into the same root is then refused in one line naming this one,
        so neither prunes the other's saves. `save_checkpoint` claims its root on first use;
        `tierzero train` claims before the first step, so that a second run stops at once.
        """
        path = Path(os.path.abspath(self._checkpoint_root(root)))
        if path not in self._root_locks:
            probe_root(path)  # made 0700 if new, and a probe written: what fails says why
            self._root_locks[path] = self.mesh.on_first_replica(lambda: claim_root(self, path, fresh=fresh))
        return path

    def load_checkpoint(self, root: str | os.PathLike[str] | None = None) -> Path:
        """Load the checkpoint `root` names, or the newest complete one under it (default checkpoint.dir).

        Sets `global_step`; raises FileNotFoundError when there is none. Collective.
        """
        self._require_open("load_checkpoint()")
        self._settle_step()  # not to overwrite the loaded slices later
        return ShardedCheckpoint().read(self, self._checkpoint_root(root))

    def _checkpoint_root(self, root: str | os.PathLike[str] | None) -> Path:
        if root is not None:
            return Path(root)
        if self.cfg.checkpoint.dir is None:
            raise ValueError("no checkpoint directory: pass one, or set checkpoint.dir in the config")
        return Path(self.cfg.checkpoint.dir)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full fp32 parameters by the model's names, on CPU, on rank 0 (None elsewhere). Collective."""
        self._require_open("full_state_dict()")
        out: dict[str, torch.Tensor] = {}
        for unit in self.units:
            full = self.stage.gather_fp32(unit)
            if self._ctx.rank == 0:
                for slot in unit.slots:
                    value = slot.view(full).detach().to("cpu", copy=True)
                    for b in slot.bindings:
                        out[b.name] = value
        if self._ctx.rank != 0:
            return None
        return {name: out[name] for name in self._param_names}

    def memory_report(self) -> dict[str, Any]:
        return {
            **self.store.report().summary(self.store.kind_bytes()),
            # Where each kind lives, by tier: the config's `offload` or the planner's choice, unit by unit.
            "placement": self.plan.bytes_by_home(),
            "optimizer_states": states_by_tier(self.stage.optimizer, self.units, rank=self.comm.rank, homes=self.stage.homes),
            "planned": None if self.placement is None else self.placement.summary(),
        }

    def prefetch_report(self) -> Any:
        """The last step's `tierzero.prefetch.StepReport` (hits, misses, seconds waited on I/O), or None.

        Only stage 3 prefetches; None before the first step ends.
        """
        return None if self.param_prefetch is None else self.param_prefetch.last_report

    def offload_states(self, kinds: Iterable[str] | None = None) -> None:
        """Move the device tier's `kinds` ("params", "grads", "optimizer"; default all) to host memory until `reload_states`."""
        self._require_open("offload_states()")
        self._offloaded = offload_states(self, kinds)  # [Note: offloaded states] in engine/states.py

    def reload_states(self) -> None:
        """Bring back, bit for bit, what `offload_states` moved (nothing when nothing is, or once closed)."""
        self._offloaded = None if self._closed else reload_states(self._offloaded)

    def comm_report(self, *, per_group: bool = False) -> dict[str, Any]:
        """Bytes this rank sent since the last reset per collective, under ring accounting (comm.py);
        `per_group`: by group and collective, the bytes sent inside this rank's node (`intra`) and
        across nodes (`inter`), see [Note: bytes inside and across nodes] in comm.py."""
        return self.mesh.report(per_group=per_group)

    def reset_comm_report(self) -> None:
        self.mesh.reset()

    def _require_open(self, what: str) -> None:
        require_ready(what, closed=self._closed, offloaded=self._offloaded)

    def close(self) -> None:
        """Remove the hooks, free every tier and file, leave a group this engine created. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        stage = getattr(self, "stage", None)
        if stage is not None:
            stage.finish(closing=True)
        self.store.close()
        for lock in self._root_locks.values():
            if lock is not None:  # another replica's: the first replica's ranks hold the lock
                lock.release()
        self._root_locks.clear()
        D.teardown(self._ctx)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _refuse_parameterless_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
    """torch's optimizer step pre-hook, while an engine lives: an optimizer built over `module.parameters()`
    (empty then) in groups, as transformers' Trainer builds one, would step nothing, silently."""
    if not any(group["params"] for group in optimizer.param_groups):
        raise ValueError(PARAMETERLESS_STEP)


PARAMETERLESS_STEP = (
    "an optimizer with no parameters stepped while a tierzero engine owns the model's parameters "
    "(engine.module.parameters() is empty while it lives): train with engine.backward(loss) and engine.step(), "
    "or through tierzero.integrations (hf.TierzeroTrainer, accelerate.TierzeroAccelerator)"
)
"""What a torch optimizer over an engine's module says at its first step."""

__all__ = ["Engine"]

