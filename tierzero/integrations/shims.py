"""The engine dressed as what trainers hold: a module to call, an optimizer to step, a schedule to read.

Trainers (transformers' Trainer, an Accelerate script) call `model(**batch)`, `optimizer.step()`,
`optimizer.zero_grad()`, `scheduler.step()` and `scheduler.get_last_lr()`. Here each of those
drives or reads the engine, which stays the one owner of the parameters, the optimizer states
and the learning rate: nothing here holds a parameter, a state or a rate of its own.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tierzero.engine import Engine

__all__ = ["EngineModule", "EngineOptimizer", "EngineSchedule"]


class EngineModule(nn.Module):
    """`engine.module`, called through the engine: `EngineModule(engine)(**batch)` is `engine(**batch)`.

    The engine's call adds what a bare `engine.module(...)` would miss: stage 3's saved-tensor
    hooks, its prefetch and the config's autocast. The model is a child, so `train()` and
    `eval()` reach it; other attributes (`config`, `generation_config`) are read from it.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self.module = engine.module
        self._engine_call: Callable[..., Any] = engine

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._engine_call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["module"], name)

    def _get_name(self) -> str:
        # transformers picks the loss (shifted labels or not) by the model's class name.
        return self.module._get_name()


class EngineOptimizer(torch.optim.Optimizer):
    """The engine's optimizer as trainers hold one: `step()` is `engine.step()`, once per micro-batch.

    `engine.step()` counts micro-batches and steps the optimizer at each accumulation boundary,
    so a trainer calls `step()` after every backward (as Accelerate's `accumulate` scripts do).
    `param_groups[0]["lr"]` is the rate of the step just taken, until `EngineSchedule.step()`
    moves it to the next one, as with a torch optimizer and its scheduler. It holds no
    parameters and no state: `torch.optim.Optimizer.__init__` is not called (as Accelerate's
    own wrapper does not), which also keeps torch's step hooks off it.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.defaults: dict[str, Any] = {"lr": engine.lr}
        self.param_groups: list[dict[str, Any]] = [{"params": [], "lr": engine.lr}]
        self.state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        if closure is not None:
            raise ValueError("the tierzero engine's optimizer takes no closure: run the forward and backward before step()")
        self.param_groups[0]["lr"] = self.engine.lr  # the rate this step, if a boundary, takes
        self.engine.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: the engine clears its gradients when it steps."""

    def state_dict(self) -> dict[str, Any]:
        """Empty: the engine's checkpoint (`engine.save_checkpoint`) holds the optimizer states and the rate."""
        return {"state": {}, "param_groups": [{"params": [], "lr": self.param_groups[0]["lr"]}]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load: `engine.load_checkpoint` restores the states, the step and the rate."""


class EngineSchedule:
    """The engine's learning-rate schedule (its config's `scheduler`, or the `lr_lambda` it was built
    with) as trainers hold one: read, never set.

    `get_last_lr()` is the rate of the next step once `step()` has run, and of the step just
    taken between the optimizer's step and this one's (where transformers' Trainer logs it).
    """

    def __init__(self, optimizer: EngineOptimizer) -> None:
        self.optimizer = optimizer

    def step(self) -> None:
        self.optimizer.param_groups[0]["lr"] = self.optimizer.engine.lr

    def get_last_lr(self) -> list[float]:
        return [float(self.optimizer.param_groups[0]["lr"])]

    def state_dict(self) -> dict[str, Any]:
        """Empty: the rate follows from the engine's step, which its checkpoint restores."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to load (see `state_dict`)."""
