"""The engine's own training step, run on the meta device against a store that only counts bytes.

`dry_run` builds the model on the meta device, wraps it in a real `Engine` (its own
slice plan, stage, prefetcher and step pipeline) with a `CountingStore` and a
dry-run collective group at the world size asked for, and runs two optimizer steps
through `tierzero.train.micro_step`, the training loop's own: the prefetcher learns
the unit order in the first and follows it in the second. Nothing is allocated and no
byte moves; whatever order the engine takes, the estimate follows, because there is
no second copy of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierzero.config import Config
from tierzero.dist import DistContext
from tierzero.engine import Engine
from tierzero.estimate.counting import CountingStore
from tierzero.mesh import build_mesh
from tierzero.models import build_model, count_parameters
from tierzero.slices import Tier
from tierzero.stages.plan import SlicePlan
from tierzero.topology import Topology
from tierzero.train import micro_step

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
    """NVMe bytes read by a later step."""
    nvme_written: int
    """NVMe bytes written by a later step."""
    nvme_written_first: int
    """NVMe bytes written by the first step."""


def dry_run(cfg: Config, *, world_size: int) -> DryRun:
    """Run set-up and two optimizer steps of `cfg` as rank 0 of `world_size`, counting bytes."""
    if world_size < 1:
        raise ValueError(f"--world-size must be >= 1, got {world_size}")
    model = build_model(cfg.model, device="meta", seed=cfg.train.seed)
    parameters = count_parameters(model)
    store = CountingStore(cfg.tiers, cfg.swapper, cuda=torch.cuda.is_available())
    # Rank 0 of one node: the estimate counts bytes, not which node they reach.
    mesh = build_mesh(
        Topology(world_size=world_size, rank=0, local_world_size=world_size),
        shard_group_size=cfg.zero.shard_group_size,
        hpz_partition_size=cfg.zero.hpz_partition_size,
        node_hops=cfg.zero.quantized_gradients != "none",
        dry_run=True,
    )
    ctx = DistContext(rank=0, world_size=world_size, local_rank=0, device=torch.device("meta"), created_group=False)
    engine = Engine(model, cfg, ctx=ctx, store=store, mesh=mesh)
    try:
        store.reset_traffic()
        _step(engine, cfg)
        read_first, written_first = store.nvme_read, store.nvme_written
        store.reset_traffic()
        _step(engine, cfg)
        # A step each: the second window holds the rest of the first step (run in the second
        # forward, when the step waits for it) and the start of the second, one step's worth.
        read, written = store.nvme_read, store.nvme_written
    finally:
        engine.close()
    peaks = store.report().tiers
    return DryRun(
        plan=engine.plan,
        parameters=parameters,
        model=model,
        peak={tier: peaks[tier].peak for tier in Tier},
        working={tier: dict(store.working[tier]) for tier in Tier},
        bounce=store.bounce,
        nvme_read_first=read_first,
        nvme_read=read,
        nvme_written=written,
        nvme_written_first=written_first,
    )


def _step(engine: Engine, cfg: Config) -> None:
    """One optimizer step: a micro-step per accumulated micro-batch, of token ids on the meta device."""
    train = cfg.train
    is_hf = cfg.model.is_transformers
    for _ in range(cfg.gradient_accumulation_steps):
        x, y = (torch.empty(train.micro_batch_size, train.seq_len, dtype=torch.long, device="meta") for _ in range(2))
        micro_step(engine, x, y, is_hf=is_hf)
