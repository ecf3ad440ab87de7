"""Where state goes (`offload: auto`): each tier's budget from the config or the machine, the
candidate placements, and the planner that replays the step for each and keeps the fastest that fits."""

from tierzero.common.cgroup import CgroupMemory, cgroup_memory
from tierzero.placement.budgets import (
    CPU_MARGIN,
    DEVICE_MARGIN,
    MachineBudgets,
    Margin,
    TierBudget,
    machine_budgets,
    target_budgets,
)

__all__ = [
    "CPU_MARGIN",
    "DEVICE_MARGIN",
    "CgroupMemory",
    "MachineBudgets",
    "Margin",
    "TierBudget",
    "cgroup_memory",
    "machine_budgets",
    "target_budgets",
]
