"""The small transformers Llama models the tests build: one definition, the sizes at each call."""

from __future__ import annotations

from typing import Any

import pytest
import torch


def tiny_llama(
    *, vocab: int, hidden: int = 32, layers: int = 2, heads: int = 2, kv_heads: int = 2, positions: int = 32,
    seed: int | None = 0, **config: Any,
) -> Any:
    """A `LlamaForCausalLM` of these sizes (the MLP twice as wide), its weights drawn after
    `torch.manual_seed(seed)` (None: from the generator as it stands); `config`, more LlamaConfig
    fields. Skips the calling test where transformers is not installed."""
    transformers = pytest.importorskip("transformers")
    if seed is not None:
        torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=positions, **config,
    ))  # fmt: skip
