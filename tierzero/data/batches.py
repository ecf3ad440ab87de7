"""What the training loop asks of its data, and the one place that picks the kind from the config.

[Note: batches by index]
The loop (tierzero.cli.train) calls `batch(step x accumulation + micro)` with the engine's
micro-step counter, which checkpoints keep: every kind of batches makes batch(index) a
pure function of the index, so a resumed run sees the batches an unbroken run sees.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from tierzero.data.bytes import ByteBatches
from tierzero.data.packing import PackedBatches

__all__ = ["Batches", "batches_from_config"]


@runtime_checkable
class Batches(Protocol):
    """One rank's training batches; see [Note: batches by index]."""

    @property
    def world_size(self) -> int:
        """Data-parallel ranks sharing each global batch."""
        ...

    @property
    def global_batch(self) -> int:
        """Sequences in one global batch: micro_batch_size x world_size."""
        ...

    @property
    def tokens_per_batch(self) -> int:
        """Tokens this rank predicts per batch."""
        ...

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's (input, target) int64 tensors of global batch `index`, each (micro_batch_size, seq_len)."""
        ...


def batches_from_config(cfg: Any, *, rank: int, world_size: int) -> Batches:
    """Packed tokens when `cfg.data.tokenizer` is set, else byte-level text."""
    if cfg.data.tokenizer is not None:
        return PackedBatches.from_config(cfg, rank=rank, world_size=world_size)
    return ByteBatches.from_config(cfg, rank=rank, world_size=world_size)
