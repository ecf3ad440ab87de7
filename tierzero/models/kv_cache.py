"""Incremental decoding for the built-in models: each block's keys and values, kept between calls.

Generation (tierzero/inference/generate.py) runs the model once on the prompts, then on one
new token per row at a time. A `KVCache` passed as `model(idx, cache=cache, attention_mask=m)`
keeps what every block's attention computed for the tokens before, so a step costs one
token's work per block instead of the whole sequence's.

[Note: left padding]
A batch of prompts of different lengths is padded on the left, and `attention_mask`
(batch, tokens so far) marks the real tokens with 1, as transformers takes it. A row's
positions count only its real tokens (its first real token is position 0, padding takes
position 0 too), so a padded row decodes as it would alone. No query attends to a padding
key; each query always sees itself, so that a padding query has a row of scores that is not
empty (an empty one gives NaNs, and a NaN value times a zero weight is still NaN in the
other rows' sums).

The training forward takes no cache and is unchanged: the blocks take the cache as an
optional keyword, and without it run the very same code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = ["CachedAttention", "KVCache", "LayerKV", "Window"]


@dataclass(slots=True, eq=False)
class LayerKV:
    """One block's keys and values, each (batch, heads, capacity, head size), allocated at the first write
    (in the dtype and on the device the block computes in, which autocast may choose)."""

    keys: torch.Tensor | None = None
    values: torch.Tensor | None = None

    def write(self, k: torch.Tensor, v: torch.Tensor, *, start: int, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new keys and values at `start`; return every key and value up to them."""
        if self.keys is None or self.values is None:
            self.keys = k.new_empty((k.shape[0], k.shape[1], capacity, k.shape[3]))
            self.values = v.new_empty((v.shape[0], v.shape[1], capacity, v.shape[3]))
        end = start + k.shape[2]
        self.keys[:, :, start:end] = k
        self.values[:, :, start:end] = v
        return self.keys[:, :, :end], self.values[:, :, :end]


@dataclass(frozen=True, slots=True)
class Window:
    """The positions one forward call adds to the cache."""

    start: int
    """Cache slots before it (tokens already decoded, padding included)."""
    positions: torch.Tensor
    """(batch, new tokens) long: each new token's position in its row ([Note: left padding])."""
    mask: torch.Tensor
    """(batch, 1, new tokens, start + new tokens) bool: the keys each new query sees."""


@dataclass(frozen=True, slots=True)
class CachedAttention:
    """What one block needs in one call: its keys and values so far, and the call's window."""

    layer: LayerKV
    window: Window
    capacity: int

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the new queries (batch, heads, new, head size) over every key so far and the new ones."""
        keys, values = self.layer.write(k, v, start=self.window.start, capacity=self.capacity)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=self.window.mask)


class KVCache:
    """The keys and values of every block of a built-in model for one batch, up to `capacity` tokens a row."""

    def __init__(self, *, batch: int, n_layer: int, capacity: int, device: torch.device | str) -> None:
        if batch < 1 or n_layer < 1 or capacity < 1:
            raise ValueError(f"a KV cache needs a positive batch, layer count and capacity, got {batch}, {n_layer}, {capacity}")
        self.capacity = capacity
        self.length = 0
        """Slots filled so far (the same in every row: padding takes slots too)."""
        self.valid = torch.zeros(batch, capacity, dtype=torch.bool, device=device)
        """Which slots hold a real token (the attention mask, as given so far)."""
        self.layers = [LayerKV() for _ in range(n_layer)]

    def open(self, idx: torch.Tensor, attention_mask: torch.Tensor | None) -> Window:
        """Take the next `idx.shape[1]` slots for a forward call on `idx` (batch, new tokens).

        `attention_mask` (batch, slots so far + new tokens), 1 for a real token, as transformers
        takes it; None: every new token is real.
        """
        batch, new = idx.shape
        start, end = self.length, self.length + new
        if batch != self.valid.shape[0]:
            raise ValueError(f"the KV cache was made for a batch of {self.valid.shape[0]} rows, the forward got {batch}")
        if end > self.capacity:
            raise ValueError(f"the KV cache holds {self.capacity} tokens a row, this forward would fill {end}: make it larger")
        if attention_mask is None:
            self.valid[:, start:end] = True
        elif tuple(attention_mask.shape) != (batch, end):
            raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(batch, end)}: one column per token so far")
        else:
            self.valid[:, :end] = attention_mask.to(device=self.valid.device, dtype=torch.bool)
        valid = self.valid[:, :end]
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, start:end]
        queries = torch.arange(start, end, device=valid.device).unsqueeze(1)
        keys = torch.arange(end, device=valid.device).unsqueeze(0)
        sees = ((keys <= queries) & valid.unsqueeze(1)) | (keys == queries)
        self.length = end
        return Window(start=start, positions=positions, mask=sees.unsqueeze(1))

    def attention(self, window: Window) -> list[CachedAttention]:
        """Each block's part of the call `window` belongs to, in block order."""
        return [CachedAttention(layer=layer, window=window, capacity=self.capacity) for layer in self.layers]

    @property
    def nbytes(self) -> int:
        """Bytes the keys and values hold so far (the mask aside)."""
        return sum(t.nbytes for layer in self.layers for t in (layer.keys, layer.values) if t is not None)
