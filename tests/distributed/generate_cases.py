"""What the generation tests share: tiny transformers models, a left-padded batch, the placements.

The models are built from small configs with a fixed seed and a wide initialisation
(initializer_range 0.3), so that greedy decoding wanders over many tokens rather than
repeating one: a test of equal tokens then says something. Nothing is downloaded.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tierzero

VOCAB = 64
PROMPT_LENGTHS = (9, 5, 2, 7)
"""Batch 4, mixed lengths: three rows padded on the left."""
NEW_TOKENS = 24
PAD = 0
MODELS = ("llama", "gpt2")
PLACEMENTS = ("device", "cpu", "nvme")


def hf_model(name: str) -> nn.Module:
    """A two-layer LlamaForCausalLM (grouped-query attention) or GPT2LMHeadModel (tied head), seed 0, eval mode."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=128, n_embd=32, n_layer=2, n_head=2, initializer_range=0.3,
            bos_token_id=None, eos_token_id=None,
        )  # fmt: skip
        return GPT2LMHeadModel(config).eval()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=128, initializer_range=0.3,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def prompts(lengths: tuple[int, ...] = PROMPT_LENGTHS, *, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of random prompts of `lengths`, padded on the left with PAD."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, VOCAB, (n,), generator=g)
        mask[row, width - n :] = 1
    return ids, mask


def engine_config(stage: int, placement: str, swap: Path | str) -> dict[str, Any]:
    """Stage `stage` with its state homed on `placement`: every kind the stage may move (stage 1: the optimizer's)."""
    offload: dict[str, str] = {}
    if placement != "device":
        offload = {"optimizer": placement}
        if stage == 3:
            offload |= {"params": placement, "gradients": placement}
    return {"zero": {"stage": stage}, "offload": offload, "tiers": {"nvme": {"path": str(swap)}}}


def reference(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, **options: Any) -> torch.Tensor:
    """transformers' own greedy `generate` on `model` (left untouched)."""
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=PAD, **options)


def engine_generate(model: nn.Module, config: dict[str, Any], ids: torch.Tensor, mask: torch.Tensor, **options: Any) -> torch.Tensor:
    """`engine.generate` on a copy of `model` under `config`; the engine is closed after."""
    with tierzero.initialize(copy.deepcopy(model), config) as engine:
        return engine.generate(ids, mask, pad_token_id=PAD, **options)


def stopping_token(tokens: torch.Tensor, prompt: int) -> int:
    """A token row 1 first emits a few steps in (greedy `tokens`, prompts `prompt` wide): as EOS, row 1 stops there."""
    row = tokens[1, prompt:].tolist()
    return next(t for i, t in enumerate(row) if i >= 3 and t not in row[:i])
