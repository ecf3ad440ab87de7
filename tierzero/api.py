"""`tierzero.initialize`: a model and a config in, a training engine out."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from tierzero.comm import dist as D
from tierzero.comm.topology import Topology
from tierzero.config import load_config
from tierzero.inference import GeneratingEngine
from tierzero.placement.planner import PlacementPlan, plan_placement
from tierzero.pretrained import PretrainedWeights
from tierzero.pretrained.lora import is_peft_model, materialize_adapters

__all__ = ["initialize"]


def initialize(
    model: nn.Module,
    config: Any,
    *,
    pretrained: str | os.PathLike[str] | None = None,
    lr_lambda: Callable[[int], float] | None = None,
    topology: Topology | None = None,
    mesh: DeviceMesh | None = None,
) -> GeneratingEngine:
    """Wrap `model` for ZeRO training (and generation: `engine.generate`); `config` is a path, a dict or a tierzero config object.

    `pretrained` (default: the config's `model.pretrained`) names a transformers model directory
    (config.json and safetensors files) whose weights `model`, best built on the meta device
    (`tierzero.pretrained.build_meta_model`), starts from: each unit is read from the files
    straight into its slices, one at a time. `lr_lambda` replaces the config's `scheduler`
    with a `LambdaLR`-style multiplier of `optimizer.lr` per optimizer step. `topology` says
    which ranks share a node where the launcher does not (LOCAL_WORLD_SIZE): it places hybrid
    sharding's and hpZ's groups and splits `comm_report`'s bytes; or `mesh`, a `DeviceMesh` of shape
    (nodes, ranks per node), says the same (the engine makes its own groups from the layout, over
    the default group the mesh was built on). An `offload` key set to auto
    is planned here (tierzero/placement/planner.py): `engine.placement` says how.
    """
    cfg = load_config(config)
    if is_peft_model(model):
        materialize_adapters(model, seed=int(cfg.train.seed))  # peft leaves them on meta on a meta base
    weights = None
    pretrained = pretrained if pretrained is not None else cfg.model.pretrained
    if pretrained is not None:
        weights = PretrainedWeights.open(pretrained).for_model(model)
        weights.check(model)
    ctx = D.setup(timeout_s=cfg.dist.timeout)
    if mesh is not None:
        if topology is not None:
            raise ValueError("initialize got both a topology and a device mesh: pass one, they both give the layout")
        topology = Topology.from_device_mesh(mesh)
    plan = _plan(cfg, ctx, topology) if cfg.offload.planned else None
    if plan is not None and plan.overrides:
        cfg = load_config(cfg, overrides=plan.overrides)  # the prefetcher's budgets, lowered to fit
    homes = None if plan is None else plan.homes
    # An Engine with `generate` ([Note: engine.generate] in tierzero/inference/generate.py).
    engine = GeneratingEngine(model, cfg, ctx=ctx, weights=weights, lr_lambda=lr_lambda, topology=topology, homes=homes)
    engine.placement = plan
    return engine


def _plan(cfg: Any, ctx: D.DistContext, topology: Topology | None) -> PlacementPlan:
    """The placement of `cfg`'s auto kinds: planned on rank 0, within a rank's share of its machine,
    and sent to every rank, so that all place alike however their machines' free memory differs."""
    plan = None
    if ctx.rank == 0:
        topology = topology or Topology.from_env(world_size=ctx.world_size, rank=ctx.rank)
        plan = plan_placement(cfg, world_size=ctx.world_size, local_world_size=topology.local_world_size)
    if ctx.world_size > 1:
        box = [plan]
        dist.broadcast_object_list(box, src=0)
        plan = box[0]
    assert plan is not None
    return plan
