"""TRL's trainers training a tierzero engine: `TierzeroSFTTrainer(model, config, args=SFTConfig(...), ...)`.

The same overrides as `TierzeroTrainer` (see [Note: a Trainer subclass, not a callback] in
integrations/hf.py) put before TRL's trainer in the bases: TRL prepares the data and computes
its loss (through its fused LM head, which runs inside the model's forward, where the engine
has gathered the weights); the engine does the backward, the step and the checkpoints.
"""

from __future__ import annotations

import trl

from tierzero.integrations.hf import EngineTrainerMixin

__all__ = ["TierzeroSFTTrainer"]


class TierzeroSFTTrainer(EngineTrainerMixin, trl.SFTTrainer):
    """`trl.SFTTrainer` training a tierzero engine: `TierzeroSFTTrainer(model, "config.yaml", args=..., train_dataset=...)`.

    `model` is a module (not a hub name: build it, or `tierzero.pretrained.build_meta_model` and
    `pretrained=`); peft_config is not taken (the config's `model.lora`, or `apply_lora`, is).
    """
