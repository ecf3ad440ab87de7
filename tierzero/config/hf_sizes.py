"""The sizes a transformers config gives (a pretrained `config.json`, or `model.transformers_config`),
checked before transformers sees them.

transformers lets some bad sizes through (`vocab_size: 0` builds, then fails an assert at the
first step) and words the rest as multi-line validation tracebacks without the file or key. Both
readers of a transformers config (tierzero.pretrained.files for a directory, the `model` section
for a class by name) ask here, so the two refuse the same values in the same words.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

POSITION_KEYS = ("max_position_embeddings", "n_positions")
"""The keys that give a model's positions: Llama's and most models', GPT-2's."""
HEAD_KEYS = (("hidden_size", "num_attention_heads"), ("n_embd", "n_head"))
"""The keys of a model's width and of the attention heads it is split into: most models', GPT-2's."""
SIZE_KEYS = ("vocab_size", *(key for pair in HEAD_KEYS for key in pair), "num_hidden_layers", "n_layer", *POSITION_KEYS)
"""The keys that, where present, must be positive integers."""
MAX_INT = 2**31 - 1
"""No integer of a transformers config is above this: a size past it overflows torch's shape arithmetic."""


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def size_problem(values: Mapping[str, Any]) -> tuple[str, str] | None:
    """(key, what is wrong with it) for the first bad size of a transformers config; None when all are sound."""
    for key in SIZE_KEYS:
        if key in values and not _positive_int(values[key]):
            return key, f"{key} is {json.dumps(values[key], default=repr)[:40]}, expected a positive integer"
    for key, value in values.items():
        if isinstance(value, int) and abs(value) > MAX_INT:  # torch's shapes overflow, deep in transformers
            return key, f"{key} is {json.dumps(value)[:40]}, above {MAX_INT:,}, more than any model's size or id"
    for width, heads in HEAD_KEYS:
        # A config with its own head_dim may project its width to heads of any size (Gemma, Qwen3).
        if "head_dim" not in values and values.get(width, 0) % values.get(heads, 1):
            return heads, f"{heads} {values[heads]} does not divide {width} {values[width]}"
    return None


def position_limit(values: Mapping[str, Any]) -> tuple[int, str] | None:
    """The longest sequence a transformers config has positions for, and the key that says so (the
    first of POSITION_KEYS it holds); None when it names none."""
    for key in POSITION_KEYS:
        if _positive_int(limit := values.get(key)):
            return limit, key
    return None
