"""transformers' Trainer training a tierzero engine: `TierzeroTrainer(model, config, args=..., train_dataset=...)`.

[Note: a Trainer subclass, not a callback]
A `TrainerCallback` with an optimizer shim cannot do it alone: the Trainer calls the model
itself (a bare `engine.module(...)` misses stage 3's saved-tensor hooks and prefetch),
runs `loss.backward()` through Accelerate (not `engine.backward`, which sets up the step's
gradient reduction), clips and measures `model.parameters()` (empty while the engine lives)
and saves `model.state_dict()` (empty too) as its checkpoint. `EngineTrainerMixin` overrides
exactly those points and keeps the rest of the Trainer (data, callbacks, logging, evaluation,
checkpoint rotation):

- the forward: `_wrap_model` hands the loop an `EngineModule` (integrations/shims.py), which
  Accelerate leaves unwrapped (no DDP over a module without parameters);
- the backward: `training_step` gives the micro-batch's mean loss to `engine.backward` and
  counts the micro-step with `engine.step()`; at the Trainer's accumulation boundary its
  optimizer, an `EngineOptimizer`, makes the `engine.step()` that steps;
- the numbers logged: the rate is the engine's (`EngineSchedule`), the gradient norm is
  `engine.grad_norm` (present where the config clips, or under fp16);
- checkpoints: `save_model(dir)` writes the engine's sharded checkpoint under `dir/tierzero`
  (the Trainer's `checkpoint-N` directories hold one each), and `resume_from_checkpoint`
  loads it: parameters, optimizer states, step, rate and RNG states, bit for bit;
  `export_pretrained(dir)` writes the model for `from_pretrained`.

The config is the one source of the optimizer, its schedule, clipping, accumulation and
precision: TrainingArguments' `learning_rate`, `gradient_accumulation_steps` and
`max_grad_norm` take the engine's values where left at their defaults, a different value set
there is refused in one line, and so is any `optim`, `weight_decay`, `lr_scheduler_type`,
`lr_scheduler_kwargs` or `warmup_steps` set there (the config's `optimizer` and `scheduler`
say them); `fp16`, and `bf16` unless the config trains in bf16, too. Accumulation averages the
micro-batches' mean losses (the engine's rule, as in tierzero's own loop); transformers'
weighting by `num_items_in_batch` is not used. The same mixin makes TRL's trainers
(integrations/trl.py). `lr_lambda` (as for `tierzero.initialize`) steps the engine by another
schedule, transformers' own for one (`get_*_schedule*(...).lr_lambdas[0]`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer import TRAINING_ARGS_NAME

from tierzero.api import initialize
from tierzero.checkpoint import TransformersDirectory
from tierzero.config import Config, load_config
from tierzero.engine import Engine
from tierzero.integrations.shims import EngineModule, EngineOptimizer, EngineSchedule

__all__ = ["CHECKPOINT_DIR", "EngineTrainerMixin", "TierzeroTrainer", "aligned_args"]

CHECKPOINT_DIR = "tierzero"
"""The directory, inside a Trainer checkpoint or `save_model`'s directory, that holds the engine's sharded checkpoint."""

_FROM_CONFIG = (
    ("learning_rate", "optimizer.lr", lambda cfg: float(cfg.optimizer.lr)),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", lambda cfg: int(cfg.gradient_accumulation_steps)),
    ("max_grad_norm", "gradient_clipping", lambda cfg: float(cfg.gradient_clipping)),
)
"""TrainingArguments fields the engine's config decides: (field, config key, the config's value)."""

_UNUSED = (
    ("optim", "optimizer.type"),
    ("weight_decay", "optimizer.weight_decay"),
    ("lr_scheduler_type", "scheduler.type"),
    ("lr_scheduler_kwargs", "scheduler"),
    ("warmup_steps", "scheduler.warmup_steps"),
)
"""TrainingArguments fields the engine has no use for: (field, where the config says it)."""


def aligned_args(args: transformers.TrainingArguments, cfg: Config) -> transformers.TrainingArguments:
    """A copy of `args` whose optimizer fields are the config's; ValueError where `args` sets another value."""
    dtype = cfg.precision.param_dtype
    if args.fp16 or (args.bf16 and dtype != "bf16"):
        raise ValueError(
            f"TrainingArguments {'fp16' if args.fp16 else 'bf16'}=True but the tierzero config's precision.param_dtype "
            f"is {dtype}: the engine's precision is its config's; set it there and pass fp16=False, bf16=False"
        )
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    for name, key in _UNUSED:
        if getattr(args, name) != defaults[name]:
            raise ValueError(
                f"TrainingArguments.{name} {getattr(args, name)!r} with a tierzero engine: its optimizer and schedule are "
                f"its config's; set {key} there and leave {name} at its default"
            )
    out = copy.copy(args)
    for name, key, of_config in _FROM_CONFIG:
        given, wanted = getattr(args, name), of_config(cfg)
        if given != defaults[name] and given != wanted:
            raise ValueError(
                f"TrainingArguments.{name} {given} differs from the tierzero config's {key} {wanted}: "
                f"the engine's optimizer steps by its config; set {key} there and leave {name} at its default"
            )
        setattr(out, name, wanted)
    return out


