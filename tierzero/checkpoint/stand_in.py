"""A random-weight transformers checkpoint to fine-tune, written as `tierzero make-checkpoint` asks.

Nothing can be downloaded on some machines, yet fine-tuning (and its benchmarks) wants a
published-style model directory: config.json, sharded safetensors with their index, and a real
tokenizer. This writes one. The model is `LlamaForCausalLM` built on the meta device from a
`LlamaConfig`, so the names, shapes and tied weights are transformers' own; each tensor is then
generated alone, as `LlamaForCausalLM._init_weights` initialises it (linear and embedding
weights normal(0, initializer_range), the padding token's embedding row zero, norms one), from a
generator seeded by (seed, tensor name), and handed to the export writer, which appends it to its
shard at once (see [Note: streamed export] in export.py): memory holds one tensor, never a shard.
The same seed gives the same bits at any shard size; a bf16 checkpoint is the fp32 one rounded.

The tokenizer is a byte-level BPE trained with the `tokenizers` package on the first
`tokenizer_bytes` of this Python's standard library sources (sorted by path), with `<unk>`,
`<s>`, `</s>` and `<pad>` as ids 0-3, saved as the PreTrainedTokenizerFast that
`AutoTokenizer.from_pretrained(OUT)` loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierzero.checkpoint.export import (
    DEFAULT_MAX_SHARD_SIZE,
    Exported,
    PretrainedWriter,
    saved_name,
    tied_targets,
    write_model_files,
)
from tierzero.checkpoint.format import TensorEntry
from tierzero.common.sizes import format_size
from tierzero.data import stdlib_dir, stdlib_sources
from tierzero.pretrained.weights import model_tensors

__all__ = ["SIZES", "LlamaSize", "Made", "add_make_checkpoint_command", "make_checkpoint", "train_tokenizer"]

ARCHS = ("llama",)
SPECIAL_TOKENS = {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
"""Ids 0-3 in this order (the trainer's special tokens come first): Llama's <unk>, <s>, </s>, and a pad."""


@dataclass(frozen=True, slots=True, kw_only=True)
class LlamaSize:
    """One size of `make-checkpoint --arch llama`: the LlamaConfig fields it sets."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    tokenizer_bytes: int
    """Bytes of standard-library source the tokenizer is trained on (enough for vocab_size merges)."""

    @property
    def parameters(self) -> int:
        """Parameters of the LlamaForCausalLM, untied head included."""
        d, f, head = self.hidden_size, self.intermediate_size, self.hidden_size // self.num_attention_heads
        attention = 2 * d * d + 2 * d * head * self.num_key_value_heads
        block = attention + 3 * d * f + 2 * d
        return 2 * self.vocab_size * d + self.num_hidden_layers * block + d

    def config(self) -> Any:
        import transformers

        sizes = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "tokenizer_bytes"}
        return transformers.LlamaConfig(**sizes, unk_token_id=0, bos_token_id=1, eos_token_id=2, pad_token_id=3)


