"""Optimizer parameter groups from the config's name rules: no weight decay on biases and norms, lr multipliers.

torch users build `param_groups` by hand; here `optimizer.no_decay`,
`optimizer.no_decay_modules` and `optimizer.lr_multipliers` say which parameters get no
weight decay and which a scaled learning rate, and `GroupRules` turns those rules into
groups as the units are planned: each parameter's slot records its group, and the flat
optimizer steps each group with its own (lr, weight decay), as torch.optim steps each
param group. Group 0 is always the optimizer's own lr and weight decay.

A group's base lr is `optimizer.lr x multiplier`, computed once, and a schedule multiplies
it each step: the arithmetic of `LambdaLR` over groups built as `{"lr": lr * multiplier}`.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tierzero.config import OptimizerConfig
from tierzero.units.slice_layout import ParamGroup
from tierzero.units.unit import Binding

__all__ = ["GroupRules"]


@dataclass(slots=True)
class GroupRules:
    """Assigns each parameter a group by its name and module; collects the groups met, in order."""

    lr: float
    weight_decay: float
    no_decay: Sequence[str] = ()
    """Glob patterns on dotted parameter names."""
    no_decay_modules: Sequence[str] = ()
    """Substrings of module class names."""
    lr_multipliers: Mapping[str, float] = field(default_factory=dict)
    """Glob pattern -> lr factor; the first that matches wins."""
    groups: list[ParamGroup] = field(default_factory=list)
    """Group 0 (the optimizer's own), then every other combination met so far."""

    def __post_init__(self) -> None:
        self.groups = [ParamGroup(lr=self.lr, weight_decay=self.weight_decay)]

    @classmethod
    def from_config(cls, optimizer: OptimizerConfig) -> GroupRules:
        """From an `OptimizerConfig` (lr, weight_decay, no_decay, no_decay_modules, lr_multipliers)."""
        return cls(
            lr=float(optimizer.lr),
            weight_decay=float(optimizer.weight_decay),
            no_decay=tuple(optimizer.no_decay),
            no_decay_modules=tuple(optimizer.no_decay_modules),
            lr_multipliers=dict(optimizer.lr_multipliers),
        )

    def decays(self, binding: Binding) -> bool:
        if any(fnmatch.fnmatchcase(binding.name, pattern) for pattern in self.no_decay):
            return False
        module_class = type(binding.module).__name__
        return not any(part in module_class for part in self.no_decay_modules)

    def multiplier(self, name: str) -> float:
        return next((f for pattern, f in self.lr_multipliers.items() if fnmatch.fnmatchcase(name, pattern)), 1.0)

    def group_of(self, binding: Binding) -> int:
        """The group index of the parameter reached at `binding`, adding its group if new."""
        multiplier = self.multiplier(binding.name)
        group = ParamGroup(
            lr=self.lr if multiplier == 1.0 else self.lr * multiplier,
            weight_decay=self.weight_decay if self.decays(binding) else 0.0,
        )
        if group not in self.groups:
            self.groups.append(group)
        return self.groups.index(group)
