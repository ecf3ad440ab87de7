"""The `data` section: what `tierzero train` reads, and how it becomes tokens.

With `data.tokenizer` null the text is read as bytes (tierzero.data.bytes), which needs
no setup; with a tokenizer directory the documents are tokenized once into a cache and
packed into sequences (tierzero.data.packing).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tierzero.config.checks import DIRECTORY, PATH_OR_GLOB, Check, MiB, TiB, choice_check, size_check
from tierzero.config.errors import ConfigError
from tierzero.config.tree import Section, setting

FORMATS = ("auto", "text", "jsonl", "datasets")


def _field_name(value: Any) -> str:
    if not (isinstance(value, str) and value.strip() and value == value.strip()):
        raise ValueError(value)
    return value


TEXT_FIELD = Check("a field name such as text", "str", _field_name)


@dataclass(kw_only=True, slots=True, frozen=True)
class DataConfig(Section):
    """The training text `tierzero train` reads: bytes, or documents tokenized and packed."""

    SECTION: ClassVar[str] = "data"
    path: str | None = setting(None, PATH_OR_GLOB)
    """A file, a directory (every file under it) or a glob (** for subdirectories), or a directory
    written by datasets' save_to_disk; null: the Python standard library's *.py sources on this machine
    (byte-level data only)."""
    max_bytes: int = setting(64 * MiB, size_check(limit=TiB))
    """Byte-level data: most bytes of the corpus held in memory; files are taken in a seeded order
    until it is full. Tokenized data is memory-mapped from its cache and has no such bound."""
    tokenizer: str | None = setting(None, DIRECTORY)
    """A local tokenizer directory (tokenizer.json and tokenizer_config.json, as save_pretrained writes
    them; it needs an EOS token): each document is tokenized, followed by the EOS id, and the stream is
    packed into sequences of train.seq_len + 1 tokens, shuffled each epoch. Null: byte-level data
    (256 ids)."""
    format: str = setting("auto", choice_check(FORMATS))
    """With data.tokenizer: how data.path is read. text: each file is one document; jsonl: one JSON
    object per line, its data.text_field the document; datasets: a save_to_disk directory, one
    document per row; auto: *.jsonl and *.ndjson are jsonl, a save_to_disk directory is datasets,
    anything else text."""
    text_field: str = setting("text", TEXT_FIELD)
    """The JSON Lines field, or the dataset column, that holds each document's text."""
    cache_dir: str | None = setting(None, DIRECTORY)
    """Where token ids are cached, one .npy per corpus and tokenizer, checked against the inputs on
    every run and rebuilt when they changed; null: $XDG_CACHE_HOME/tierzero/tokens, else
    ~/.cache/tierzero/tokens. Delete it at any time to free the space."""

    def _validate(self) -> None:
        if self.tokenizer is None:
            if self.format != "auto":
                raise ConfigError(
                    f"data.format is {self.format} but data.tokenizer is not set: byte-level data reads every "
                    "file as raw bytes; set data.tokenizer to a tokenizer directory, or data.format to auto",
                    key="data.format",
                )
            return
        if self.path is None:
            raise ConfigError(
                "data.tokenizer is set but data.path is not: point data.path at the text to tokenize (the "
                "standard library fallback is for byte-level data only)",
                key="data.path",
            )
