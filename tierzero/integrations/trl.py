"""TRL's trainers training a tierzero engine: `TierzeroSFTTrainer(model, config, args=SFTConfig(...), ...)`,
`TierzeroDPOTrainer(peft_model, config, args=DPOConfig(...), ...)`.

The same overrides as `TierzeroTrainer` (see [Note: a Trainer subclass, not a callback] in
integrations/hf.py) put before TRL's trainer in the bases: TRL prepares the data; the engine
does the backward, the step and the checkpoints. SFTTrainer computes its loss through TRL's
fused LM head, which runs inside the model's forward, where the engine has gathered the weights.

[Note: DPO's loss on TRL's batch]
`TierzeroDPOTrainer.compute_loss` is tierzero's own DPO (tierzero/align): the batch TRL collated
(prompt + completion rows, the chosen ones first, padded on the right, with a completion mask)
becomes a `PreferenceBatch` (the rows one token shorter, the next tokens as targets, `IGNORE`
outside the completions), and `completion_logps` and `dpo_loss` compute the loss from it, the
reference's forward first, with the adapters off, as `dpo_micro_step` does. So the Trainer and
`tierzero train` (train.objective: dpo) step the same weights, bit for bit; TRL's own path would
sum its fused LM head's tiles over the full padded rows, which rounds differently. The rows are
read without their attention mask: under causal attention, padding on the right changes no
completion position, and rows padded otherwise are refused. TRL's reward and log-prob metrics
(`rewards/chosen`, `rewards/rejected`, `rewards/margins`, `rewards/accuracies`, `logps/chosen`,
`logps/rejected`, `num_tokens`) are filled from these numbers, the margin and the accuracy being
tierzero's; those of TRL's fused head (`entropy`, `logits/*`, `mean_token_accuracy`) are not logged.

[Note: DPO's reference through the engine]
Given a peft model and no `ref_model`, TRL's DPOTrainer adds a frozen copy of the adapters (a
"ref" adapter) to the model at construction, which under the engine would be no unit's (the
engine owns the parameters, and `engine.module` has none to copy). So `TierzeroDPOTrainer` hands
TRL an explicit `ref_model`, `AdaptersOffModule`: the engine's call within
`tierzero.pretrained.lora.adapters_off`, the same forward tierzero's loss takes as its reference
(see [Note: DPO's loss on TRL's batch]), held as `trainer.ref_model`. TRL patches the reference it is given
with its fused LM head, which would run the bare backbone; so the one held after construction is
a fresh, unpatched one.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import trl
from accelerate.utils import is_peft_model
from torch import nn

from tierzero.align import DpoTerms, completion_logps, dpo_loss
from tierzero.config import load_config
from tierzero.data.preference import IGNORE, PreferenceBatch
from tierzero.engine import Engine
from tierzero.integrations.hf import EngineTrainerMixin
from tierzero.pretrained.lora import adapters_off

__all__ = ["AdaptersOffModule", "TierzeroDPOTrainer", "TierzeroSFTTrainer", "preference_batch"]


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

_TIERZERO_LOSS = "the loss is tierzero's sigmoid DPO (tierzero.align.dpo_loss)"

_REFUSED_DPO_ARGS = (
    ("precompute_ref_log_probs", "the reference runs beside the policy each step"),
    ("sync_ref_model", "the reference is the frozen base, which never moves"),
    ("activation_offloading", "the config's activations.offload offloads them; set it there"),
    ("loss_type", _TIERZERO_LOSS),
    ("loss_weights", _TIERZERO_LOSS),
    ("ld_alpha", _TIERZERO_LOSS),
    ("f_divergence_type", _TIERZERO_LOSS),
    ("use_weighting", _TIERZERO_LOSS),
    ("router_aux_loss_coef", f"{_TIERZERO_LOSS}, without a router's auxiliary loss"),
)
"""DPOConfig fields that must stay at their defaults: (field, why)."""

_TEXT_ROWS = frozenset({"input_ids", "attention_mask", "completion_mask"})
"""The keys of the batches TRL's DataCollatorForPreference makes for text: all `preference_batch` reads."""