class EngineTrainerMixin:
    """Makes a transformers Trainer, or a subclass of one (TRL's), train a tierzero engine; see
    [Note: a Trainer subclass, not a callback]. Put it first among the bases."""

    engine: Engine
    args: transformers.TrainingArguments

    def __init__(
        self,
        model: nn.Module,
        config: Any,
        *,
        pretrained: str | os.PathLike[str] | None = None,
        lr_lambda: Callable[[int], float] | None = None,
        **kwargs: Any,
    ) -> None:
        """`config`: a tierzero config (path, dict or Config); `pretrained` and `lr_lambda` as for
        `tierzero.initialize`; the rest goes to the Trainer. The engine (`self.engine`) lives until
        `close()`."""
        cfg = load_config(config)
        args = kwargs.pop("args", None)
        if args is not None:
            args = aligned_args(args, cfg)  # refused before the engine takes the model
        self.engine = initialize(model, cfg, pretrained=pretrained, lr_lambda=lr_lambda)
        try:
            super().__init__(model=self.engine.module, args=args, **kwargs)
            self.args = aligned_args(self.args, cfg)  # the Trainer's own default, where none was given
        except BaseException:
            self.engine.close()
            raise
        self._engine_module = EngineModule(self.engine)
        self._engine_optimizer = EngineOptimizer(self.engine)

    def close(self) -> None:
        """Close the engine: free its tiers and swap files. The trainer can no longer train or save."""
        self.engine.close()

    # ---- the loop's model, optimizer and schedule ---------------------------------

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        return self._engine_module

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        self.optimizer = self._engine_optimizer
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        self.lr_scheduler = EngineSchedule(self._engine_optimizer)
        return self.lr_scheduler

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        """One micro-batch: its mean loss to `engine.backward`; returns it over the accumulation steps, for the log."""
        boundary = self.accelerator.gradient_state.sync_gradients
        accumulation = self.args.gradient_accumulation_steps
        if boundary and (self.engine.micro_steps + 1) % accumulation:
            raise ValueError(
                f"gradient_accumulation_steps {accumulation} does not divide the batches of an epoch: tierzero steps "
                f"only after {accumulation} micro-batches; make the batches per epoch a multiple of it "
                "(dataset size, per_device_train_batch_size, dataloader_drop_last)"
            )
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs)
        self.engine.backward(loss)
        if not boundary:
            self.engine.step()  # counts the micro-batch; at the boundary the optimizer's step() is the step
        return loss.detach() / self.current_gradient_accumulation_steps

    def _clip_grad_norm(self, model: nn.Module) -> None:
        """The engine clips at its step (the config's gradient_clipping)."""
        return None

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> None:
        """Not known before the engine's step: `log` writes `engine.grad_norm` once it is."""
        return None

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs and self.engine.grad_norm is not None:
            logs["grad_norm"] = self.engine.grad_norm
        super().log(logs, start_time)

    # ---- checkpoints --------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The engine's sharded checkpoint under `output_dir/tierzero` (collective: every rank calls it),
        with the tokenizer and the TrainingArguments beside it as the Trainer writes them; to resume.
        `export_pretrained` writes what `from_pretrained` loads."""
        directory = Path(output_dir if output_dir is not None else self.args.output_dir)
        self.engine.save_checkpoint(directory / CHECKPOINT_DIR, keep=1)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(directory)
            torch.save(self.args, directory / TRAINING_ARGS_NAME)

    def export_pretrained(self, output_dir: str | os.PathLike[str]) -> None:
        """The trained model as `save_pretrained` writes it (safetensors, config.json), with the tokenizer,
        gathered unit by unit and written by rank 0. Collective."""
        TransformersDirectory().write(self.engine, Path(output_dir))
        if self.args.should_save and self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """Nothing beside the engine's checkpoint: it holds the optimizer states, the step and the rate."""

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        self.engine.load_checkpoint(_engine_checkpoint(resume_from_checkpoint))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Loaded with the engine's checkpoint; here the Trainer's step is checked against the engine's."""
        if checkpoint is not None and self.engine.global_step != self.state.global_step:
            raise ValueError(
                f"{checkpoint}: the Trainer's state is at step {self.state.global_step} but its tierzero checkpoint "
                f"at step {self.engine.global_step}: the directory mixes two saves; resume from one TierzeroTrainer saved"
            )

    def _load_best_model(self) -> None:
        """The best checkpoint's engine state, whole: parameters, optimizer states, step and rate."""
        self.engine.load_checkpoint(_engine_checkpoint(self.state.best_model_checkpoint))


def _engine_checkpoint(directory: str | os.PathLike[str] | None) -> Path:
    path = Path(directory or ".") / CHECKPOINT_DIR
    if not path.is_dir():
        raise ValueError(f"{directory} holds no tierzero checkpoint ({path} is missing): resume from a checkpoint TierzeroTrainer saved")
    return path


class TierzeroTrainer(EngineTrainerMixin, transformers.Trainer):
    """`transformers.Trainer` training a tierzero engine: `TierzeroTrainer(model, "config.yaml", args=..., train_dataset=...)`.

    See [Note: a Trainer subclass, not a callback]; `trainer.engine` is the engine, `trainer.close()` frees it.
    """
