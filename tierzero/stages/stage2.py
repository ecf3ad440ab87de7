"""Stage 2: as stage 1, but gradients are sharded too.

Each unit's gradients are flattened once that unit's backward is done (the autograd
post-backward of its parameters) and reduce-scattered with the other ready units of
their bucket (see [Note: gradient buckets] in stages/base.py), overlapped with the
rest of backward; each unit's part is summed into its owned GRAD slice and the full
gradients are dropped: only the slice outlives the backward.
"""

from __future__ import annotations

import torch

from tierzero.stages.stage1 import ReplicatedParamsStage
from tierzero.units.unit import Unit


class Stage2(ReplicatedParamsStage):
    number = 2
    shards_grads = True

    def post_backward(self, unit: Unit, grads: list[torch.Tensor]) -> None:
        self.reduce_grads(unit, grads)

    def grad_slice(self, grads: torch.Tensor, unit: Unit) -> torch.Tensor:
        return grads
