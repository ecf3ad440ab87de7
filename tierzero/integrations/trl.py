"""TRL's trainers training a tierzero engine: `TierzeroSFTTrainer(model, config, args=SFTConfig(...), ...)`,
`TierzeroDPOTrainer(peft_model, config, args=DPOConfig(...), ...)`.

The same overrides as `TierzeroTrainer` (see [Note: a Trainer subclass, not a callback] in
integrations/hf.py) put before TRL's trainer in the bases: TRL prepares the data and computes
its loss (through its fused LM head, which runs inside the model's forward, where the engine
has gathered the weights); the engine does the backward, the step and the checkpoints.

[Note: DPO's reference through the engine]
Given a peft model and no `ref_model`, TRL's DPOTrainer takes as reference either a frozen
copy of the adapters (a "ref" adapter it adds to the model at construction) or, for adapters
it added itself, the base with peft's `disable_adapter()`, then calls the bare model,
`self.model(...)`. Under the engine neither works: the engine owns the parameters (a copy
added to its module is no unit's, and `engine.module` has none to copy), and the bare call
misses what the engine's call adds (stage 3's hooks, its prefetch and deferred steps,
autocast). So `TierzeroDPOTrainer` hands TRL an explicit `ref_model`, `AdaptersOffModule`:
the engine's call within `tierzero.pretrained.lora.adapters_off`, tierzero's own DPO
reference (tierzero/align/step.py). TRL calls it as it calls any reference, without
gradients and with its fused LM head, which the policy's patched base answers. TRL patches
the reference it is given with that head too, which would run the bare backbone; so the one
held after construction is a fresh, unpatched one.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import trl
from accelerate.utils import is_peft_model
from torch import nn

from tierzero.config import load_config
from tierzero.engine import Engine
from tierzero.integrations.hf import EngineTrainerMixin
from tierzero.pretrained.lora import adapters_off

__all__ = ["AdaptersOffModule", "TierzeroDPOTrainer", "TierzeroSFTTrainer"]


class TierzeroSFTTrainer(EngineTrainerMixin, trl.SFTTrainer):
    """`trl.SFTTrainer` training a tierzero engine: `TierzeroSFTTrainer(model, "config.yaml", args=..., train_dataset=...)`.

    `model` is a module (not a hub name: build it, or `tierzero.pretrained.build_meta_model` and
    `pretrained=`); peft_config is not taken (the config's `model.lora`, or `apply_lora`, is).
    """


class AdaptersOffModule(nn.Module):
    """DPO's reference through the engine: `AdaptersOffModule(engine)(**batch)` is `engine(**batch)`
    with the LoRA adapters switched off; see [Note: DPO's reference through the engine].

    Other attributes (`config`, for TRL) are read from the engine's module, which is not a child:
    the reference's `train()` and `eval()` leave the policy's mode alone.
    """

    def __init__(self, engine: Engine) -> None:
        super().__init__()
        self._engine_call: Callable[..., Any] = engine
        object.__setattr__(self, "_engine_module", engine.module)  # not registered as a child

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with adapters_off(self._engine_module):
            return self._engine_call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_engine_module"], name)


_REFUSED_DPO = (
    ("ref_model", "the reference is the engine's model with its LoRA adapters off; leave ref_model out"),
    ("peft_config", "the LoRA adapters are the model's (peft.get_peft_model, or the config's model.lora); leave peft_config out"),
)
"""DPOTrainer arguments TierzeroDPOTrainer takes no value for: (argument, why and the fix)."""

_REFUSED_DPO_ARGS = (
    ("precompute_ref_log_probs", "the reference runs beside the policy each step"),
    ("sync_ref_model", "the reference is the frozen base, which never moves"),
    ("activation_offloading", "the config's activations.offload offloads them; set it there"),
)
"""DPOConfig fields that must stay False: (field, why)."""


class _EngineReferenceDPOTrainer(trl.DPOTrainer):
    """`trl.DPOTrainer` whose reference is `AdaptersOffModule(self.engine)`, `self.engine` set by the mixin before."""

    engine: Engine

    def __init__(self, *, model: nn.Module, args: Any = None, **kwargs: Any) -> None:
        if not is_peft_model(model):
            raise ValueError(
                f"TierzeroDPOTrainer needs a peft LoRA model, got {type(model).__name__}: the reference is the base with the "
                "adapters off; wrap it with peft.get_peft_model or set the config's model.lora (or train with tierzero train, "
                "train.objective: dpo)"
            )
        super().__init__(model=model, ref_model=AdaptersOffModule(self.engine), args=args, **kwargs)
        self.args.beta = self.beta = float(self.engine.cfg.dpo.beta)  # where TRL made its own default DPOConfig
        self.ref_model = AdaptersOffModule(self.engine)  # unpatched: see [Note: DPO's reference through the engine]


def _aligned_dpo_args(args: Any, beta: float) -> Any:
    """A copy of `args` with the config's dpo.beta; ValueError where `args` sets another beta or a refused field."""
    for name, why in _REFUSED_DPO_ARGS:
        if getattr(args, name):
            raise ValueError(f"DPOConfig.{name}=True with a tierzero engine: {why}; set {name}=False")
    default = trl.DPOConfig.__dataclass_fields__["beta"].default
    if args.beta != default and args.beta != beta:
        raise ValueError(
            f"DPOConfig.beta {args.beta} differs from the tierzero config's dpo.beta {beta}: "
            "set dpo.beta there and leave beta at its default"
        )
    out = copy.copy(args)
    out.beta = beta
    return out


class TierzeroDPOTrainer(EngineTrainerMixin, _EngineReferenceDPOTrainer):
    """`trl.DPOTrainer` training a tierzero engine: `TierzeroDPOTrainer(peft_model, "config.yaml", args=DPOConfig(...), ...)`.

    `model` carries LoRA adapters (peft's `get_peft_model`, `apply_lora`, or the config's
    `model.lora`); the reference is the same model with them off, through the engine (see
    [Note: DPO's reference through the engine]); `ref_model` and `peft_config` are not taken.
    The config's `dpo.beta` is DPOConfig's `beta` (a different one set there is refused);
    TRL's loss types and metrics are TRL's. `tierzero train` with `train.objective: dpo` runs
    the same sigmoid loss without TRL.
    """

    def __init__(self, model: nn.Module, config: Any, **kwargs: Any) -> None:
        """As `TierzeroTrainer`'s; what DPOConfig or the arguments set against the engine is refused before the engine
        takes the model."""
        cfg = load_config(config)
        for name, fix in _REFUSED_DPO:
            if kwargs.get(name) is not None:
                raise ValueError(f"TierzeroDPOTrainer got {name}: {fix}")
        if kwargs.get("args") is not None:
            kwargs["args"] = _aligned_dpo_args(kwargs["args"], float(cfg.dpo.beta))
        super().__init__(model, cfg, **kwargs)
