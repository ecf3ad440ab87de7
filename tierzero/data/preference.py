"""Preference data for DPO: JSON Lines records {prompt, chosen, rejected}, tokenized into pairs and batched.

[Note: preference sequences]
Each record becomes two sequences, prompt + chosen and prompt + rejected, tokenized the way
TRL's DPOTrainer does: the prompt and each prompt + completion text are encoded (without the
tokenizer's special tokens, as the packed stream is), the completion starts where the prompt's
ids and the joint ids part (a token may merge across the boundary), and the EOS id ends it.
A prompt longer than dpo.max_prompt_len keeps its last tokens, the ones nearest the
completion; the sequence is then cut to train.seq_len + 1 tokens, the completion's end first,
so every completion keeps at least one token. Input and target are the sequence shifted by
one, as packed batches are; a target that is a prompt token or padding is `IGNORE`, so only
the completion's tokens count in its log-probability. Rows are padded on the right with the
EOS id to the batch's longest: under causal attention no earlier position sees a pad, so no
attention mask is needed, and a batch is only as wide as its longest pair.

Batches follow [Note: batches by index] (tierzero/data/batches.py): global batch `index` takes
positions [index x global_batch, (index + 1) x global_batch) of an endless run of epochs, each
a permutation of the records drawn from (seed, epoch), rank r the micro_batch_size from
r x micro_batch_size.
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierzero.common.safe_files import loads_bounded
from tierzero.data.shape import BatchShape
from tierzero.data.sources import Format, encodes_utf8, find_sources
from tierzero.data.tokenizer import TextTokenizer, load_tokenizer

__all__ = ["FIELDS", "IGNORE", "PreferenceBatch", "PreferenceBatches", "PreferencePair", "read_preferences", "tokenize_pairs"]

FIELDS = ("prompt", "chosen", "rejected")
"""The string fields of every preference record."""
IGNORE = -100
"""The target of a position whose prediction does not count (a prompt token, padding): cross_entropy's ignore_index."""
ENCODE_BATCH = 1024
"""Records tokenized at a time."""


@dataclass(frozen=True, slots=True)
class PreferencePair:
    """One record's token ids: the prompt's, and each completion's (its EOS id last)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


@dataclass(frozen=True, slots=True)
class PreferenceBatch:
    """One rank's micro-batch of B pairs as 2B rows: the B chosen sequences first, then the B rejected ones."""

    tokens: torch.Tensor
    """(2B, width) int64 input ids."""
    targets: torch.Tensor
    """(2B, width) int64 next ids, `IGNORE` where the target is a prompt token or padding."""
    records: torch.Tensor | None = None
    """(B,) int64: each pair's record number in the dataset, in the order of the rows (a precomputed reference
    is looked up by it, tierzero/align/reference.py); None for a batch not drawn from `PreferenceBatches`."""

    @property
    def pairs(self) -> int:
        return self.tokens.shape[0] // 2


def read_preferences(path: str | os.PathLike[str], *, format: str = "auto") -> Iterator[tuple[str, str, str]]:
    """(prompt, chosen, rejected) of every record under `path` (a file, directory or glob), in order."""
    for source in find_sources(path, format=format):
        if source.format is not Format.JSONL:
            raise ValueError(
                f"data.path file {source.path} is not JSON Lines: train.objective dpo reads {{prompt, chosen, rejected}} "
                "records from *.jsonl or *.ndjson files; rename it, leave it out of data.path, or set data.format: jsonl"
            )
        yield from _records(source.path)


def _records(path: Path) -> Iterator[tuple[str, str, str]]:
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield _record(raw, where=f"data.path file {path} line {number}")


def _record(raw: bytes, *, where: str) -> tuple[str, str, str]:
    try:
        record = loads_bounded(raw, name=where)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        detail = exc.reason if isinstance(exc, UnicodeDecodeError) else exc.msg
        raise ValueError(f"{where} is not a JSON object ({detail}): fix or remove the line") from None
    except ValueError as exc:
        raise ValueError(f"{exc}: fix or remove the line") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where} is a JSON {type(record).__name__}, expected an object with prompt, chosen and rejected: fix the line")
    for name in FIELDS:
        if name not in record:
            keys = ", ".join(map(repr, list(record)[:8])) or "none"
            raise ValueError(f"{where} has no {name!r} field (its keys: {keys}): each record needs prompt, chosen and rejected strings")
        if not isinstance(record[name], str) or not encodes_utf8(record[name]):
            raise ValueError(f"{where}: field {name!r} is not a string of UTF-8 text: fix the line")
    return record["prompt"], record["chosen"], record["rejected"]


def tokenize_pairs(records: list[tuple[str, str, str]], tokenizer: TextTokenizer) -> list[PreferencePair]:
    """Each record's ids, as [Note: preference sequences] says."""
    pairs = []
    for start in range(0, len(records), ENCODE_BATCH):
        chunk = records[start : start + ENCODE_BATCH]
        texts = [text for prompt, chosen, rejected in chunk for text in (prompt, prompt + chosen, prompt + rejected)]
        ids = tokenizer.encode_batch(texts)
        for i in range(len(chunk)):
            prompt, with_chosen, with_rejected = ids[3 * i : 3 * i + 3]
            cut = min(_common_prefix(prompt, with_chosen), _common_prefix(prompt, with_rejected))
            pairs.append(
                PreferencePair(
                    prompt=prompt[:cut],
                    chosen=_ended(with_chosen[cut:], tokenizer.eos_id),
                    rejected=_ended(with_rejected[cut:], tokenizer.eos_id),
                )
            )
    return pairs


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _ended(ids: list[int], eos: int) -> list[int]:
    return ids if ids and ids[-1] == eos else [*ids, eos]


