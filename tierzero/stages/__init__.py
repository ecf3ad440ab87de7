"""ZeRO stages 1, 2 and 3 over a list of units; see stages/base.py for what they share."""

from __future__ import annotations

from tierzero.stages.base import Stage
from tierzero.stages.plan import Homes
from tierzero.stages.stage1 import Stage1
from tierzero.stages.stage2 import Stage2
from tierzero.stages.stage3 import Stage3
from tierzero.stages.step import StepScalars

STAGES: dict[int, type[Stage]] = {1: Stage1, 2: Stage2, 3: Stage3}

__all__ = ["STAGES", "Homes", "Stage", "Stage1", "Stage2", "Stage3", "StepScalars"]