SIZES: dict[str, LlamaSize] = {
    "tiny": LlamaSize(
        hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=256, tokenizer_bytes=1 << 20,
    ),
    # 2,225,738,240 parameters: 8.9 GB of fp32 weights, 35.6 GB of fp32 Adam training state.
    "2b": LlamaSize(
        hidden_size=2560, intermediate_size=6912, num_hidden_layers=26, num_attention_heads=20, num_key_value_heads=20,
        vocab_size=32000, max_position_embeddings=2048, tokenizer_bytes=16 << 20,
    ),
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class Made:
    """What `make_checkpoint` wrote."""

    weights: Exported
    parameters: int
    tokenizer_vocab: int


def make_checkpoint(
    out: str | Path,
    *,
    arch: str = "llama",
    size: str = "tiny",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    force: bool = False,
) -> Made:
    """Write a random-weight `arch` checkpoint of `size` into `out`: tokenizer, weights, config."""
    if arch not in ARCHS:
        raise ValueError(f"--arch {arch!r} is not one make-checkpoint writes: pick one of {', '.join(ARCHS)}")
    if size not in SIZES:
        raise ValueError(f"--size {size!r} is not a size of {arch}: pick one of {', '.join(SIZES)}")
    spec, out = SIZES[size], Path(out)
    _claim(out, force=force)
    tokenizer = train_tokenizer(vocab_size=spec.vocab_size, corpus_bytes=spec.tokenizer_bytes)
    _save_tokenizer(tokenizer, out, max_length=spec.max_position_embeddings)
    import transformers

    config = spec.config()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    tensors, targets = model_tensors(model), tied_targets(model)
    entries = [TensorEntry(saved_name(names, targets), t.numel(), dtype, tuple(t.shape)) for names, t in tensors]
    with PretrainedWriter(out, entries, max_shard_size=max_shard_size) as writer:
        for entry in entries:
            writer.write(entry.name, initial_value(model, entry.name, seed=seed, std=config.initializer_range))
        weights = writer.finish()
    write_model_files(out, model, dtype=dtype)
    parameters = sum(t.numel() for _, t in tensors)
    return Made(weights=weights, parameters=parameters, tokenizer_vocab=tokenizer.get_vocab_size())


def initial_value(model: nn.Module, name: str, *, seed: int, std: float) -> torch.Tensor:
    """Parameter `name` of a meta-built transformers model, initialised as its `_init_weights` does, in fp32."""
    owner, _, attr = name.rpartition(".")
    module = model.get_submodule(owner)
    shape = tuple(getattr(module, attr).shape)
    kind = type(module).__name__
    if isinstance(module, (nn.Linear, nn.Embedding)) and attr == "weight":
        value = torch.empty(shape).normal_(0.0, std, generator=torch.Generator().manual_seed(tensor_seed(seed, name)))
        if isinstance(module, nn.Embedding) and module.padding_idx is not None:
            value[module.padding_idx].zero_()
        return value
    if isinstance(module, nn.Linear) or (attr == "bias" and ("Norm" in kind)):
        return torch.zeros(shape)
    if "RMSNorm" in kind or "LayerNorm" in kind:
        return torch.ones(shape)
    raise ValueError(f"{name}: make-checkpoint has no initialisation for a {kind}.{attr}")


def tensor_seed(seed: int, name: str) -> int:
    """A generator seed of (seed, tensor name): a tensor's values depend on nothing else."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def _claim(out: Path, *, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"make-checkpoint output {out} is a file: name a new directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"make-checkpoint output {out} is not empty: name a new directory, or pass --force to write over it")
    out.mkdir(parents=True, exist_ok=True)


# ---- the tokenizer ------------------------------------------------------------------------


def train_tokenizer(*, vocab_size: int, corpus_bytes: int) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of exactly `vocab_size` ids, trained on standard-library sources."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(corpus_bytes), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(
            f"the tokenizer learned {tokenizer.get_vocab_size()} ids from {format_size(corpus_bytes)} of {stdlib_dir()}, "
            f"the model embeds {vocab_size}: train it on more text"
        )
    bos = SPECIAL_TOKENS["bos_token"]
    # Llama's tokenizers start each text with <s>.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    return tokenizer


def _corpus(limit: int) -> Iterator[str]:
    """The first `limit` bytes of the standard library's *.py files, file by file in path order."""
    left = limit
    for path in stdlib_sources():
        if left <= 0:
            return
        with open(path, "rb") as f:
            raw = f.read(left)
        left -= len(raw)
        yield raw.decode("utf-8", errors="replace")


def _save_tokenizer(tokenizer: Any, out: Path, *, max_length: int) -> None:
    import transformers

    wrapped = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, model_max_length=max_length, **SPECIAL_TOKENS)
    wrapped.save_pretrained(str(out))
