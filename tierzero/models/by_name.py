"""A model of the transformers package by class name (`model.type: transformers`), checked before it is built.

`model.transformers_class` names the class and `model.transformers_config` its config's keyword
arguments; nothing is downloaded. The class must be a causal LM (the trainer reads `.logits`), and the
model is built on the meta device first, where nothing is allocated, so a size that could never be
built (`n_embd: 4000000`: 192 TB) is refused in seconds, before transformers allocates it.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch
from torch import nn

from tierzero.common.sizes import format_size
from tierzero.config.model import MAX_PARAMETERS

__all__ = ["transformers_model"]


def transformers_model(class_name: str | None, kwargs: dict[str, Any], *, device: str | torch.device | None) -> nn.Module:
    """The class `class_name` of transformers, configured by `kwargs`: refused in one line when it is no
    causal LM, or when it could not be built here (measured on the meta device first, in seconds)."""
    if not class_name:
        raise ValueError("model.type is transformers but model.transformers_class is not set: name a class such as GPT2LMHeadModel")
    try:
        import transformers
    except ImportError:
        raise ValueError("model.type is transformers but the transformers package is not installed: pip install transformers") from None
    model_class = getattr(transformers, class_name, None)
    config_class = getattr(model_class, "config_class", None)
    if model_class is None or config_class is None:
        raise ValueError(
            f"model.transformers_class {class_name!r} is not a transformers model class: "
            "use a class name such as GPT2LMHeadModel or LlamaForCausalLM"
        )
    _check_causal_lm(class_name)
    if dtypes := sorted({"torch_dtype", "dtype"} & set(kwargs)):
        raise ValueError(
            f"model.transformers_config.{dtypes[0]}: the engine sets the model's dtypes from the precision section: "
            f"remove model.transformers_config.{dtypes[0]} and set precision.param_dtype"
        )
    # Config classes store unknown keywords silently; a typo would train the default size.
    known = set(config_class().to_dict()) | set(getattr(config_class, "attribute_map", {}))
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(
            f"model.transformers_config has {', '.join(unknown)}, which {config_class.__name__} does not take: "
            "check the spelling against the transformers documentation of that config"
        )
    try:
        config = config_class(**kwargs)
    except TypeError as exc:
        raise ValueError(f"model.transformers_config does not fit {config_class.__name__}: {exc}") from None
    with torch.device("meta"):
        measured = model_class(config)
    _check_size(measured, on_host=device is None or torch.device(device).type == "cpu")
    return measured if device is not None and torch.device(device).type == "meta" else model_class(config)


def _check_causal_lm(class_name: str) -> None:
    """Refuse a class that is no causal LM (BertModel, GPT2Model): its output has no `.logits` to train on."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if class_name not in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()):
        raise ValueError(
            f"model.transformers_class {class_name} is not a causal LM class (its output has no .logits to train on): "
            "name one with a language-model head, such as GPT2LMHeadModel or LlamaForCausalLM"
        )


def _check_size(model: nn.Module, *, on_host: bool) -> None:
    """Refuse a meta-built transformers model past the built-ins' parameter limit, or, when it is to be
    built whole in host memory (fp32, as transformers builds it), larger than that memory."""
    count = sum(p.numel() for p in model.parameters())  # a tied weight once
    name = type(model).__name__
    if count > MAX_PARAMETERS:
        raise ValueError(
            f"model.transformers_config makes a {name} of {count:.2e} parameters, above the limit of "
            f"{MAX_PARAMETERS:.0e}: lower its sizes (hidden size, layers, vocab_size)"
        )
    available = psutil.virtual_memory().available
    if on_host and count * 4 > available:
        raise ValueError(
            f"model.transformers_config makes a {name} of {count:,} parameters, {format_size(count * 4)} in fp32, "
            f"more than the {format_size(available)} of host memory available to build it: lower its sizes, "
            "or start from model.pretrained, which is streamed from its files and never whole in memory"
        )
