"""What a stage is built from: the parts the engine made (`StageParts`) and the options read off the
config (`StageOptions`), two typed records in place of a chain of keyword arguments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tierzero.comm import collectives as C
from tierzero.comm.quantized import GradHops
from tierzero.optim.flat import FlatOptimizer
from tierzero.stages.activations import SavedActivations
from tierzero.stages.grads.buckets import DEFAULT_BUCKET_BYTES
from tierzero.stages.param_prefetch import ParamPrefetch
from tierzero.stages.plan import Homes, SlicePlan
from tierzero.store.protocol import SliceStore
from tierzero.units.unit import Unit

__all__ = ["DEFAULT_GATHER_BUDGET", "StageOptions", "StageParts"]

DEFAULT_GATHER_BUDGET = 2**30


@dataclass(kw_only=True, slots=True, frozen=True)
class StageOptions:
    """How a stage runs, from the config's `zero`, `prefetch` and `precision` sections (`from_config`)."""

    param_dtype: torch.dtype
    """The dtype parameters are gathered and computed in (`precision.param_dtype`)."""
    device: torch.device
    """The device the units compute on."""
    overlap: bool = True
    """Collectives run asynchronously beside the compute (`zero.overlap_comm`)."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    """Collectives wait for this many bytes of ready units before they start (`zero.reduce_bucket_size`)."""
    persistence_threshold: int = 0
    """Stage 3: units with fewer parameters stay gathered from forward to backward (`zero.param_persistence_threshold`)."""
    gather_ahead: int = 1
    """Stage 3: block units gathered ahead of the one computing (`zero.gather_ahead`)."""
    gather_budget: int = DEFAULT_GATHER_BUDGET
    """Stage 3: bytes the units gathered ahead may hold beyond the first (`prefetch.max_live_bytes`)."""
    weight_block: int | None = None
    """Stage 3, qwZ: gathers send int8, a scale per this many elements; None: unquantised."""

    def __post_init__(self) -> None:
        if self.gather_ahead < 1:
            raise ValueError(f"zero.gather_ahead must be at least 1 unit, got {self.gather_ahead}")

    @classmethod
    def from_config(cls, cfg: Any, *, param_dtype: torch.dtype, device: torch.device) -> StageOptions:
        """The options `cfg` (a loaded tierzero config) sets, for parameters in `param_dtype` on `device`."""
        zero = cfg.zero
        return cls(
            param_dtype=param_dtype, device=device, overlap=bool(zero.overlap_comm),
            bucket_bytes=int(zero.reduce_bucket_size), persistence_threshold=int(zero.param_persistence_threshold),
            gather_ahead=int(zero.gather_ahead), gather_budget=int(cfg.prefetch.max_live_bytes),
            weight_block=zero.quantization_block_size if zero.quantized_weights else None,
        )  # fmt: skip


@dataclass(kw_only=True, slots=True, frozen=True)
class StageParts:
    """What a stage works with, made by the engine before the stage: the units and their slices' plan,
    the store, the groups it talks over and the optimizer that steps its slices."""

    units: list[Unit]
    plan: SlicePlan
    store: SliceStore
    comm: C.CommGroup
    optimizer: FlatOptimizer
    homes: Homes
    activations: SavedActivations | None = None
    """Books (or offloads) what autograd saves in forward; None: nothing counted."""
    replica: C.CommGroup | None = None
    """Hybrid sharding: the ranks holding this rank's shards, over which gradients are summed too."""
    grad_hops: GradHops | None = None
    """qgZ: the gradients' reduce-scatter in two hops."""
    secondary: C.CommGroup | None = None
    """Stage 3, hpZ: the group that splits each unit's secondary copy."""
    param_prefetch: ParamPrefetch | None = None
    """Stage 3: fetches PARAM slices up the tiers ahead of their gathers (None: each on demand)."""
