"""What every kind of batches shares: the batch's shape, the seed and this rank's place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["BatchShape"]


@dataclass(slots=True, kw_only=True)
class BatchShape:
    """(micro_batch_size, seq_len) batches for rank `rank` of `world_size`, drawn from `seed`."""

    seq_len: int
    micro_batch_size: int
    seed: int
    rank: int = 0
    world_size: int = 1

    def __post_init__(self) -> None:
        if self.seq_len < 1 or self.micro_batch_size < 1:
            raise ValueError(f"seq_len {self.seq_len} and micro_batch_size {self.micro_batch_size} must be positive")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside world size {self.world_size}")

    @staticmethod
    def of(cfg: Any, *, rank: int, world_size: int) -> dict[str, int]:
        """The shape's fields from `cfg.train` (seq_len, micro_batch_size, seed) and the rank."""
        train = cfg.train
        return {
            "seq_len": train.seq_len,
            "micro_batch_size": train.micro_batch_size,
            "seed": train.seed,
            "rank": rank,
            "world_size": world_size,
        }

    @property
    def global_batch(self) -> int:
        return self.micro_batch_size * self.world_size

    @property
    def tokens_per_batch(self) -> int:
        """Tokens this rank predicts per batch."""
        return self.micro_batch_size * self.seq_len
