"""One DPO training step on the engine: the reference's forward with the adapters off, the policy's, the loss.

The reference's forward runs first, without gradients, through the engine as any forward
does (the units gather on demand; stage 3 frees each after use): its logits are reduced to
2B log-probs at once and freed before the policy's forward builds its activations, so the
step holds what an SFT step on 2B sequences holds, plus 2B floats. `tierzero train` calls
`dpo_train_step` in place of its next-token step when train.objective is dpo.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tierzero.align.dpo import DpoTerms, dpo_loss, sequence_logps
from tierzero.align.table import ReferenceTable
from tierzero.data.preference import PreferenceBatch
from tierzero.pretrained.lora import adapters_off

__all__ = ["DpoStats", "completion_logps", "dpo_micro_step", "dpo_train_step", "logits_of"]


@dataclass(frozen=True, slots=True)
class DpoStats:
    """One optimizer step's DPO loss, reward margin and accuracy: the means over its micro-batches and the ranks."""

    loss: float
    margin: float
    accuracy: float


def logits_of(engine: Any, tokens: torch.Tensor, *, is_hf: bool) -> torch.Tensor:
    """The model's logits for `tokens`: a transformers model's `.logits`, a built-in's output without targets."""
    return engine(input_ids=tokens).logits if is_hf else engine(tokens)


def completion_logps(
    engine: Any, batch: PreferenceBatch, *, is_hf: bool, table: ReferenceTable | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy's and the reference's summed log-probs of the completions, (2B,) each, the policy's with gradients.

    The reference's forward runs first, so that its logits are freed before the policy's builds
    its activations; `dpo_micro_step`, and TRL's DPOTrainer on the engine, take their loss from these.
    With `table` (dpo.reference precomputed, tierzero/align/reference.py) the reference is looked up instead.
    """
    if table is not None:
        reference = table.lookup(batch).to(batch.tokens.device)
    else:
        with torch.no_grad(), adapters_off(engine.module):
            reference = sequence_logps(logits_of(engine, batch.tokens, is_hf=is_hf), batch.targets)
    policy = sequence_logps(logits_of(engine, batch.tokens, is_hf=is_hf), batch.targets)
    return policy, reference


def dpo_micro_step(
    engine: Any, batch: PreferenceBatch, *, beta: float, is_hf: bool, mark: Callable[[str], None] | None = None,
    table: ReferenceTable | None = None,
) -> DpoTerms:
    """Reference and policy forwards, the DPO loss, backward and `engine.step()` on one micro-batch; the detached terms.

    `mark` hears each part begin (forward, backward, step), as `micro_step`'s does.
    """
    mark = mark or _unmarked
    mark("forward")
    policy, reference = completion_logps(engine, batch, is_hf=is_hf, table=table)
    terms = dpo_loss(policy, reference, beta=beta)
    mark("backward")
    engine.backward(terms.loss)
    mark("step")
    engine.step()
    return terms.detached()


def dpo_train_step(
    engine: Any, data: Any, dpo: Any, *, step: int, accumulation: int, device: torch.device, is_hf: bool,
    mark: Callable[[str], None] | None = None, table: ReferenceTable | None = None,
) -> DpoStats:  # fmt: skip
    """One optimizer step over `accumulation` micro-batches of `data` (`PreferenceBatches`), `dpo` the `dpo` section;
    `table`, the precomputed reference (None: the adapters-off forward).

    The figures are averaged over the micro-batches and over the ranks (one all-reduce), so every
    rank returns the same; `mark`, if any, also hears "" at the end of each micro-step.
    """
    total = torch.zeros(3, dtype=torch.float32, device=device)
    for micro in range(accumulation):
        batch = data.batch(step * accumulation + micro)
        if device.type == "cuda":  # pinned, the copies are asynchronous
            tokens, targets = (t.pin_memory().to(device, non_blocking=True) for t in (batch.tokens, batch.targets))
            batch = PreferenceBatch(tokens=tokens, targets=targets, records=batch.records)
        terms = dpo_micro_step(engine, batch, beta=float(dpo.beta), is_hf=is_hf, mark=mark, table=table)
        total += torch.stack([terms.loss.float(), terms.margin.float(), terms.accuracy.float()])
        if mark is not None:
            mark("")
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(total)
        total /= torch.distributed.get_world_size()
    loss, margin, accuracy = (total / accumulation).tolist()
    return DpoStats(loss=loss, margin=margin, accuracy=accuracy)


def _unmarked(part: str) -> None:
    """No one listens to the parts."""
