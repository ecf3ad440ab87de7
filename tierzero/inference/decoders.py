"""One forward call of a generation step through the engine, with the model's own KV cache.

Every call goes through `engine(...)`, the engine's forward: under `torch.no_grad()` each unit
is gathered by its hook as in any inference forward (stage 3 fetches its parameter slice
from its home tier, all-gathers it, computes and frees it), so a decoding step reads every
weight once for the whole batch, wherever the weights live.

Two kinds of model, one call each: `(tokens, attention mask so far) -> last position's logits`.

- The built-in GPT and Llama keep their keys and values in a `KVCache`
  (tierzero/models/kv_cache.py), passed to their forward as `cache=`.
- A transformers causal LM keeps its own cache object, which its forward returns and takes
  back (`cache=` from transformers 5, `past_key_values=` before), with the attention mask
  and the position ids transformers' own `generate` gives it, so that its tokens are the same.

[Note: the head's input]
transformers computes the prompts' logits at the last position only (`logits_to_keep=1`),
the hidden states sliced to (batch, 1, hidden): a view whose rows lie a prompt apart, not
contiguous. torch's matmul folds such an input into one matrix product only where the
weight requires grad (as a plain model's parameters do); the engine binds its weights as
plain tensors in a no-grad forward, so the product goes batched instead, over the head's
weight expanded and copied once per row. For the 2.23B Llama at batch 32 that was 5.2 GB
of copies and 55 of the prompts' 71 s (docs/benchmarks-journal.md, issue 44). So the head
takes its input contiguous while the decoder runs (`contiguous_head`): one (batch, hidden) copy.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from tierzero.models.builtin import GPT, Llama
from tierzero.models.kv_cache import KVCache
from tierzero.pretrained.lora import is_peft_model

__all__ = ["BuiltinDecoder", "Decoder", "TransformersDecoder", "base_model", "contiguous_head", "decoder_for"]


class Decoder(Protocol):
    """Runs the model on the next tokens of every row, the earlier ones cached; gives the last position's logits."""

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`ids` (batch, new tokens); `mask` (batch, tokens so far with the new ones), 1 for a real token."""
        ...


@dataclass(slots=True)
class BuiltinDecoder:
    """The built-in GPT and Llama, with a `KVCache` of the batch's size."""

    engine: Any
    cache: KVCache

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.engine(ids, cache=self.cache, attention_mask=mask)[:, -1]


@dataclass(slots=True)
class TransformersDecoder:
    """A transformers causal LM (peft-wrapped or not), with the cache object its forward returns."""

    engine: Any
    cache_keyword: str
    """`cache` (transformers 5) or `past_key_values`: what its forward takes and returns the cache as."""
    keeps_one: bool
    """Its forward takes `logits_to_keep`: only the last position's logits are computed, as generate asks."""
    cache: Any = field(default=None)

    @classmethod
    def of(cls, engine: Any, model: nn.Module) -> TransformersDecoder:
        """The decoder of `model` (its base model's forward, where peft wraps it), run through `engine`."""
        taken = inspect.signature(model.forward).parameters
        keyword = "cache" if "cache" in taken else "past_key_values"
        return cls(engine=engine, cache_keyword=keyword, keeps_one="logits_to_keep" in taken)

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # As transformers numbers positions from the mask: real tokens from 0, padding at 0.
        positions = (mask.long().cumsum(-1) - 1).clamp(min=0)[:, -ids.shape[1] :]
        kwargs: dict[str, Any] = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, "use_cache": True}
        if self.cache is not None:
            kwargs[self.cache_keyword] = self.cache
        if self.keeps_one:
            kwargs["logits_to_keep"] = 1
        out = self.engine(**kwargs)
        self.cache = getattr(out, self.cache_keyword)
        return out.logits[:, -1]


def decoder_for(engine: Any, *, batch: int, prompt: int, new: int) -> Decoder:
    """The decoder of `engine.module` for `batch` rows of `prompt` tokens (padding included) and `new` more."""
    base = base_model(engine.module)
    if isinstance(base, (GPT, Llama)):
        _check_room(prompt, new, limit=base.spec.max_seq_len, name="model.max_seq_len")
        cache = KVCache(batch=batch, n_layer=len(base.blocks), capacity=prompt + new, device=engine.stage.device)
        return BuiltinDecoder(engine=engine, cache=cache)
    config = getattr(base, "config", None)
    if config is None or not hasattr(base, "get_input_embeddings"):
        raise ValueError(f"generate needs the built-in GPT or Llama or a transformers causal LM, got {type(base).__name__}")
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int):
        _check_room(prompt, new, limit=limit, name=f"{type(config).__name__}.max_position_embeddings")
    return TransformersDecoder.of(engine, base)


@contextmanager
def contiguous_head(model: nn.Module) -> Iterator[None]:
    """Within the block, the output head of a transformers `model` takes its input contiguous ([Note: the head's input])."""
    base = base_model(model)
    head = base.get_output_embeddings() if isinstance(base, nn.Module) and hasattr(base, "get_output_embeddings") else None
    if not isinstance(head, nn.Module):
        yield  # the built-ins compute every position's logits, from contiguous hidden states
        return
    handle = head.register_forward_pre_hook(_contiguous_inputs)
    try:
        yield
    finally:
        handle.remove()


def _contiguous_inputs(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def base_model(model: nn.Module) -> nn.Module:
    """The model whose forward decodes: peft's base model where peft wraps it, else `model`."""
    return model.get_base_model() if is_peft_model(model) else model


def _check_room(prompt: int, new: int, *, limit: int, name: str) -> None:
    if prompt + new > limit:
        raise ValueError(
            f"prompts of {prompt} tokens + max_new_tokens {new} = {prompt + new} is above {name} {limit}: "
            "ask for fewer new tokens or shorten the prompts"
        )
