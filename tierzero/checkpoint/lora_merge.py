"""A LoRA run's adapters folded into its base: each adapted weight becomes W + B @ A * scaling, by the plain model's names.

[Note: merged LoRA export]
`tierzero consolidate --hf` of a LoRA run's checkpoint writes the model peft's `merge_and_unload()`
gives: each adapted Linear's weight is its base weight (dequantized to fp32 where the base was kept
as nf4 or int8) plus `B @ A * scaling` (transposed for a fan-in-fan-out layer such as GPT-2's
Conv1D), in fp32 and in peft's own order (`get_delta_weight`, then the add), cast to the written
dtype only at the end: the file holds, bit for bit, what peft's merge of the same base and adapters
in fp32 holds, cast the same way. The names are the plain model's (peft's `base_model.model.` prefix
and its `.base_layer` hop dropped) and the adapters themselves are left out, so
`AutoModelForCausalLM.from_pretrained` loads it with no peft at all.

Its logits are not the engine's forward bit for bit, and cannot be: the engine adds
`(x @ A.T) @ B.T * scaling` to `x @ W.T`, the merged model computes `x @ (W + B @ A * scaling).T`,
the same sum rounded in another order (in fp32 they agree within 1e-6).

This module knows only names and arithmetic, from a peft model (meta-built is enough): the
checkpoint side reads the values (consolidate.py), and so could a live engine's export.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tierzero.pretrained.lora import ADAPTER

__all__ = ["MERGED_DTYPE", "AdaptedWeight", "LoraMerge"]

#: What a merged LoRA model is written in unless `--dtype` says otherwise: bf16, as models are shipped
#: (an nf4 or int8 base has no float dtype of its own to keep).
MERGED_DTYPE = torch.bfloat16


@dataclass(frozen=True, slots=True)
class AdaptedWeight:
    """One base weight that carries a LoRA adapter: its adapter's two matrices by the peft model's
    names, and how peft scales and lays out their product."""

    lora_a: str
    lora_b: str
    scaling: float
    """peft's `scaling[adapter]`: lora_alpha / r."""
    fan_in_fan_out: bool
    """The base stores its weight as (in, out) (GPT-2's Conv1D): the product is transposed to match."""

    def merged(self, weight: torch.Tensor, adapters: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """`weight` (any float dtype) plus this adapter's product, in fp32."""
        delta = adapters[self.lora_b].float() @ adapters[self.lora_a].float()
        if self.fan_in_fan_out:
            delta = delta.T
        return weight.float().reshape(delta.shape) + delta * self.scaling


@dataclass(frozen=True, slots=True)
class LoraMerge:
    """How a peft model's state folds into its base model's: which weights carry adapters, and the names."""

    weights: Mapping[str, AdaptedWeight]
    """By the adapted base weight's name in the peft model (`...q_proj.base_layer.weight`)."""
    adapters: frozenset[str]
    """The adapters' parameter names (every A and B of `weights`): read for the merge, left out of the
    merged model. From the layers, not the parameters: a live engine's module has none."""
    prefix: str
    """What peft puts before the base model's names (`base_model.model.`)."""

    @classmethod
    def of(cls, model: nn.Module) -> LoraMerge:
        """The merge of the peft model `model`, LoRA on Linear layers with tierzero's one adapter."""
        from peft.tuners.lora import LoraLayer

        peft_model: Any = model  # a peft PeftModel: its get_base_model
        base = peft_model.get_base_model()
        prefix = next(name for name, module in model.named_modules() if module is base)
        weights = {
            f"{name}.base_layer.weight": AdaptedWeight(
                lora_a=f"{name}.lora_A.{ADAPTER}.weight", lora_b=f"{name}.lora_B.{ADAPTER}.weight",
                scaling=float(module.scaling[ADAPTER]), fan_in_fan_out=bool(getattr(module, "fan_in_fan_out", False)),
            )  # fmt: skip
            for name, module in model.named_modules()
            if isinstance(module, LoraLayer)
        }
        adapters = frozenset(name for w in weights.values() for name in (w.lora_a, w.lora_b))
        return cls(weights=weights, adapters=adapters, prefix=f"{prefix}." if prefix else "")

    def plain_name(self, name: str) -> str:
        """The name `merge_and_unload()` gives the peft model's tensor `name`: the base model's own."""
        return name.removeprefix(self.prefix).replace(".base_layer.", ".")
