"""An Accelerate script training a tierzero engine, one line changed: `accelerator = TierzeroAccelerator(config)`.

[Note: an Accelerator subclass]
`accelerator.backward(loss)` must become `engine.backward(loss)` (which sets up the step's
gradient reduction before autograd runs and finishes it after); Accelerate offers no hook
there, so the script's Accelerator is a subclass. Its `prepare(model, optimizer, dataloader,
scheduler)` builds the engine from the model and the tierzero config and returns the engine
dressed as those objects (integrations/shims.py): a module whose call is the engine's, an
optimizer whose `step()` is `engine.step()` (call it after every backward, as `accumulate`
scripts do: the engine counts micro-batches and steps at its accumulation boundary), a
schedule that reads `engine.lr` (a `LambdaLR` given to `prepare`, as transformers' schedules are,
becomes the engine's `lr_lambda`; without one the config's `scheduler` rules); data loaders are prepared as Accelerate does. The config
is the one source of the optimizer, its rate and schedule, clipping, accumulation and
precision: an optimizer, clipping or accumulation given to Accelerate that disagrees with it
is refused in one line. `save_state`/`load_state` carry the engine's sharded checkpoint
(under `<dir>/tierzero`, through Accelerate's state hooks) beside Accelerate's own files;
`get_state_dict(model)` (and so `save_model`) gives the full fp32 weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import accelerate
import torch
from accelerate.utils import DistributedType
from torch import nn

from tierzero.api import initialize
from tierzero.config import Config, load_config
from tierzero.engine import Engine
from tierzero.integrations.shims import EngineModule, EngineOptimizer, EngineSchedule

__all__ = ["CHECKPOINT_DIR", "TierzeroAccelerator"]

CHECKPOINT_DIR = "tierzero"
"""The directory, inside a `save_state` directory, that holds the engine's sharded checkpoint."""

_OWN_SHARDING = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM, DistributedType.XLA)


class TierzeroAccelerator(accelerate.Accelerator):
    """`accelerate.Accelerator` whose `prepare` builds a tierzero engine; see [Note: an Accelerator subclass]."""

    def __init__(
        self,
        config: Any,
        *,
        pretrained: str | os.PathLike[str] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
        **kwargs: Any,
    ) -> None:
        """`config`: a tierzero config (path, dict or Config); `pretrained` and `lr_lambda` as for
        `tierzero.initialize`; the rest goes to `accelerate.Accelerator` (not mixed_precision: the
        config's `precision` decides)."""
        super().__init__(**kwargs)
        if self.mixed_precision != "no":
            raise ValueError(
                f"TierzeroAccelerator(mixed_precision={self.mixed_precision!r}): the engine's precision is its config's; "
                "set precision.param_dtype there and leave mixed_precision at 'no'"
            )
        if self.distributed_type in _OWN_SHARDING:
            raise ValueError(f"TierzeroAccelerator under {self.distributed_type}: tierzero shards itself; launch without that plugin")
        self._config, self._pretrained, self._lr_lambda = config, pretrained, lr_lambda
        self.engine: Engine | None = None
        """The engine `prepare` built from the model (None before)."""

    def prepare(self, *args: Any, device_placement: list[bool] | None = None) -> Any:
        """The model becomes the engine (once per accelerator); its optimizer and scheduler the engine's;
        anything else (data loaders) is prepared by Accelerate."""
        models = [obj for obj in args if isinstance(obj, nn.Module)]
        optimizer = None
        if models:
            engine = self._build_engine(models, args)
            optimizer = EngineOptimizer(engine)
        out = tuple(self._prepared(obj, optimizer) for obj in args)
        return out if len(out) != 1 else out[0]

    def _build_engine(self, models: list[nn.Module], args: tuple[Any, ...]) -> Engine:
        if len(models) != 1 or self.engine is not None:
            raise ValueError("a TierzeroAccelerator trains one model: prepare it once, with its optimizer")
        cfg = load_config(self._config)
        _check_agrees(cfg, args, accumulation=self.gradient_accumulation_steps)  # before the engine takes the model
        lr_lambda = _schedule_of(args) or self._lr_lambda
        engine = self.engine = initialize(models[0], cfg, pretrained=self._pretrained, lr_lambda=lr_lambda)
        self.register_save_state_pre_hook(
            lambda _models, _weights, directory: engine.save_checkpoint(Path(directory) / CHECKPOINT_DIR, keep=1)
        )
        self.register_load_state_pre_hook(lambda _models, directory: engine.load_checkpoint(Path(directory) / CHECKPOINT_DIR))
        return engine

    def _prepared(self, obj: Any, optimizer: EngineOptimizer | None) -> Any:
        if isinstance(obj, nn.Module):
            return EngineModule(self._engine())
        if isinstance(obj, torch.optim.Optimizer | torch.optim.lr_scheduler.LRScheduler):
            if optimizer is None:
                raise ValueError("prepare the optimizer and scheduler together with the model: the engine replaces them")
            return optimizer if isinstance(obj, torch.optim.Optimizer) else EngineSchedule(optimizer)
        return super().prepare(obj)

    def _engine(self) -> Engine:
        if self.engine is None:
            raise ValueError("no tierzero engine yet: accelerator.prepare(model, ...) builds it")
        return self.engine

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """`engine.backward(loss)`: the micro-batch's mean loss (the engine divides by its accumulation steps)."""
        self._engine().backward(loss)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> None:
        """The engine clips at its step, by the config's gradient_clipping; its norm is `engine.grad_norm` after `step()`."""
        clip = float(self._engine().cfg.gradient_clipping)
        if float(max_norm) != clip or norm_type != 2:
            raise ValueError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) but the tierzero config's gradient_clipping "
                f"is {clip} (an L2 norm): the engine clips at its step; set gradient_clipping: {max_norm} in the config"
            )

    def unwrap_model(self, model: nn.Module, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> nn.Module:
        if isinstance(model, EngineModule):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)

    def get_state_dict(self, model: nn.Module, unwrap: bool = True) -> dict[str, torch.Tensor] | None:
        """The full fp32 weights by the model's names, on CPU, on rank 0 (None elsewhere). Collective."""
        return self._engine().full_state_dict()


