"""The engine's own training step, run on the meta device against a store that only counts bytes.

`dry_run` builds the model on the meta device, wraps it in a real `Engine` (its own
slice plan, stage, prefetcher and step pipeline) with a `CountingStore` and a
dry-run collective group at the world size asked for, and runs two optimizer steps
through `tierzero.engine.micro_step.micro_step`, the training loop's own: the prefetcher learns
the unit order in the first and follows it in the second. Nothing is allocated and no
byte moves; whatever order the engine takes, the estimate follows, because there is
no second copy of it. It does so twice: the NVMe traffic comes from a replay whose
writes land as soon as the engine asks (a disk that keeps up, as the engine's choices
assume), the memory peaks from one whose writes land only when waited for (the most
the engine can hold). The traffic is also counted by the part of the step it is issued
in (`micro_step`'s marks: forward, backward, step), with the elements the optimizer
steps in each, so that the prediction overlaps the disk only with the work beside it.
A dry run depends on nothing but its arguments: the last `_KEPT` are kept, and one asked
again in the process (the planner called twice, a check of its choice against every
placement) is returned, not re-run.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierzero.comm.dist import DistContext
from tierzero.comm.mesh import build_mesh
from tierzero.comm.topology import Topology
from tierzero.common.slices import Kind, SliceKey, Tier
from tierzero.config import Config
from tierzero.engine.engine import Engine
from tierzero.engine.micro_step import PARTS, micro_step
from tierzero.estimate.counting import CountingStore, Traffic
from tierzero.estimate.shapes import ShapesOnly
from tierzero.models.builtin import build_model, count_parameters
from tierzero.optim.unit_states import HeldStates, held_states
from tierzero.stages.plan import Homes, SlicePlan
from tierzero.units.unit import Unit

__all__ = ["DryRun", "dry_run"]


@dataclass(frozen=True, slots=True, kw_only=True)
class DryRun:
    """What one rank's store held and moved over set-up and two steps."""

    plan: SlicePlan
    parameters: int
    """Distinct parameters of the model."""
    model: nn.Module
    """The model, on the meta device."""
    peak: dict[Tier, int]
    """The ledger's peak per tier: what `engine.memory_report()` reports after a real run."""
    working: dict[Tier, dict[str, int]]
    """Peak bytes per tier by use (home, fetched, gathered, scratch, staging, bounce)."""
    bounce: int
    """Bytes of the NVMe tier's bounce blocks, in the cpu peak but outside any capacity."""
    nvme_read_first: int
    """NVMe bytes read by the first step, which learns the unit order."""
    nvme_read: int
    """NVMe bytes read by a later step (the first in which the NVMe cache evicts nothing)."""
    nvme_written: int
    """NVMe bytes written by that step."""
    nvme_written_first: int
    """NVMe bytes written by the first step."""
    memory_copied: int
    """Bytes a later step copies between the device and cpu tiers (host memory both, without a GPU)."""
    nvme_by_slice: dict[SliceKey, tuple[int, int]]
    """NVMe bytes (read, written) by a later step, by slice (the placement planner's fill order)."""
    nvme_written_setup: int
    """NVMe bytes written by set-up: every slice's first value but those the cache keeps."""
    steps: int
    """Optimizer steps the dry run took: two, or more while the NVMe cache was still settling."""
    comm: dict[str, dict[str, dict[str, int]]]
    """Bytes rank 0 sends in a later step: group -> collective -> inside its node ("intra") and across ("inter")."""
    phases: dict[str, Traffic]
    """What a later step moved and stepped in each of its parts ("forward", "backward", "step"), in order."""
    units: tuple[Unit, ...] = ()
    """The engine's units, in order (their shapes and dtypes: what a generate run gathers)."""
    optimizer_states: dict[str, HeldStates] = field(default_factory=dict)
    """The states a torch.optim class keeps beside each trained unit's shard, by unit, and the tier whose
    memory holds them ([Note: counting a class's states]); empty for the engine's own optimizers."""


_MAX_STEPS = 8
"""The most optimizer steps a dry run takes while the NVMe cache settles."""