@dataclass(slots=True, kw_only=True)
class PreferenceBatches(BatchShape):
    """`PreferenceBatch`es of one rank, by global batch index; see [Note: preference sequences]."""

    pairs: list[PreferencePair]
    pad_id: int
    max_prompt_len: int
    """Prompt tokens kept, its last ones (`dpo.max_prompt_len`, 0 resolved to half of seq_len)."""
    _orders: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        BatchShape.__post_init__(self)
        if not self.pairs:
            raise ValueError("data.path holds no preference records: add {prompt, chosen, rejected} lines to its *.jsonl files")
        if not 0 <= self.max_prompt_len <= self.seq_len:
            raise ValueError(f"max_prompt_len {self.max_prompt_len} is outside 0..seq_len {self.seq_len}")

    @classmethod
    def from_config(cls, cfg: Any, *, rank: int = 0, world_size: int = 1) -> PreferenceBatches:
        """Read and tokenize `cfg.data` (data.path, data.tokenizer) and batch it by `cfg.train` and `cfg.dpo`."""
        data = cfg.data
        if data.path is None or data.tokenizer is None:
            raise ValueError("train.objective dpo needs data.path (JSON Lines preference records) and data.tokenizer: set both")
        tokenizer = load_tokenizer(data.tokenizer)
        pairs = tokenize_pairs(list(read_preferences(data.path, format=data.format)), tokenizer)
        longest = cfg.dpo.max_prompt_len or cfg.train.seq_len // 2
        shape = BatchShape.of(cfg, rank=rank, world_size=world_size)
        return cls(pairs=pairs, pad_id=tokenizer.eos_id, max_prompt_len=longest, **shape)

    @property
    def tokens_per_batch(self) -> int:
        """micro_batch_size x seq_len, as the run's header counts a step's tokens: a pair counts once, though its
        two sequences each run two forwards (the policy's and the reference's)."""
        return self.micro_batch_size * self.seq_len

    def order(self, epoch: int) -> np.ndarray:
        """The record numbers of `epoch` in the order it visits them."""
        if epoch not in self._orders:
            # this epoch's, and the one before while a batch spans the boundary
            self._orders = {e: o for e, o in self._orders.items() if e == epoch - 1}
            self._orders[epoch] = np.random.default_rng((self.seed, epoch)).permutation(len(self.pairs))
        return self._orders[epoch]

    def batch(self, index: int) -> PreferenceBatch:
        """This rank's part of global batch `index` (a micro-step counter)."""
        return self.of_records(self.records_of(index))

    def records_of(self, index: int) -> list[int]:
        """The record numbers of this rank's part of global batch `index`, in order."""
        if index < 0:
            raise ValueError(f"batch index {index} is negative")
        first = index * self.global_batch + self.rank * self.micro_batch_size
        picked = []
        for position in range(first, first + self.micro_batch_size):
            epoch, within = divmod(position, len(self.pairs))
            picked.append(int(self.order(epoch)[within]))
        return picked

    def of_records(self, records: Sequence[int]) -> PreferenceBatch:
        """The pairs of these record numbers as one batch: the chosen rows, then the rejected ones."""
        picked = [self.pairs[r] for r in records]
        chosen = [self.window(pair.prompt, pair.chosen) for pair in picked]
        rows = self.rows(chosen + [self.window(pair.prompt, pair.rejected) for pair in picked])
        return PreferenceBatch(tokens=rows.tokens, targets=rows.targets, records=torch.tensor(list(records), dtype=torch.int64))

    def fingerprint(self) -> str:
        """A checksum of what every record's sequences are made of (each pair's ids, seq_len, max_prompt_len), in
        record order: a reference computed for these records is refused for others (tierzero/align/reference.py)."""
        crc = zlib.crc32(np.array([len(self.pairs), self.seq_len, self.max_prompt_len], dtype=np.int64).tobytes())
        for pair in self.pairs:
            for ids in (pair.prompt, pair.chosen, pair.rejected):
                crc = zlib.crc32(np.array([len(ids), *ids], dtype=np.int64).tobytes(), crc)
        return f"{crc:08x}"

    def window(self, prompt: list[int], completion: list[int]) -> tuple[list[int], int]:
        """(the sequence, cut to seq_len + 1 tokens, and how many of its first tokens are the prompt's)."""
        kept = prompt[len(prompt) - self.max_prompt_len :] if len(prompt) > self.max_prompt_len else prompt
        return (kept + completion)[: self.seq_len + 1], len(kept)

    def rows(self, windows: list[tuple[list[int], int]]) -> PreferenceBatch:
        """The windows as input and target rows, padded on the right to the longest."""
        width = max(len(ids) for ids, _ in windows) - 1
        tokens = torch.full((len(windows), width + 1), self.pad_id, dtype=torch.int64)
        targets = torch.full((len(windows), width), IGNORE, dtype=torch.int64)
        for row, (ids, prompt) in enumerate(windows):
            tokens[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            # target j is token j + 1: it counts from the first completion token to the last
            targets[row, max(prompt - 1, 0) : len(ids) - 1] = tokens[row, max(prompt, 1) : len(ids)]
        return PreferenceBatch(tokens=tokens[:, :-1].contiguous(), targets=targets)