def _schedule_of(args: tuple[Any, ...]) -> Callable[[int], float] | None:
    """The multiplier of a `LambdaLR` among `args` (transformers' `get_*_schedule*` make one), which the
    engine then steps by instead of its config's `scheduler`; None where there is no scheduler."""
    schedulers = [obj for obj in args if isinstance(obj, torch.optim.lr_scheduler.LRScheduler)]
    if not schedulers:
        return None
    lambdas = [fn for s in schedulers if isinstance(s, torch.optim.lr_scheduler.LambdaLR) for fn in s.lr_lambdas]
    if len(schedulers) > 1 or len(lambdas) != len(schedulers[0].optimizer.param_groups) or len(set(map(id, lambdas))) != 1:
        raise ValueError(
            f"prepare got {', '.join(type(s).__name__ for s in schedulers)}: the engine takes one LambdaLR with one multiplier "
            "for all groups (transformers' get_*_schedule*), or none and its config's scheduler section"
        )
    return lambdas[0]


def _check_agrees(cfg: Config, args: tuple[Any, ...], *, accumulation: int) -> None:
    """What the script gave Accelerate (its optimizer's rate, its accumulation) must be what the config says."""
    steps = int(cfg.gradient_accumulation_steps)
    if accumulation not in (1, steps):
        raise ValueError(
            f"Accelerator gradient_accumulation_steps {accumulation} but the tierzero config's is {steps}: "
            "the engine accumulates by its config; set gradient_accumulation_steps there"
        )
    for obj in args:
        if isinstance(obj, torch.optim.Optimizer):
            rates = {float(group.get("initial_lr", group["lr"])) for group in obj.param_groups}  # before a scheduler
            if rates != {float(cfg.optimizer.lr)}:
                raise ValueError(
                    f"the optimizer's learning rate {sorted(rates)} is not the tierzero config's optimizer.lr "
                    f"{cfg.optimizer.lr}: the engine's optimizer replaces it and steps by its config; set optimizer.lr there"
                )