def preference_batch(inputs: dict[str, torch.Tensor]) -> PreferenceBatch:
    """TRL's collated DPO batch as tierzero's: see [Note: DPO's loss on TRL's batch]. ValueError for a batch of
    another kind (images, precomputed reference log-probs) or rows not padded on the right."""
    others = sorted(set(inputs) - _TEXT_ROWS)
    if others:
        raise ValueError(
            f"TierzeroDPOTrainer got a batch with {others}: tierzero's DPO step reads text rows only "
            f"({', '.join(sorted(_TEXT_ROWS))}); train on a text preference dataset with TRL's own data collator"
        )
    attended = inputs["attention_mask"]
    if (attended[:, 1:] > attended[:, :-1]).any():
        raise ValueError(
            "TierzeroDPOTrainer got rows padded on the left: tierzero's DPO step reads them without their attention mask, "
            "which only right padding allows; leave the data collator at TRL's DataCollatorForPreference (it pads right)"
        )
    ids, completion = inputs["input_ids"], inputs["completion_mask"]
    return PreferenceBatch(tokens=ids[:, :-1], targets=ids[:, 1:].masked_fill(completion[:, 1:] == 0, IGNORE))


class _EngineReferenceDPOTrainer(trl.DPOTrainer):
    """`trl.DPOTrainer` whose reference is `AdaptersOffModule(self.engine)` and whose loss is tierzero's,
    `self.engine` set by the mixin before."""

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

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None) -> Any:
        """tierzero's DPO loss on TRL's batch, through the engine; see [Note: DPO's loss on TRL's batch]."""
        policy, reference = completion_logps(self.engine, preference_batch(inputs), is_hf=True)
        terms = dpo_loss(policy, reference, beta=self.beta)
        self._record_metrics(inputs, policy.detach(), reference, terms)
        if not return_outputs:
            return terms.loss
        with torch.no_grad():  # the logits, for compute_metrics, as TRL's evaluation reads them
            return terms.loss, model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])

    def _record_metrics(self, inputs: dict[str, Any], policy: torch.Tensor, reference: torch.Tensor, terms: DpoTerms) -> None:
        """TRL's reward and log-prob metrics of one micro-batch, gathered over the ranks; `log` averages them."""
        metrics = self._metrics["train" if self.model.training else "eval"]
        gather = self.accelerator.gather
        chosen_rewards, rejected_rewards = (self.beta * (policy - reference)).chunk(2)
        chosen_logps, rejected_logps = policy.chunk(2)
        for name, value in (
            ("rewards/chosen", chosen_rewards), ("rewards/rejected", rejected_rewards), ("rewards/accuracies", terms.accuracy),
            ("rewards/margins", terms.margin), ("logps/chosen", chosen_logps), ("logps/rejected", rejected_logps),
        ):  # fmt: skip
            metrics[name].append(gather(value).mean().item())
        if self.model.training:
            self._total_train_tokens += gather(inputs["attention_mask"].sum()).sum().item() // self._tp_size
        metrics["num_tokens"] = [self._total_train_tokens]


def _dpo_default(name: str) -> Any:
    field = trl.DPOConfig.__dataclass_fields__[name]
    return field.default_factory() if field.default is dataclasses.MISSING else field.default


def _aligned_dpo_args(args: Any, beta: float) -> Any:
    """A copy of `args` with the config's dpo.beta; ValueError where `args` sets another beta or a refused field."""
    for name, why in _REFUSED_DPO_ARGS:
        value, default = getattr(args, name), _dpo_default(name)
        if value != default:
            raise ValueError(f"DPOConfig.{name}={value!r} with a tierzero engine: {why}; leave {name} at its default {default!r}")
    if args.beta != _dpo_default("beta") and args.beta != beta:
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
    The config's `dpo.beta` is DPOConfig's `beta` (a different one set there is refused). The
    loss is tierzero's sigmoid DPO, the one `tierzero train` with `train.objective: dpo` steps
    by, on TRL's batches (see [Note: DPO's loss on TRL's batch]): TRL's other loss types and
    weightings are refused.
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
