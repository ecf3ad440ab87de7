"""`generate.batch_size: auto`: the largest batch whose decoding fits the device tier's free budget.

A decoding step reads every weight once for the whole batch (tierzero/inference/generate.py),
so with the weights on NVMe a batch of B reads 1/B of them per token: the larger the batch
the nearer each token is to compute, and auto takes the largest that fits.

[Note: what a batch costs]
On the device, beyond what the store already holds there, decoding B rows of `prompt`
tokens (padding included) and `new` more takes:
- the KV cache, 2 (keys, values) x layers x B x (prompt + new) x kv heads x head size x the
  compute dtype's bytes, held from the prompts' forward to the last step;
- the logits of the prompts' forward, B x positions x vocabulary x those bytes, where the
  positions are the prompt's for the built-ins (they give every position's) and 1 for a
  transformers model that takes `logits_to_keep`;
- under stage 3, the gathered weights: the unit computing and `zero.gather_ahead` gathered
  ahead of it, each counted as the largest unit (the bound, not the order they come in).
Hidden states and attention scores of one step are small beside these and left out; the
budget's margin (tierzero/placement/budgets.py) is there for them.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

from tierzero.common.sizes import format_size
from tierzero.inference.decoders import base_model
from tierzero.models.builtin import GPT, Llama

__all__ = ["BatchCost", "auto_batch", "batch_cost"]


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchCost:
    """Device bytes of decoding one batch ([Note: what a batch costs]): a part per row and a part per batch."""

    kv_row: int
    """One row's KV cache, every layer, for prompt + new tokens."""
    logits_row: int
    """One row's logits of the prompts' forward."""
    gathered: int
    """Gathered weights at once (stage 3), whatever the batch."""

    @property
    def row(self) -> int:
        return self.kv_row + self.logits_row

    def of(self, batch: int) -> int:
        """Device bytes of a batch of `batch` rows."""
        return self.gathered + batch * self.row

    def describe(self) -> str:
        """What one row needs and what the batch shares, as the refusal and the CLI show it."""
        return (
            f"{format_size(self.row)} a row (KV cache {format_size(self.kv_row)}, logits {format_size(self.logits_row)}) "
            f"+ {format_size(self.gathered)} of gathered weights"
        )


def batch_cost(engine: Any, *, prompt: int, new: int) -> BatchCost:
    """The cost of decoding `prompt` + `new` tokens a row with `engine`'s model ([Note: what a batch costs])."""
    base = base_model(engine.module)
    itemsize = engine.cfg.precision.dtype_bytes
    layers, kv_heads, head_dim, vocab, positions = _shape(base, prompt=prompt)
    stage = engine.stage
    ahead = 1 + int(engine.cfg.zero.gather_ahead)
    largest = max((unit.padded_numel * stage.dtype_of(unit).itemsize for unit in engine.units), default=0)
    return BatchCost(
        kv_row=2 * layers * (prompt + new) * kv_heads * head_dim * itemsize,
        logits_row=positions * vocab * itemsize,
        gathered=ahead * largest if stage.shards_params else 0,
    )


def auto_batch(cost: BatchCost, *, budget: int, prompts: int, source: str) -> int:
    """The largest batch of at most `prompts` rows with `cost.of(batch) <= budget`; ValueError where not even one fits.

    `source` says where `budget` came from, for the refusal.
    """
    if prompts < 1:
        raise ValueError(f"auto batch size for {prompts} prompts: give at least one prompt")
    fits = (budget - cost.gathered) // cost.row if budget >= cost.gathered else 0
    if fits < 1:
        raise ValueError(
            f"generate.batch_size auto: the device budget {format_size(budget)} ({source}) is below batch 1's "
            f"{format_size(cost.of(1))}: {cost.describe()}; raise tiers.device.capacity or shorten the prompts "
            "and --max-new-tokens"
        )
    return min(fits, prompts)


def _shape(base: Any, *, prompt: int) -> tuple[int, int, int, int, int]:
    """(layers, KV heads, head size, vocabulary, logit positions of the prompts' forward) of a decoder model."""
    if isinstance(base, (GPT, Llama)):
        spec = base.spec
        return spec.n_layer, spec.n_head, spec.head_dim, spec.vocab_size, prompt
    config = base.config
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    keeps_one = "logits_to_keep" in inspect.signature(base.forward).parameters
    return int(config.num_hidden_layers), kv_heads, head_dim, int(config.vocab_size), 1 if keeps_one else prompt
