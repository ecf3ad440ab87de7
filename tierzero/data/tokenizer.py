"""The tokenizer `data.tokenizer` names, and the check that the model can embed every id it gives.

A local directory (tokenizer.json with tokenizer_config.json, as `save_pretrained` writes
it) loaded by `transformers.AutoTokenizer`: nothing is downloaded and no code from the
directory runs. Documents are encoded without the tokenizer's own special tokens; the
token stream puts its EOS id after each one (tierzero.data.tokens).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from tierzero.common.safe_files import RefusedFile, check_regular, loads_bounded
from tierzero.config.hf_sizes import position_limit

__all__ = ["BYTE_VOCAB", "TextTokenizer", "check_vocab", "load_tokenizer", "model_vocab_size"]

BYTE_VOCAB = 256
"""Ids of the byte-level data (data.tokenizer null)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TextTokenizer:
    """A loaded tokenizer: what the token stream needs of it."""

    directory: str
    backend: Any
    """The `tokenizers.Tokenizer` doing the work (batched, in Rust threads)."""
    eos_id: int
    vocab_size: int
    """Ids it can give: its vocabulary with the added tokens."""

    @property
    def dtype(self) -> np.dtype:
        """The narrowest unsigned dtype holding every id."""
        return np.dtype(np.uint16 if self.vocab_size <= 1 << 16 else np.uint32)

    @property
    def digest(self) -> str:
        """A SHA-256 of everything that decides its ids: the whole tokenizer as JSON, and the EOS id."""
        return hashlib.sha256(f"{self.backend.to_str()}\0{self.eos_id}".encode()).hexdigest()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids, without special tokens."""
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]


def load_tokenizer(directory: str | os.PathLike[str]) -> TextTokenizer:
    """The tokenizer in `directory`, or a ValueError naming data.tokenizer and the fix."""
    directory = os.path.abspath(os.path.expanduser(os.fspath(directory)))
    if not os.path.isdir(directory):
        raise ValueError(f"data.tokenizer {directory} is not a directory: point it at a tokenizer directory (tokenizer.json, tokenizer_config.json)")
    _refuse_special_files(directory)
    try:
        import transformers  # heavy: only for tokenized data
    except ImportError:
        raise ValueError(f"data.tokenizer {directory} needs the transformers package: pip install 'tierzero[data]'") from None
    try:
        loaded = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except RecursionError:
        raise ValueError(f"data.tokenizer {directory}: {_too_deep(directory)}: replace it with the file save_pretrained wrote") from None
    except Exception as exc:  # the tokenizers library raises a bare Exception for a tokenizer.json it cannot parse
        detail = (str(exc).splitlines() or [type(exc).__name__])[0][:200]
        raise ValueError(
            f"data.tokenizer {directory} cannot be loaded ({detail}): it needs tokenizer.json and tokenizer_config.json, "
            "as save_pretrained writes them"
        ) from None
    backend = getattr(loaded, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"data.tokenizer {directory} loads as {type(loaded).__name__}, not a fast tokenizer: add its tokenizer.json "
            "(AutoTokenizer.from_pretrained(...).save_pretrained(DIR) writes one)"
        )
    if loaded.eos_token_id is None:
        raise ValueError(
            f"data.tokenizer {directory} has no EOS token, which marks where each document ends: set eos_token in "
            "its tokenizer_config.json"
        )
    # The token stream is one long sequence: a truncation or padding set in tokenizer.json must not cut documents.
    backend.no_truncation()
    backend.no_padding()
    vocab = max(len(loaded), backend.get_vocab_size(with_added_tokens=True))
    return TextTokenizer(directory=directory, backend=backend, eos_id=int(loaded.eos_token_id), vocab_size=vocab)


def _refuse_special_files(directory: str) -> None:
    """ValueError naming the first FIFO, device or socket among `directory`'s files (symlinks followed):
    transformers opens every tokenizer file it knows by name, and would block on a FIFO for ever."""
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        try:
            if not entry.is_dir():
                check_regular(entry.path)
        except FileNotFoundError:
            continue  # a dangling symlink: transformers says which file it missed
        except RefusedFile as exc:
            raise ValueError(f"data.tokenizer {directory}: {exc}: replace it with the file save_pretrained wrote") from None


def _too_deep(directory: str) -> str:
    """Which JSON file of `directory` nests past the recursion limit, in loads_bounded's words: looked for only
    once transformers hit it, so that a good tokenizer.json (megabytes) is not parsed twice on every load."""
    for path in sorted(p for p in Path(directory).glob("*.json") if p.is_file()):
        try:
            loads_bounded(path.read_bytes(), name=path.name)
        except ValueError as exc:
            if "nests deeper" in str(exc):
                return str(exc)
    return "a JSON file nests deeper than a JSON file may"


def model_vocab_size(model: nn.Module) -> int:
    """Ids a transformers model can take and predict: its input embedding's rows (its head's outputs, if fewer)."""
    embedding = model.get_input_embeddings()
    head = model.get_output_embeddings()
    if isinstance(head, nn.Linear):
        return min(embedding.num_embeddings, head.out_features)
    return embedding.num_embeddings


def check_positions(cfg: Any, model: nn.Module) -> None:
    """Refuse a transformers model by class name with fewer positions than `train.seq_len`: past them a
    learned position table has no row (an IndexError deep in the first step). Its built config is asked,
    so a class default (GPT-2's 1024) counts as much as a key of model.transformers_config; a pretrained
    model's positions are checked where its directory is read (tierzero.pretrained.files.check_positions)."""
    if cfg.model.type != "transformers" or cfg.model.pretrained is not None:
        return
    found = position_limit(getattr(getattr(model, "config", None), "__dict__", {}))
    if found is not None and cfg.train.seq_len > found[0]:
        limit, key = found
        raise ValueError(
            f"train.seq_len {cfg.train.seq_len} is above model.transformers_config.{key} {limit}, the positions of "
            f"the model: lower train.seq_len or raise model.transformers_config.{key}"
        )


def check_vocab(cfg: Any, model: nn.Module) -> None:
    """Refuse a model whose vocabulary does not cover the data's ids (`cfg.data`, `cfg.model`), before any training.

    A built-in model embeds model.vocab_size ids; a transformers model is asked (its
    embedding can differ from config.json's vocab_size after a resize). A transformers model by class name
    must also have positions for train.seq_len (`check_positions`).
    """
    check_positions(cfg, model)
    if cfg.data.tokenizer is None:
        need, what = BYTE_VOCAB, "byte-level data (data.tokenizer null) has 256 ids"
    else:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        need, what = tokenizer.vocab_size, f"data.tokenizer {tokenizer.directory} has {tokenizer.vocab_size:,} ids"
    have = model_vocab_size(model) if cfg.model.is_transformers else cfg.model.vocab_size
    if have >= need:
        return
    if cfg.model.is_transformers:
        where = f"model.pretrained {cfg.model.pretrained}" if cfg.model.pretrained else "model.transformers_config"
        raise ValueError(
            f"{what} but the model ({where}) has vocab_size {have:,}: use the tokenizer that came with the model, "
            f"or a model with vocab_size >= {need}"
        )
    raise ValueError(
        f"{what} but model.vocab_size is {have:,}: set model.vocab_size to at least {need} "
        f"(a multiple of 64 such as {-(-need // 64) * 64} runs faster)"
    )
