"""The DPO objective: each completion's summed log-probability, and the sigmoid loss of the chosen against the rejected.

[Note: the DPO loss]
For a pair (prompt x, chosen y_c, rejected y_r), pi(y | x) is the policy's summed
log-probability of the completion's tokens (the prompt's and the padding's are left out) and
ref(y | x) the reference's. With the log-ratios r_c = pi(y_c|x) - ref(y_c|x) and r_r likewise,
the margin is beta x (r_c - r_r) and the loss -log sigmoid(margin), averaged over the pairs
(Rafailov et al. 2023; TRL's DPOTrainer, loss_type "sigmoid"). The reward margin logged is the
mean margin, and the accuracy the share of pairs whose margin is positive: both only
describe the step, and carry no gradient. The reference here is the policy's own base with
its LoRA adapters switched off (tierzero.pretrained.lora.adapters_off), so its log-probs
cost a no-grad forward and 2B floats, never a second model; or, with dpo.reference
precomputed, the initial model's log-probs of every record, computed once before the first
step (tierzero/align/reference.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tierzero.data.preference import IGNORE

__all__ = ["DpoTerms", "dpo_loss", "sequence_logps"]


@dataclass(frozen=True, slots=True)
class DpoTerms:
    """One micro-batch's DPO loss and what the run logs beside it; see [Note: the DPO loss]."""

    loss: torch.Tensor
    """Scalar: the mean over the pairs of -log sigmoid(margin)."""
    margin: torch.Tensor
    """Scalar: the mean reward margin, beta x (r_c - r_r)."""
    accuracy: torch.Tensor
    """Scalar: the share of pairs whose margin is positive."""

    def detached(self) -> DpoTerms:
        return DpoTerms(loss=self.loss.detach(), margin=self.margin, accuracy=self.accuracy)


def sequence_logps(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each row's summed log-probability of its targets, `IGNORE`d positions left out: (rows,) fp32.

    The same cross-entropy as the next-token loss (tierzero.engine.micro_step), per token: the
    memory it takes is the SFT step's, for twice the rows.
    """
    per_token = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="none")
    return -per_token.view(targets.shape).sum(dim=1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, *, beta: float) -> DpoTerms:
    """The sigmoid DPO loss of (2B,) summed log-probs, the B chosen rows first, then the B rejected ones."""
    if policy.shape != reference.shape or policy.ndim != 1 or policy.numel() % 2:
        shapes = f"{tuple(policy.shape)} and {tuple(reference.shape)}"
        raise ValueError(f"policy and reference log-probs of shapes {shapes}: expected (2B,) each, the chosen rows first")
    chosen, rejected = policy.chunk(2)
    ref_chosen, ref_rejected = reference.chunk(2)
    margins = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    loss = -F.logsigmoid(margins).mean()
    shown = margins.detach()
    return DpoTerms(loss=loss, margin=shown.mean(), accuracy=(shown > 0).float().mean())
