"""Byte-level language-model data (data.tokenizer null): a bounded sample of a local text corpus, batched by step.

The corpus is the files `data.path` names (a file, a directory, or a glob); with none
given, the Python standard library's own source files, real text found on every machine
with no download. At most `data.max_bytes` of it is held, as one uint8 tensor: files are
taken in a seeded order and read with `numpy.fromfile(count=...)`, so a corpus far
larger than memory is never read whole.

[Note: one global batch per step]
Batch `index` is drawn from a generator seeded by (seed, index): `global_batch` windows
of `seq_len + 1` bytes at random offsets. Rank r of `world_size` takes windows
`[r * micro_batch_size, (r + 1) * micro_batch_size)`, so the ranks of a data-parallel run
together see exactly the batch a single process with `world_size x micro_batch_size`
sees, and any batch can be produced again without replaying the ones before it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tierzero.common.sizes import format_size
from tierzero.data.shape import BatchShape
from tierzero.data.sources import find_files

__all__ = ["ByteBatches", "ByteCorpus", "load_corpus"]


@dataclass(slots=True, kw_only=True)
class ByteCorpus:
    """The bytes training draws from, and where they came from."""

    tokens: torch.Tensor
    """uint8, 1-D: the sampled files end to end."""
    files: list[Path]
    """The files read, in the order their bytes appear."""

    def __len__(self) -> int:
        return self.tokens.numel()


def load_corpus(files: list[Path], *, max_bytes: int, seed: int) -> ByteCorpus:
    """At most `max_bytes` of `files`, taken whole in a seeded order (the last one cut short).
    Only the files taken are looked at: the default corpus is 13,000 files, of which 4 MiB is a few hundred."""
    if max_bytes < 1:
        raise ValueError(f"data.max_bytes is {max_bytes}, expected a positive size")
    taken, total = [], 0
    for i in np.random.default_rng(seed).permutation(len(files)):
        if total >= max_bytes:
            break
        if size := os.path.getsize(files[i]):
            taken.append((files[i], size))
            total += size
    buffer = np.empty(min(total, max_bytes), dtype=np.uint8)
    filled, used = 0, []
    for path, size in taken:
        chunk = np.fromfile(path, dtype=np.uint8, count=min(size, buffer.size - filled))
        buffer[filled : filled + chunk.size] = chunk
        filled += chunk.size
        used.append(path)
    return ByteCorpus(tokens=torch.from_numpy(buffer[:filled]), files=used)


@dataclass(slots=True, kw_only=True)
class ByteBatches(BatchShape):
    """(input, target) int64 batches of shape (micro_batch_size, seq_len) for one rank; see [Note: one global batch per step]."""

    corpus: ByteCorpus

    def __post_init__(self) -> None:
        BatchShape.__post_init__(self)
        if len(self.corpus) < self.seq_len + 1:
            raise ValueError(
                f"the corpus holds {format_size(len(self.corpus))}, fewer than seq_len + 1 = {self.seq_len + 1} bytes: "
                "add text to data.path, raise data.max_bytes or lower train.seq_len"
            )

    @classmethod
    def from_config(cls, cfg: Any, *, rank: int = 0, world_size: int = 1) -> ByteBatches:
        """Read `cfg.data` (path, max_bytes) and `cfg.train` (seq_len, micro_batch_size, seed)."""
        corpus = load_corpus(find_files(cfg.data.path), max_bytes=cfg.data.max_bytes, seed=cfg.train.seed)
        return cls(corpus=corpus, **BatchShape.of(cfg, rank=rank, world_size=world_size))

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of global batch `index` (a micro-step counter): (input, target)."""
        if index < 0:
            raise ValueError(f"batch index {index} is negative")
        rng = np.random.default_rng((self.seed, index))
        starts = rng.integers(0, len(self.corpus) - self.seq_len, size=self.global_batch)
        mine = torch.from_numpy(starts[self.rank * self.micro_batch_size : (self.rank + 1) * self.micro_batch_size])
        windows = self.corpus.tokens[mine[:, None] + torch.arange(self.seq_len + 1)].long()
        return windows[:, :-1], windows[:, 1:]
