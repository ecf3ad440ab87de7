"""Packed token batches: the token stream cut into fixed-length sequences, shuffled per epoch, batched by step.

[Note: packed sequences]
The stream (tierzero.data.tokens: documents end to end, the EOS id after each) is cut
into sequences of seq_len + 1 tokens, sequence i starting at token i x seq_len: each
one's last token is the next one's first, so every pair of neighbouring tokens is
predicted exactly once an epoch; a tail too short for a sequence is left out. Input and
target are the sequence shifted by one. Sequences run across document boundaries and
attention is not masked at them, as in most packed pre-training: the EOS token tells the
model where a document ended, and the next one's first tokens see its last ones.

[Note: epochs and resume]
Sequences are visited in an endless run of epochs; epoch e visits all of them in the
permutation drawn from (seed, e). Global batch `index` (the engine's micro-step counter)
takes positions [index x global_batch, (index + 1) x global_batch) of that run, and rank
r the micro_batch_size of them from r x micro_batch_size. A batch can span the end of
one epoch and the start of the next. So `batch(index)` is a pure function of the index:
the ranks together see exactly what one process with world_size x micro_batch_size sees,
and a run resumed at any micro-step, mid-epoch too, sees what an unbroken run sees.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tierzero.data.shape import BatchShape
from tierzero.data.sources import find_sources
from tierzero.data.tokenizer import load_tokenizer
from tierzero.data.tokens import token_stream

__all__ = ["PackedBatches"]

KEPT_ORDERS = 2
"""Epoch permutations kept: the current epoch's, and the previous one while a batch spans the boundary."""


@dataclass(slots=True, kw_only=True)
class PackedBatches(BatchShape):
    """(input, target) int64 batches of shape (micro_batch_size, seq_len) of packed tokens for one rank.

    See [Note: packed sequences] and [Note: epochs and resume].
    """

    tokens: np.ndarray
    """The token stream, 1-D unsigned integers (a memory map of the cache, or any array)."""
    _orders: dict[int, np.ndarray] = field(default_factory=dict, init=False, repr=False)

    def __post_init__(self) -> None:
        BatchShape.__post_init__(self)
        if self.tokens.ndim != 1:
            raise ValueError(f"the token stream has shape {self.tokens.shape}, expected one dimension")
        if self.sequences < 1:
            raise ValueError(
                f"the token stream holds {self.tokens.size:,} tokens, fewer than seq_len + 1 = {self.seq_len + 1}: "
                "add documents to data.path or lower train.seq_len"
            )

    @classmethod
    def from_config(cls, cfg: Any, *, rank: int = 0, world_size: int = 1) -> PackedBatches:
        """Tokenize (or read from the cache) `cfg.data` and batch it by `cfg.train` (seq_len, micro_batch_size, seed)."""
        data = cfg.data
        if data.path is None:
            raise ValueError("data.tokenizer is set but data.path is not: point data.path at the text to tokenize")
        sources = find_sources(data.path, format=data.format)
        stream = token_stream(sources, load_tokenizer(data.tokenizer), text_field=data.text_field, cache_dir=data.cache_dir)
        return cls(tokens=stream.ids, **BatchShape.of(cfg, rank=rank, world_size=world_size))

    @property
    def sequences(self) -> int:
        """Sequences in one epoch."""
        return (self.tokens.size - 1) // self.seq_len

    def epoch(self, index: int) -> float:
        """Epochs done when global batch `index` starts (1.5: half-way through the second)."""
        return index * self.global_batch / self.sequences

    def order(self, epoch: int) -> np.ndarray:
        """The sequence numbers of `epoch` in the order it visits them."""
        if epoch not in self._orders:
            while len(self._orders) >= KEPT_ORDERS:
                del self._orders[min(self._orders)]
            self._orders[epoch] = np.random.default_rng((self.seed, epoch)).permutation(self.sequences)
        return self._orders[epoch]

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's part of global batch `index` (a micro-step counter): (input, target)."""
        if index < 0:
            raise ValueError(f"batch index {index} is negative")
        first = index * self.global_batch + self.rank * self.micro_batch_size
        rows = []
        for position in range(first, first + self.micro_batch_size):
            epoch, within = divmod(position, self.sequences)
            start = int(self.order(epoch)[within]) * self.seq_len
            rows.append(self.tokens[start : start + self.seq_len + 1])
        windows = torch.from_numpy(np.stack(rows).astype(np.int64))
        return windows[:, :-1], windows[:, 1:]
