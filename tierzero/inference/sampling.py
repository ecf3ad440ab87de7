"""How the next token is chosen from the last position's logits: greedy, or sampled.

Sampling follows the usual order: the logits divided by the temperature, then cut to the
`top_k` largest, then to the smallest set of tokens whose probability reaches `top_p`, and
one token drawn from what is left. The draw takes a `torch.Generator`, so that one seed
gives the same tokens wherever the same logits are seen: on every rank of a job, and in
every run. With `top_k=1` only the largest logit is left, and the draw is greedy's choice.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Sampling"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Sampling:
    """The choice of each next token (`generate`'s keywords of the same names)."""

    do_sample: bool = False
    """False: the most likely token (greedy); the other fields are then not used."""
    temperature: float = 1.0
    """The logits are divided by it before sampling: below 1 sharper, above 1 flatter."""
    top_k: int | None = None
    """Sample among the k most likely tokens only; None: all."""
    top_p: float | None = None
    """Sample among the most likely tokens whose probabilities add up to top_p (nucleus); None: all."""

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature is {self.temperature}, expected a number above 0 (1.0 leaves the logits as they are)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k is {self.top_k}, expected a positive integer or None")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p is {self.top_p}, expected a number in (0, 1] or None")

    def pick(self, logits: torch.Tensor, *, generator: torch.Generator | None = None) -> torch.Tensor:
        """One token id per row of `logits` (batch, vocabulary), as a long tensor (batch,)."""
        if not self.do_sample:
            return logits.argmax(dim=-1)
        scores = logits.float() / self.temperature
        if self.top_k is not None and self.top_k < scores.shape[-1]:
            kth = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            scores = _nucleus(scores, self.top_p)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _nucleus(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """`scores` with every token outside the smallest most-likely set of probability >= top_p set to -inf."""
    ordered, order = torch.sort(scores, dim=-1, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each
    drop = before >= top_p  # never the first: its mass before is 0
    return scores.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
