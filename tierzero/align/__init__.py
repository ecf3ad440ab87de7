"""Preference tuning on the engine: objectives that compare a policy with its frozen reference.

dpo.py holds the DPO loss and the completions' log-probs; step.py runs one DPO step on the
engine, the reference being the same base with its LoRA adapters switched off, or the initial
model's log-probs precomputed before the first step (reference.py, kept in table.py's
`ReferenceTable`). The preference records themselves are read by tierzero.data.preference.
"""

from tierzero.align.dpo import DpoTerms, dpo_loss, sequence_logps
from tierzero.align.reference import precompute_reference, reference_for_run
from tierzero.align.step import DpoStats, completion_logps, dpo_micro_step, dpo_train_step, logits_of
from tierzero.align.table import ReferenceTable
from tierzero.data.preference import PreferenceBatches

__all__ = [
    "DpoStats", "DpoTerms", "PreferenceBatches", "ReferenceTable", "completion_logps", "dpo_loss", "dpo_micro_step", "dpo_train_step",
    "logits_of", "precompute_reference", "reference_for_run", "sequence_logps",
]