_KEPT = 64
"""Dry runs kept, by their arguments (a meta model and a slice plan each: no tensor data)."""
_kept: OrderedDict[str, DryRun] = OrderedDict()


def dry_run(
    cfg: Config,
    *,
    world_size: int,
    local_world_size: int | None = None,
    homes: Homes | None = None,
    cuda: bool | None = None,
) -> DryRun:
    """Run set-up and two optimizer steps of `cfg` (more while the NVMe cache settles) as rank 0
    of `world_size` on nodes of `local_world_size` ranks (default: one node), counting bytes;
    `homes` places the slices (default: the config's `offload`). `cuda`: whether the store counts
    as a GPU's (default: whether this host has one), for a machine that is not this one."""
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    cuda = torch.cuda.is_available() if cuda is None else cuda
    key = repr((cfg, world_size, local_world_size or world_size, homes, cuda))
    if key in _kept:
        _kept.move_to_end(key)
        return _kept[key]
    # Every rank has as many peers on other nodes as rank 0, so rank 0's split is every rank's.
    topology = Topology(world_size=world_size, rank=0, local_world_size=local_world_size or world_size)
    # Two replays (see counting.py): writes that land when asked give the traffic of a disk that
    # keeps up; writes that land only when waited for give the memory bound of one that does not.
    fast, _ = _replay(cfg, topology=topology, homes=homes, lands_when_asked=True, cuda=cuda)
    slow, engine = _replay(cfg, topology=topology, homes=homes, lands_when_asked=False, cuda=cuda)
    peaks = slow.store.report().tiers
    run = DryRun(
        plan=engine.plan,
        parameters=slow.parameters,
        model=slow.model,
        peak={tier: peaks[tier].peak for tier in Tier},
        working={tier: dict(slow.store.working[tier]) for tier in Tier},
        bounce=slow.store.bounce,
        nvme_read_first=fast.read_first,
        nvme_read=fast.read,
        nvme_written=fast.written,
        nvme_written_first=fast.written_first,
        memory_copied=fast.copied,
        nvme_by_slice=fast.by_slice,
        nvme_written_setup=fast.written_setup,
        steps=fast.steps,
        comm=fast.comm,
        phases=fast.phases,
        units=tuple(engine.units),
        optimizer_states=slow.states,
    )
    _kept[key] = run
    while len(_kept) > _KEPT:
        _kept.popitem(last=False)
    return run


@dataclass(slots=True, kw_only=True)
class _Replay:
    store: CountingStore
    model: nn.Module
    parameters: int
    read_first: int = 0
    written_first: int = 0
    read: int = 0
    written: int = 0
    copied: int = 0
    by_slice: dict[SliceKey, tuple[int, int]] = field(default_factory=dict)
    written_setup: int = 0
    steps: int = 0
    comm: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    phases: dict[str, Traffic] = field(default_factory=dict)
    states: dict[str, HeldStates] = field(default_factory=dict)


class _CountedOptimizer:
    """The engine's optimizer, counting the elements each step hands it in the store's phase."""

    def __init__(self, optimizer: Any, store: CountingStore) -> None:
        self._optimizer, self._store = optimizer, store

    def __getattr__(self, name: str) -> Any:
        return getattr(self._optimizer, name)

    def step(self, *, param: torch.Tensor, **kwargs: Any) -> None:
        self._store.stepped(param.numel())
        self._optimizer.step(param=param, **kwargs)

    def step_converting(self, *, param: torch.Tensor, **kwargs: Any) -> None:
        self._store.stepped(param.numel())
        self._optimizer.step_converting(param=param, **kwargs)

    def step_slots(self, *, grads: Sequence[tuple[int, torch.Tensor, int]], **kwargs: Any) -> None:
        self._store.stepped(sum(grad.numel() for _, grad, _ in grads))
        self._optimizer.step_slots(grads=grads, **kwargs)

    def step_converting_slots(self, *, grads: Sequence[tuple[int, torch.Tensor, int]], **kwargs: Any) -> None:
        self._store.stepped(sum(grad.numel() for _, grad, _ in grads))
        self._optimizer.step_converting_slots(grads=grads, **kwargs)


