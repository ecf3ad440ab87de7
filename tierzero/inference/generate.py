"""`generate`: new tokens from a model whose weights live in the tiers, one decoding step at a time.

The loop runs the engine's own forward (tierzero/inference/decoders.py): first on the whole
left-padded batch of prompts, then on one new token per row, the earlier ones in the
model's KV cache. Each step gathers every unit once for the whole batch, so the weights'
bytes read per token fall as the batch grows. A row stops at its first EOS token and
emits the pad token from then on; the loop ends when every row has stopped or after
`max_new_tokens` steps. The model runs in eval mode (no dropout) and goes back to its
own mode after.

[Note: ranks in step]
Under stage 3 every forward all-gathers each unit, so all ranks must run the same number
of steps even where their rows stop at different times: with an EOS token, each step ends
with one all-reduce of the rows still going, over the group the gathers use, and the loop
goes on while any rank has one. Sampling draws from a `torch.Generator` seeded with `seed`
(tierzero/inference/sampling.py), so ranks given the same prompts and seed pick the same
tokens.

[Note: engine.generate]
The engine layer sits below this one and cannot import it, so `Engine` has no `generate`.
`GeneratingEngine` is the engine with this one method more, delegating here, and it is
what `tierzero.initialize` builds (tierzero/api.py sits above both): nothing is patched onto
a class or an instance, and `generate(engine, ...)` works on any engine.

[Note: the KV cache in the ledger]
The KV cache is booked in the device tier as `Kind.ACTIVATION` (what a forward keeps on the
device besides the weights) from the prompts' forward to the last step, at its full size,
prompt + `max_new_tokens` a row ([Note: what a batch costs] in tierzero/inference/batch.py):
the built-ins' cache takes that at its first write, transformers' grows to at most that. So
`engine.memory_report()` and the store's report show it in the device tier's bytes and peak.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tierzero.comm import collectives as C
from tierzero.common.slices import Kind, Tier
from tierzero.engine.engine import Engine
from tierzero.inference.batch import batch_cost
from tierzero.inference.decoders import contiguous_head, decoder_for
from tierzero.inference.sampling import Sampling

__all__ = ["GeneratingEngine", "Stops", "generate"]


def generate(
    engine: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """The prompts followed by their new tokens, (batch, prompt length + steps run), as transformers' `generate` gives them.

    `input_ids` (batch, prompt length), padded on the left where the prompts differ in length,
    `attention_mask` 1 for their real tokens (default: all real). Greedy unless `do_sample`;
    `temperature`, `top_k`, `top_p` shape the sampling, and `seed` makes it reproducible.
    A row stops at any of `eos_token_id` and is filled with `pad_token_id` (default: the
    first EOS id) after it. Collective under stage 3: every rank calls it ([Note: ranks in step]).
    """
    sampling = Sampling(do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens}, expected at least 1")
    device = engine.stage.device
    ids = input_ids.to(device)
    mask = _checked_mask(ids, attention_mask)
    stops = Stops.of(eos_token_id, pad_token_id, batch=ids.shape[0], device=device)
    decoder = decoder_for(engine, batch=ids.shape[0], prompt=ids.shape[1], new=max_new_tokens)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    kv_bytes = ids.shape[0] * batch_cost(engine, prompt=ids.shape[1], new=max_new_tokens).kv_row
    new: list[torch.Tensor] = []
    with torch.no_grad(), _evaluating(engine.module), _booked(engine.store, kv_bytes), contiguous_head(engine.module):
        logits = decoder(ids, mask)
        for step in range(max_new_tokens):
            new.append(stops.apply(sampling.pick(logits, generator=generator)))
            if step + 1 == max_new_tokens or not stops.any_left(engine):
                break
            mask = torch.cat([mask, mask.new_ones((mask.shape[0], 1))], dim=1)
            logits = decoder(new[-1].unsqueeze(1), mask)
    return torch.cat([ids, torch.stack(new, dim=1)], dim=1).to(input_ids.device)


@contextmanager
def _booked(store: Any, nbytes: int) -> Iterator[None]:
    """The KV cache's bytes counted in the device tier for the block ([Note: the KV cache in the ledger])."""
    store.book(Tier.DEVICE, Kind.ACTIVATION, nbytes)
    try:
        yield
    finally:
        store.book(Tier.DEVICE, Kind.ACTIVATION, -nbytes)


@contextmanager
def _evaluating(module: nn.Module) -> Iterator[None]:
    """The module in eval mode (no dropout) for the block, then each submodule back in the mode it had."""
    modes = [(sub, sub.training) for sub in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for sub, training in modes:
            sub.training = training


def _checked_mask(ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The attention mask as 0/1 longs on the ids' device, refused where it cannot be a left-padded batch's."""
    if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 1 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"input_ids must be integer token ids of shape (batch, prompt length), got {ids.dtype} {tuple(ids.shape)}")
    if attention_mask is None:
        return torch.ones_like(ids, dtype=torch.long)
    if attention_mask.shape != ids.shape:
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)}, input_ids {tuple(ids.shape)}: give one entry per token")
    mask = attention_mask.to(device=ids.device, dtype=torch.long)
    real = mask != 0
    if not bool(real[:, -1].all()):
        row = int((~real[:, -1]).nonzero()[0])
        raise ValueError(f"row {row} of the batch ends in padding: pad prompts on the left (a tokenizer's padding_side='left')")
    # Left padding: once a row's real tokens start, every later token is real.
    if bool((real.long().cummax(dim=1).values.bool() & ~real).any()):
        raise ValueError("attention_mask has padding between real tokens: pad prompts on the left only")
    return real.long()


@dataclass(slots=True)
class Stops:
    """Which rows have stopped at an EOS token, and the token they emit from then on."""

    eos: torch.Tensor
    """The EOS ids (empty: no row ever stops early)."""
    pad: int | None
    finished: torch.Tensor = field(repr=False)
    """(batch,) bool: the rows that emitted an EOS token."""

    @classmethod
    def of(cls, eos_token_id: int | Sequence[int] | None, pad_token_id: int | None, *, batch: int, device: torch.device) -> Stops:
        eos = [] if eos_token_id is None else [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
        pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else None)
        finished = torch.zeros(batch, dtype=torch.bool, device=device)
        return cls(eos=torch.tensor(eos, dtype=torch.long, device=device), pad=pad, finished=finished)

    def apply(self, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens` with the stopped rows' replaced by the pad token; rows that emit EOS now stop."""
        if self.eos.numel() == 0:
            return tokens
        assert self.pad is not None
        tokens = torch.where(self.finished, torch.full_like(tokens, self.pad), tokens)
        self.finished |= torch.isin(tokens, self.eos)
        return tokens

    def any_left(self, engine: Any) -> bool:
        """Whether a row goes on here or on another rank of the gathers' group ([Note: ranks in step])."""
        if self.eos.numel() == 0:
            return True
        left = (~self.finished).sum().reshape(1)
        C.all_reduce(left, comm=engine.comm)
        return bool(left.item())


class GeneratingEngine(Engine):
    """The engine `tierzero.initialize` returns: an `Engine` that also generates ([Note: engine.generate])."""

    def generate(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **options: Any) -> torch.Tensor:
        """`tierzero.inference.generate(self, input_ids, attention_mask, **options)`: see there."""
        self._require_open("generate()")
        return generate(self, input_ids, attention_mask, **options)
