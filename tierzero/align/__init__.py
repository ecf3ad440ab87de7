"""Preference tuning on the engine: objectives that compare a policy with its frozen reference.

dpo.py holds the DPO loss and the completions' log-probs; step.py runs one DPO step on the
engine, the reference being the same base with its LoRA adapters switched off. The
preference records themselves are read by tierzero.data.preference.
"""

from tierzero.align.dpo import DpoTerms, dpo_loss, sequence_logps
from tierzero.align.step import DpoStats, completion_logps, dpo_micro_step, dpo_train_step, logits_of
from tierzero.data.preference import PreferenceBatches

__all__ = [
    "DpoStats", "DpoTerms", "PreferenceBatches", "completion_logps", "dpo_loss", "dpo_micro_step", "dpo_train_step", "logits_of",
    "sequence_logps",
]