def _replay(
    cfg: Config, *, topology: Topology, homes: Homes | None, lands_when_asked: bool, cuda: bool
) -> tuple[_Replay, Engine]:
    """Set-up and two steps on a fresh meta model and counting store; the bytes each step moved.
    The model's costliest functions run as shapes only (estimate/shapes.py), but where the run
    books its saved activations (tierzero/stages/activations.py): those count what the meta kernels save."""
    acts = cfg.activations
    with ShapesOnly() if acts.checkpoint == 0 and acts.offload == "none" else contextlib.nullcontext():
        return _set_up_and_step(cfg, topology=topology, homes=homes, lands_when_asked=lands_when_asked, cuda=cuda)


def _set_up_and_step(
    cfg: Config, *, topology: Topology, homes: Homes | None, lands_when_asked: bool, cuda: bool
) -> tuple[_Replay, Engine]:
    """`_replay`'s work, under whichever mode it chose."""
    model = build_model(cfg.model, device="meta", seed=cfg.train.seed)
    store = CountingStore(cfg.tiers, cfg.swapper, cuda=cuda, lands_when_asked=lands_when_asked)
    world_size = topology.world_size
    mesh = build_mesh(
        topology,
        shard_group_size=cfg.zero.shard_group_size,
        hpz_partition_size=cfg.zero.hpz_partition_size,
        node_hops=cfg.zero.quantized_gradients != "none",
        dry_run=True,
    )
    ctx = DistContext(rank=0, world_size=world_size, local_rank=0, device=torch.device("meta"), created_group=False)
    run = _Replay(store=store, model=model, parameters=count_parameters(model))
    engine = Engine(model, cfg, ctx=ctx, store=store, mesh=mesh, homes=homes)
    try:
        # Counted before the steps, which on the meta device run no class ([Note: a torch.optim class per unit]).
        run.states = held_states(engine.stage.optimizer, engine.units, rank=0, homes=engine.stage.homes)
        engine.stage.optimizer = _CountedOptimizer(engine.stage.optimizer, store)
        run.written_setup = store.nvme_written
        store.reset_traffic()
        _step(engine, cfg, mark=store.mark)
        run.read_first, run.written_first = store.nvme_read, store.nvme_written
        run.steps = 1
        # A step each: the second window holds the rest of the first step (run in the second
        # forward, when the step waits for it) and the start of the second, one step's worth.
        # The NVMe cache may trade slices in its first steps (store/cache_policy.py): the
        # later step is the first in which it evicts nothing.
        while run.steps == 1 or (store.evictions and run.steps < _MAX_STEPS):
            store.reset_traffic()
            engine.reset_comm_report()
            _step(engine, cfg, mark=store.mark)
            run.steps += 1
        if not cuda:
            # Host memory traffic besides the compute's: each micro-step's backward writes its
            # gradients into this rank's GRAD slices (stages/grad_landing.py), one pass over them,
            # but for those a step took as they were ([Note: gradient pieces]).
            store.mark("backward")
            landed = store.kind_bytes().get(Kind.GRAD, 0) * cfg.gradient_accumulation_steps
            store.copied(landed - store.grads_in_place)
        run.read, run.written, run.copied = store.nvme_read, store.nvme_written, store.memory_copied
        run.phases = {phase: store.by_phase.get(phase, Traffic()) for phase in PARTS}
        run.by_slice = {key: (read, written) for key, (read, written) in store.by_slice.items()}
        run.comm = engine.comm_report(per_group=True)
    finally:
        engine.close()
    return run, engine


def _step(engine: Engine, cfg: Config, *, mark: Callable[[str], None]) -> None:
    """One optimizer step: a micro-step per accumulated micro-batch, of token ids on the meta device;
    `mark` hears each part of it begin."""
    train = cfg.train
    is_hf = cfg.model.is_transformers
    for _ in range(cfg.gradient_accumulation_steps):
        x, y = (torch.empty(train.micro_batch_size, train.seq_len, dtype=torch.long, device="meta") for _ in range(2))
        micro_step(engine, x, y, is_hf=is_hf, mark=mark)
